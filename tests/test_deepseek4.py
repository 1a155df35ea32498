"""DeepSeek-V4 engine: exact against transformers, incremental, and experts only through acquire.

The oracle is transformers' `DeepseekV4ForCausalLM` (one-shot prefill, float32, CPU)
on a tiny random model exported to a `deepseek4` GGUF with llama.cpp's names and
layouts (tests/deepseek4_fixture.py). 300 tokens go far past the sliding window
(16), close 75 CSA windows (ratio 4, the indexer keeps 8 of them) and 37 HCA windows
(ratio 8).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import model_helpers
from deepseek4_fixture import (
    F32,
    MIN_TOPK_GAP,
    MXFP4,
    assert_clear_topk,
    export_deepseek4_gguf,
    reference_logits,
    tiny_model,
)
from engine.loader import load_model, resident_experts
from engine.models import DeepSeek4Config, DeepSeek4ConfigError, common
from model_helpers import (
    RecordingExperts,
    count_calls,
    load_dense_quantized,
    record_graph_buffers,
    run_chunks,
    run_prompt_then_rest,
)
from packer.gguf_source import GGUFSource

TOL = 1e-4
N_TOKENS = 300


class Case:
    """One exported tiny model, its GGUF and transformers' logits for a token sequence.

    Every top-k selection (experts, indexer entries) of that sequence is clear by
    MIN_TOPK_GAP (the export asserts it): a near-tie would make the comparison a
    coin toss decided by the CPU's summation order, not by the engine.
    """

    def __init__(self, tmp_path_factory, seed: int, expert_type, realistic_dense: bool) -> None:
        self.hf = tiny_model(seed=seed)
        gen = torch.Generator().manual_seed(100 + seed)
        self.tokens = torch.randint(0, self.hf.config.vocab_size, (N_TOKENS,), generator=gen)
        self.path = export_deepseek4_gguf(self.hf, tmp_path_factory.mktemp(f"ds4_{seed}") / "tiny.gguf",
                                          expert_type, realistic_dense=realistic_dense,
                                          clear_topk_for=self.tokens)
        self.reference = reference_logits(self.hf, self.tokens)
        self.model = load_model(self.path)


@pytest.fixture(scope="module")
def f32_case(tmp_path_factory):
    return Case(tmp_path_factory, seed=0, expert_type=F32, realistic_dense=False)


@pytest.fixture(scope="module")
def mxfp4_case(tmp_path_factory):
    """MXFP4 experts, Q8_0 matrices, BF16 compressor/indexer projections: the real file's mix."""
    return Case(tmp_path_factory, seed=3, expert_type=MXFP4, realistic_dense=True)


@pytest.fixture(params=["f32", "mxfp4"])
def case(request):
    return request.getfixturevalue(f"{request.param}_case")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# -- exactness against transformers --------------------------------------------------------


def test_one_shot_prefill_matches_transformers(case):
    logits = run_chunks(case.model, case.tokens, [N_TOKENS])
    assert logits.dtype == torch.float32 and logits.shape == case.reference.shape
    assert max_diff(logits, case.reference) <= TOL


def test_fixture_selections_have_no_near_ties(case):
    """The exactness tests below compare logits only because no pick is a near-tie."""
    margins = assert_clear_topk(case.hf, case.tokens)
    assert {kind for kind, _ in margins} == {"router", "indexer"}
    assert min(margins.values()) >= MIN_TOPK_GAP


def test_indexer_ties_go_to_the_earlier_entry(f32_case):
    """A ReLU'd index score is often exactly 0 (a real model's queries meet such ties:
    the trained demo does at the top-k boundary), and torch's top-k breaks ties in a
    device's own order. The indexer breaks them by entry order, the same on every device:
    with every key 0, every score is 0 and the picks are the first top_k entries, in order."""
    model = f32_case.model
    iw = next(layer.indexer for layer in model.layers if layer.indexer is not None)
    n_entries = iw.top_k + 9
    keys = torch.zeros(n_entries, iw.head_dim)
    x = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    q_residual = torch.randn(2, model.config.q_lora_rank, generator=torch.Generator().manual_seed(4))
    ratio = iw.compressor.ratio
    positions = torch.tensor([ratio * n_entries, ratio * n_entries + 1])  # every entry is visible
    picks = model._pick(iw, iw.proj.linear(x), q_residual, positions, keys)
    assert picks.tolist() == [list(range(iw.top_k))] * 2


def test_chunked_prefill_matches_transformers(case):
    assert max_diff(run_chunks(case.model, case.tokens, [37]), case.reference) <= TOL


def test_irregular_chunks_match_transformers(f32_case):
    """Chunk edges landing inside and across windows (sizes 1..20, both compressors, window 16)."""
    sizes = [1, 3, 16, 5, 2, 20, 7, 1, 1, 9, 4, 13]
    assert max_diff(run_chunks(f32_case.model, f32_case.tokens, sizes), f32_case.reference) <= TOL


def test_prompt_chunks_with_only_their_last_logits_match_transformers(case):
    """A prompt fed as the service feeds it (each chunk's last logits only) gives those
    logits, and leaves the state from which the rest of the sequence matches too."""
    logits, where = run_prompt_then_rest(case.model, case.tokens, chunk=37, prompt=250)
    assert where[:7] == [36, 73, 110, 147, 184, 221, 249]
    assert max_diff(logits, case.reference[where]) <= TOL


def test_a_chunk_in_pieces_matches_transformers(case, monkeypatch):
    """A chunk longer than a piece: attention piece by piece, routed experts once (300
    tokens in pieces of at most 64: five of 60)."""
    monkeypatch.setattr(common, "PROMPT_PIECE", 64)
    assert common.pieces(N_TOKENS) == [slice(i, i + 60) for i in range(0, N_TOKENS, 60)]
    assert max_diff(run_chunks(case.model, case.tokens, [N_TOKENS]), case.reference) <= TOL
    logits, where = run_prompt_then_rest(case.model, case.tokens, chunk=129, prompt=258)  # pieces of 65 and 64
    assert max_diff(logits, case.reference[where]) <= TOL


def test_a_chunk_calls_the_layer_hook_after_every_layer(f32_case):
    seen: list[tuple[int, int]] = []
    f32_case.model.forward(f32_case.tokens[:10], f32_case.model.new_state(), on_layer=lambda *a: seen.append(a))
    layers = f32_case.model.config.n_layers
    assert seen == [(i, layers) for i in range(1, layers + 1)]


def test_token_by_token_decode_matches_transformers(case):
    """All 300 positions one token at a time (a few seconds per model on one CPU thread)."""
    assert max_diff(run_chunks(case.model, case.tokens, [1]), case.reference) <= TOL


@pytest.fixture
def fixed_shape(request):
    """The GPU's decode path (fixed-shape state, engine.models.deepseek4_static) forced on
    for the case's model, on the CPU; restored afterwards."""
    case = request.getfixturevalue(request.param if hasattr(request, "param") else "f32_case")
    case.model.static_decode = True
    yield case
    case.model.static_decode = None
    case.model._static = None


@pytest.mark.parametrize("grouped", [False, True], ids=["graph-per-stretch", "whole-step"])
@pytest.mark.parametrize("fixed_shape", ["f32_case", "mxfp4_case"], indirect=True)
def test_fixed_shape_decode_matches_transformers(fixed_shape, grouped, monkeypatch):
    """Every position one token at a time through the fixed-shape state: past the window,
    through 75 CSA and 37 HCA window closes and an entry-buffer growth (64 -> 128 rows).
    `grouped` makes the resident experts graph-safe on the CPU (GROUPED_DEVICES), so the
    step runs as the one function a GPU captures whole; otherwise as one function per
    stretch between routing points around an eager provider, as a pack's step runs."""
    import engine.experts

    if grouped:
        monkeypatch.setattr(engine.experts, "GROUPED_DEVICES", ("cuda", "cpu"))
    case = fixed_shape
    calls = count_calls(monkeypatch, type(case.model), "_step_static")
    stretches = count_calls(monkeypatch, type(case.model), "_stretch")
    assert max_diff(run_chunks(case.model, case.tokens, [1]), case.reference) <= TOL
    assert len(stretches) == (0 if grouped else N_TOKENS * (len(case.model.layers) + 1))
    static = case.model._static
    assert static is not None and static.layers[0].window.shape[0] == case.hf.config.sliding_window
    assert max(c.entries.shape[0] for layer in static.layers for c in layer.compressors()) == 128
    assert len(calls) == (N_TOKENS if grouped else 0)


def test_dense_weights_kept_quantized_match_transformers(mxfp4_case, monkeypatch):
    """A GPU's loader keeps the Q8_0 / BF16 matrices as the file has them (quant_gemv reads
    them in place): prefill, and the fixed-shape decode steps (grouped experts, the whole
    step as one function), match transformers as the materialized weights do."""
    import engine.experts

    model = load_dense_quantized(mxfp4_case.path, monkeypatch)
    layer = model.layers[0]
    assert layer.attn_proj.stacks and layer.attn_proj.weights["q_a"].raw.numel() > 0
    assert max_diff(run_chunks(model, mxfp4_case.tokens, [N_TOKENS]), mxfp4_case.reference) <= TOL
    monkeypatch.setattr(engine.experts, "GROUPED_DEVICES", ("cuda", "cpu"))
    model.static_decode = True
    tokens = mxfp4_case.tokens[:80]
    assert max_diff(run_chunks(model, tokens, [40, 1]), mxfp4_case.reference[:80]) <= TOL


def test_fixed_shape_decode_between_prefill_chunks(fixed_shape):
    """Decode runs on the fixed-shape state and chunks on the eager one: the rows move
    back and forth at every switch (chunk edges inside and across windows)."""
    case = fixed_shape
    sizes = [7, 1, 1, 1, 5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 20, 1, 1, 3, 1, 2, 1, 1, 1]
    assert max_diff(run_chunks(case.model, case.tokens, sizes), case.reference) <= TOL


def test_two_conversations_take_turns_on_the_fixed_shape_state(fixed_shape):
    """The model keeps one fixed-shape state; two conversations decoding in turns each
    get their own logits (the one that leaves has its rows stored back)."""
    case = fixed_shape
    model, tokens, ref = case.model, case.tokens, case.reference
    states = {"a": model.new_state(), "b": model.new_state()}
    out = {"a": [model.forward(tokens[:41], states["a"])], "b": [model.forward(tokens[:9], states["b"])]}
    for step in range(60):
        for name in ("a", "b") if step % 3 else ("b", "a"):
            state = states[name]
            out[name].append(model.forward(tokens[state.position:state.position + 1], state))
    for logits in out.values():
        got = torch.cat(logits)
        assert max_diff(got, ref[: got.shape[0]]) <= TOL


@pytest.mark.parametrize(("window", "csa", "hca"), [(0, 4, 8), (1, 4, 1), (2, 4, 2)])
def test_fixed_shape_decode_at_the_edges_equals_eager_decode(window, csa, hca, tmp_path, monkeypatch):
    """Sliding windows of 0, 1 and 2 rows and HCA ratios of 1 and 2 (an entry every step,
    entry buckets growing 64 -> 128 -> 256 rows at ratio 1 by 140 tokens): the fixed-shape
    decode equals the eager decode of the same model within float32 summation order (the
    softmax runs over masked rows too: a few ulp of the logits)."""
    import deepseek4_fixture as fx

    monkeypatch.setattr(fx, "_RATIO_OF_TYPE", {"sliding_attention": 0, "compressed_sparse_attention": csa,
                                               "heavily_compressed_attention": hca})
    hf = fx.tiny_model(seed=0, sliding_window=window,
                       compress_rates={"compressed_sparse_attention": csa, "heavily_compressed_attention": hca})
    model = load_model(fx.export_deepseek4_gguf(hf, tmp_path / "edge.gguf"))
    tokens = torch.randint(0, hf.config.vocab_size, (140,), generator=torch.Generator().manual_seed(1))
    eager = run_chunks(model, tokens, [1])
    model.static_decode = True
    fixed = run_chunks(model, tokens, [3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    assert max_diff(fixed, eager) <= 1e-5 * eager.abs().max().item()


def test_grown_buffers_never_meet_a_graph_of_the_old_ones(fixed_shape, monkeypatch):
    """A long conversation's first decode step grows the entry buffers (64 -> 128 rows);
    a short one decoding afterwards must not find a step graph captured on the old
    buffers (on a GPU: a replay on freed memory). Recorded on the CPU: which buffers each
    graph key was first run with, since the last reset."""
    import engine.experts

    monkeypatch.setattr(engine.experts, "GROUPED_DEVICES", ("cuda", "cpu"))  # the whole-step path
    case = fixed_shape
    model, tokens = case.model, case.tokens
    stale = record_graph_buffers(monkeypatch, model._graphs)
    begins = count_calls(monkeypatch, model._graphs, "step_begins")  # where the graph cap is enforced
    short, long = model.new_state(), model.new_state()
    out = [model.forward(tokens[:10], short)] + [model.forward(tokens[i:i + 1], short) for i in (10, 11)]
    model.forward(tokens[:290], long)
    model.forward(tokens[290:291], long)
    out.append(model.forward(tokens[12:13], short))
    assert stale == []
    assert len(begins) == 4  # once per decode step, never for a prompt chunk
    assert max_diff(torch.cat(out), case.reference[:13]) <= TOL


def test_projections_of_one_input_run_as_one_matrix(case):
    """Materialized dense weights that read the same input are one matrix (one GEMV per
    step): each role's weight is a view into it (nothing held twice), and the stacked
    product equals each projection on its own up to the order of the float32 sums (a
    BLAS may block the K = hidden terms differently for another matrix width): each is
    within hidden * 2**-24 * sum |x| |w| of the exact product, so they are within twice
    that of each other."""
    model = case.model
    kinds = set()
    for layer in model.layers:
        assert len(layer.attn_proj.stacks) == 1 and len(layer.shared_proj.stacks) == 1
        kinds.add(layer.kind)
        stacked = layer.attn_proj.stacks[0][0].values
        start, stop = stacked.data_ptr(), stacked.data_ptr() + stacked.numel() * stacked.element_size()
        alone = dict(layer.attn_proj.weights)
        assert all(start <= w.values.data_ptr() < stop for w in alone.values())
        x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(layer.index))
        together = layer.attn_proj(x)
        roles = {"q_a", "kv"}
        if layer.compressor is not None:
            roles |= {"compressor.kv", "compressor.gate"}
            assert alone["compressor.kv"] is layer.compressor.kv and alone["compressor.gate"] is layer.compressor.gate
        if layer.indexer is not None:
            roles |= {"indexer.kv", "indexer.gate", "indexer.proj"}
            assert alone["indexer.proj"] is layer.indexer.proj
        assert set(together) == set(alone) == roles
        for role, weight in alone.items():
            bound = 2 * model.config.hidden_size * 2.0 ** -24 * (x.abs() @ weight.values.abs().t())
            assert ((together[role] - weight.linear(x)).abs() <= bound).all(), role
    assert kinds == {"sliding", "csa", "hca"}


def test_materialized_weights_hold_no_quantized_bytes(case):
    """A weight dequantized once at load lets its GGUF bytes go: an empty view of them
    would keep the whole buffer alive (on a GPU, the quantized copy of every dense matrix
    beside its bf16 one)."""
    matrices = case.model.weights.materialized_matrices()
    assert len(matrices) > 10
    assert all(m.raw.untyped_storage().nbytes() == 0 for m in matrices)


def test_the_oracle_is_sensitive(f32_case):
    """A wrong detail (here: the indexer keeping every entry) shows far above the tolerance."""
    model = f32_case.model
    indexers = [layer.indexer for layer in model.layers if layer.indexer is not None]
    assert indexers, "the tiny model must have CSA layers"
    saved = [ix.top_k for ix in indexers]
    try:
        for ix in indexers:
            ix.top_k = 10_000
        assert max_diff(run_chunks(model, f32_case.tokens, [N_TOKENS]), f32_case.reference) > 100 * TOL
    finally:
        for ix, top_k in zip(indexers, saved):
            ix.top_k = top_k


# -- configuration ---------------------------------------------------------------------------


def test_config_from_gguf_metadata(f32_case):
    source = GGUFSource.open(f32_case.path)
    config = DeepSeek4Config.from_metadata(source.metadata, list(source.tensors))
    hf = f32_case.hf.config
    assert (config.n_layers, config.hidden_size, config.n_heads, config.head_dim, config.rope_dim) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.head_dim, hf.qk_rope_head_dim)
    assert [config.layer_kind(i) for i in range(config.n_layers)] == [
        "sliding", "csa", "sliding", "hca", "csa", "hca"]
    assert config.compress_ratios == (0, 4, 0, 8, 4, 8)  # the trailing MTP entry is dropped
    assert config.n_hash_layers == 3 and config.n_experts_used == 3 and config.norm_topk
    assert config.yarn is not None and config.yarn.factor == 16.0
    assert config.swiglu_limit_shared == config.swiglu_limit == (2.0,) * 6


def test_config_names_every_missing_key(f32_case):
    metadata = dict(GGUFSource.open(f32_case.path).metadata)
    del metadata["deepseek4.hyper_connection.count"]
    del metadata["deepseek4.attention.indexer.top_k"]
    with pytest.raises(DeepSeek4ConfigError) as err:
        DeepSeek4Config.from_metadata(metadata)
    assert "deepseek4.hyper_connection.count" in str(err.value)
    assert "deepseek4.attention.indexer.top_k" in str(err.value)


def test_config_refuses_other_architectures():
    with pytest.raises(DeepSeek4ConfigError, match="not a DeepSeek-V4"):
        DeepSeek4Config.from_metadata({"general.architecture": "llama"})


def test_mtp_layers_are_skipped_only_when_present(f32_case):
    metadata = GGUFSource.open(f32_case.path).metadata  # block_count 6, nextn_predict_layers 1
    assert DeepSeek4Config.from_metadata(metadata, []).n_layers == 6
    assert DeepSeek4Config.from_metadata(metadata, ["blk.5.nextn.eh_proj.weight"]).n_layers == 5


def test_dense_weights_stay_in_their_gguf_type(mxfp4_case):
    weights = mxfp4_case.model.weights
    types = {name: weights.quant(name).ggml_type for name in
             ("token_embd.weight", "blk.3.attn_q_a.weight", "blk.1.indexer.proj.weight", "blk.0.attn_sinks.weight")}
    assert types == {"token_embd.weight": 8, "blk.3.attn_q_a.weight": 8,  # Q8_0
                     "blk.1.indexer.proj.weight": 30, "blk.0.attn_sinks.weight": 0}  # BF16, F32
    assert not any(name.endswith("_exps.weight") for name in weights.names()), "experts come from the provider"


# -- experts only through the provider -----------------------------------------------------------


def greedy(model, prompt: torch.Tensor, n_new: int) -> tuple[list[int], torch.Tensor]:
    state = model.new_state()
    logits = model.forward(prompt, state)
    tokens, all_logits = [], [logits[-1]]
    for _ in range(n_new):
        token = int(all_logits[-1].argmax())
        tokens.append(token)
        all_logits.append(model.forward(torch.tensor([token]), state)[-1])
    return tokens, torch.stack(all_logits)


def test_greedy_generation_same_through_acquire_only_provider(mxfp4_case):
    source = GGUFSource.open(mxfp4_case.path)
    resident = resident_experts(source)
    recording = RecordingExperts(resident, seed=1)
    prompt = mxfp4_case.tokens[:40]
    with_resident = greedy(load_model(mxfp4_case.path, experts=resident), prompt, 24)
    with_acquire = greedy(load_model(mxfp4_case.path, experts=recording), prompt, 24)
    assert with_resident[0] == with_acquire[0]
    assert torch.equal(with_resident[1], with_acquire[1])  # same bytes, same order of sums: bit-identical
    assert len(recording.calls) == 6 * 25  # one acquire per layer per forward call


def test_each_layer_acquires_its_routed_experts_once_per_chunk(f32_case):
    source = GGUFSource.open(f32_case.path)
    recording = RecordingExperts(resident_experts(source))
    model = load_model(f32_case.path, experts=recording)
    chunk = f32_case.tokens[:50]
    model.forward(chunk, model.new_state())
    assert [block for block, _ in recording.calls] == list(range(6))
    for _block, ids in recording.calls:
        assert ids == sorted(set(ids)), "unique expert ids, ascending"
    # Hash layers route by token id alone: exactly the table rows of the chunk's tokens.
    table = f32_case.hf.model.layers[0].mlp.gate.tid2eid
    assert recording.calls[0][1] == sorted(set(table[chunk].flatten().tolist()))


def test_a_chunk_in_pieces_acquires_each_layers_experts_once(f32_case, monkeypatch):
    """The pieces of a long chunk share one acquire per layer: every expert its tokens
    picked, read once for the whole chunk."""
    recording = RecordingExperts(resident_experts(GGUFSource.open(f32_case.path)))
    model = load_model(f32_case.path, experts=recording)
    monkeypatch.setattr(common, "PROMPT_PIECE", 16)
    chunk = f32_case.tokens[:50]
    model.forward(chunk, model.new_state())
    assert [block for block, _ in recording.calls] == list(range(6))
    table = f32_case.hf.model.layers[0].mlp.gate.tid2eid
    assert recording.calls[0][1] == sorted(set(table[chunk].flatten().tolist()))


def test_decode_prefetches_hash_layers_exactly_and_guesses_the_next_layer(f32_case):
    recording = RecordingExperts(resident_experts(GGUFSource.open(f32_case.path)))
    model = load_model(f32_case.path, experts=recording)
    state = model.new_state()
    model.forward(f32_case.tokens[:20], state)  # a prefill chunk: exact prefetches only
    assert {kind for kind, _b, _ids in recording.events} == {"acquire", "exact"}
    n_hash, n_used = model.config.n_hash_layers, model.config.n_experts_used
    table = f32_case.hf.model.layers[0].mlp.gate.tid2eid
    for token in f32_case.tokens[20:24]:
        recording.events.clear()
        model.forward(token.reshape(1), state)
        events = recording.events
        exact = [(b, ids) for kind, b, ids in events if kind == "exact"]
        assert [b for b, _ in exact] == list(range(n_hash)) and exact[0][1] == sorted(table[token].tolist())
        assert events[: n_hash] == [("exact", b, ids) for b, ids in exact]  # before any acquire
        # Block l's guess for block l+1 (non-hash) comes after block l's acquire, before l+1's.
        order = [(kind, b) for kind, b, _ids in events[n_hash:]]
        expected = []
        for b in range(6):
            expected.append(("acquire", b))
            if n_hash <= b + 1 < 6:
                expected.append(("guess", b + 1))
        assert order == expected
        for kind, _b, ids in events:
            if kind == "guess":
                assert len(set(ids)) == n_used and all(0 <= e < model.config.n_experts for e in ids)



def test_fixed_shape_decode_hands_the_provider_the_next_layers_scores_on_this_layers_input(f32_case):
    """A pack's fixed-shape decode step computes the guess's scores (the next layer's
    router on this layer's MoE input) inside the stretch's graph, not eagerly between
    graphs: they are the very scores the eager path computes on that input, and the
    provider's guess is their top-k (model_helpers)."""
    recording = RecordingExperts(resident_experts(GGUFSource.open(f32_case.path)))
    model = load_model(f32_case.path, experts=recording)
    blocks = model_helpers.guessed_blocks_of_fixed_shape_steps(model, recording, f32_case.tokens[:24], prompt=20)
    assert blocks == list(range(model.config.n_hash_layers, 6)) * 4  # each non-hash layer, each step


# -- command line ------------------------------------------------------------------------------


def test_cli_logits_prefill_and_decode(f32_case, tmp_path):
    from app.cli import main

    tokens = f32_case.tokens[:40]
    text = ",".join(str(t) for t in tokens.tolist())
    for mode, extra in (("prefill", ["--chunk", "7"]), ("decode", [])):
        out = tmp_path / f"{mode}.npy"
        assert main(["logits", str(f32_case.path), "--tokens", text, "--out", str(out),
                     "--mode", mode, "--device", "cpu", *extra]) == 0
        logits = np.load(out)
        assert logits.dtype == np.float32 and logits.shape == (40, f32_case.hf.config.vocab_size)
        assert np.abs(logits - f32_case.reference[:40].numpy()).max() <= TOL


def test_cli_logits_reports_bad_input(f32_case, tmp_path, capsys):
    from app.cli import main

    out = tmp_path / "x.npy"
    assert main(["logits", str(f32_case.path), "--tokens", "1,two", "--out", str(out), "--device", "cpu"]) == 2
    assert "'two' is not an integer" in capsys.readouterr().err
    assert main(["logits", str(f32_case.path), "--tokens", "99999", "--out", str(out), "--device", "cpu"]) == 2
    assert "outside this model's vocabulary" in capsys.readouterr().err
    assert not out.exists()


# -- through a real Expert Pack and the streaming runtime -----------------------------------------


@pytest.fixture(scope="module")
def mxfp4_pack(mxfp4_case, tmp_path_factory):
    from packer.builder import build_pack

    return build_pack(mxfp4_case.path, tmp_path_factory.mktemp("ds4_pack"))


@pytest.mark.parametrize("host_slots,speculative,grouped", [(0, "idle", False), (10, "tail", False),
                                                            (0, "idle", True), (10, "tail", True)])
def test_pack_with_tiny_expert_cache_matches_resident(mxfp4_case, mxfp4_pack, host_slots, speculative, grouped,
                                                      monkeypatch):
    """4 cache slots for 6 layers x 8 experts: misses and evictions on every step, and the
    40-token prompt needs more experts per layer than fit (acquire_chunks). Every lever is
    in the loop: streaming, exact hash-layer prefetch, next-layer guesses, and (second
    case) a RAM tier that evicted experts move down to and back up from. `grouped`: the
    GPU's decode path (engine.experts.GROUPED_DEVICES) run here on the CPU, by the
    resident model and the pack alike: the pack's grouped kernel reads the experts from
    their cache slots, the resident one from the stacked tensors, and the bits agree."""
    import engine.experts
    from engine.runtime import ExpertCache, ExpertStore

    if grouped:
        monkeypatch.setattr(engine.experts, "GROUPED_DEVICES", ("cuda", "cpu"))

    store = ExpertStore(mxfp4_pack)
    stride = store.manifest.expert_stride
    cache = ExpertCache(store, device="cpu", cache_bytes=4 * stride, reserve_bytes=0,
                        host_cache_bytes=host_slots * stride, speculative=speculative)
    assert cache.slot_count == 4
    chunked_calls = []
    acquire_chunks = cache.acquire_chunks

    def counting_acquire_chunks(block, expert_ids, *args, **kwargs):
        chunked_calls.append(block)
        return acquire_chunks(block, expert_ids, *args, **kwargs)

    cache.acquire_chunks = counting_acquire_chunks
    grouped_calls = []
    grouped_mlp = engine.runtime.routed.grouped_expert_mlp

    def counting_grouped(*args, **kwargs):
        grouped_calls.append(1)
        return grouped_mlp(*args, **kwargs)

    monkeypatch.setattr(engine.runtime.routed, "grouped_expert_mlp", counting_grouped)
    try:
        prompt = mxfp4_case.tokens[:40]
        expected = greedy(load_model(mxfp4_case.path), prompt, 16)
        streamed = greedy(load_model(mxfp4_pack, experts=cache), prompt, 16)
        stats = cache.telemetry.snapshot()
    finally:
        cache.close()
        store.close()
    assert streamed[0] == expected[0]
    assert torch.equal(streamed[1], expected[1])
    assert stats["cache_misses"] > 16 * 6 and stats["cache_evictions"] > 16 * 6
    assert len(chunked_calls) == 6  # the prompt chunk: every layer needed more experts than slots
    assert len(grouped_calls) == (16 * 6 if grouped else 0)  # each of the 16 decode steps, every layer
    assert stats["prefetch_issued"] > 0  # hash-layer and next-layer prefetches ran
    if host_slots:
        assert stats["host_hits"] > 0 and stats["host_demotions"] > 0


def test_cli_logits_from_pack(mxfp4_case, mxfp4_pack, tmp_path):
    from app.cli import main

    out = tmp_path / "pack.npy"
    text = ",".join(str(t) for t in mxfp4_case.tokens[:30].tolist())
    assert main(["logits", str(mxfp4_pack), "--tokens", text, "--out", str(out), "--device", "cpu",
                 "--cache-mib", "1", "--chunk", "8"]) == 0
    assert np.abs(np.load(out) - mxfp4_case.reference[:30].numpy()).max() <= TOL
