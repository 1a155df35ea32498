"""Kimi-K3 engine: exact against llama.cpp, incremental, experts only through acquire.

The oracle is llama.cpp (`src/models/kimi-k3.cpp`, llama-cpp-python 0.3.36, CPU,
float32 KV cache, no flash attention) on tiny random `kimi-k3` GGUFs; its logits are
committed in tests/fixtures/kimi_k3/reference.npz (regenerate with make_fixtures.py
there; CI never builds llama.cpp).

- tiny-f32.gguf: 8 layers, KDA with MLA at layers 3 and 7 (head_count_kv array),
  AttnRes block size 3 (banks at 0, 3, 6), dense layer 0, latent MoE with shared
  experts, F32.
- tiny-q2k-0000k-of-00003.gguf: a split set whose routed experts are Q2_K (gate/up)
  and Q3_K (down) at latent width 256. llama.cpp's CPU path quantizes activations to
  Q8_K for K-quant matmuls (a loose oracle), so its reference was computed on a
  float32 twin holding the DEQUANTIZED expert values; our quantized path equals our
  path on dequantized float32 experts bit for bit (test below), so comparing it
  with that reference is exact up to float32 rounding.

Tolerance: relative L2 error per position <= 1e-3 and identical argmax over all 80
positions. Float32 rounding alone is ~1e-4 here: the tiny random model amplifies it
(per-head RMSNorm of small KDA outputs, sigmoid/tanh gates); the float64 test shows
that our float32 run and llama.cpp's sit equally close to the exact (float64) values.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import model_helpers
from engine.experts import QuantTensor, ResidentExperts
from engine.loader import load_model, resident_experts
from engine.models import common
from engine.models.kimi_k3 import KimiK3Config, KimiK3ConfigError
from engine.options import RuntimeOptions
from model_helpers import RecordingExperts, count_calls, load_dense_quantized, record_graph_buffers, run_chunks
from packer.gguf_source import GGUFSource

FIXTURES = Path(__file__).parent / "fixtures" / "kimi_k3"
F32_PATH = FIXTURES / "tiny-f32.gguf"
Q_PATH = FIXTURES / "tiny-q2k-00001-of-00003.gguf"
REL_TOL = 1e-3
N_TOKENS = 80

_spec = importlib.util.spec_from_file_location("kimi_k3_make_fixtures", FIXTURES / "make_fixtures.py")
mf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mf)


def rel_l2(ours: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per-position relative L2 error [T]."""
    ours, reference = ours.double(), torch.as_tensor(reference).double()
    return (ours - reference).norm(dim=-1) / reference.norm(dim=-1)


def assert_matches(ours: torch.Tensor, reference, tol: float = REL_TOL) -> None:
    reference = torch.as_tensor(reference)
    assert ours.shape == reference.shape
    errors = rel_l2(ours, reference)
    worst = int(errors.argmax())
    assert errors.max() <= tol, f"position {worst}: relative L2 error {errors.max():.2e} > {tol}"
    assert torch.equal(ours.argmax(-1), reference.argmax(-1)), "argmax differs"


class Case:
    """A committed model, its llama.cpp references and (lazily, once) our runs of it."""

    def __init__(self, kind: str) -> None:
        ref = np.load(FIXTURES / "reference.npz")
        self.kind = kind
        self.path = F32_PATH if kind == "f32" else Q_PATH
        self.spec = mf.F32_SPEC if kind == "f32" else mf.Q_SPEC
        self.tokens = torch.from_numpy(ref[f"tokens_{kind}"]).long()
        self.prefill_ref = torch.from_numpy(ref[f"{kind}_prefill"])
        self.decode_ref = torch.from_numpy(ref[f"{kind}_decode"])
        self.softplus_ref = torch.from_numpy(ref["softplus_prefill"]) if kind == "f32" else None
        self.model = load_model(self.path)
        self._runs: dict[str, torch.Tensor] = {}

    def run(self, mode: str) -> torch.Tensor:
        """Our logits for all tokens: 'prefill' (one chunk) or 'decode' (one token at a time)."""
        if mode not in self._runs:
            self._runs[mode] = run_chunks(self.model, self.tokens, [N_TOKENS] if mode == "prefill" else [1])
        return self._runs[mode]


@pytest.fixture(scope="module")
def f32_case():
    return Case("f32")


@pytest.fixture(scope="module")
def q_case():
    return Case("q")


@pytest.fixture(params=["f32", "q"])
def case(request):
    return request.getfixturevalue(f"{request.param}_case")


# -- exactness against llama.cpp ---------------------------------------------------------------


def test_fixture_covers_the_architecture(f32_case, q_case):
    c = f32_case.model.config
    assert [c.layer_kind(i) for i in range(c.n_layers)] == ["kda"] * 3 + ["mla"] + ["kda"] * 3 + ["mla"]
    assert c.attn_res_block_size == 3 and c.n_layers > 2 * c.attn_res_block_size  # banks at 0, 3, 6
    assert c.n_dense_layers == 1 and c.latent_size == 32 and c.n_shared_experts == 2
    assert c.gate_lower_bound == -5.0 and c.norm_topk
    q = q_case.model.config
    assert [q.layer_kind(i) for i in range(q.n_layers)] == ["kda", "kda", "mla", "kda"]
    assert q.latent_size == 256 and q.n_shared_experts == 0
    assert len(list(FIXTURES.glob("tiny-q2k-0000?-of-00003.gguf"))) == 3  # a split set
    types = {t.ggml_type for name, t in GGUFSource.open(Q_PATH).tensors.items() if name.endswith("_exps.weight")}
    assert types == {10, 11}  # Q2_K, Q3_K
    assert f32_case.tokens.numel() == q_case.tokens.numel() == N_TOKENS


def test_projections_of_one_input_run_as_one_matrix(case):
    """Every layer's matrices that read one input (KDA: q, k, v, f_a, beta, g; MLA: q or
    q_a, kv_a, gate; the MoE: routed_down, shared gate and up; a dense FFN: gate, up) are
    one materialized matrix whose row blocks, in order, are the weights the model holds
    (views: nothing twice); llama.cpp's logits above check what they compute."""
    stacks = []
    for layer in case.model.layers:
        for owner in (layer.kda, layer.mla, layer.moe):
            if owner is not None:
                stacks.append(owner.proj)
        if layer.dense_proj is not None:
            stacks.append(layer.dense_proj)
    assert any(len(p.weights) >= 6 for p in stacks) and any(len(p.weights) == 3 for p in stacks)
    for p in stacks:
        if len(p.weights) < 2:
            continue
        assert len(p.stacks) == 1 and p.stacks[0][1] == tuple(p.weights)
        stacked = p.stacks[0][0].values
        offset = 0
        for weight in p.weights.values():
            w = weight.values
            assert w is not None and w.shape[1] == stacked.shape[1]
            assert w.data_ptr() == stacked[offset].data_ptr()  # exactly its row block, in role order
            offset += w.shape[0]
        assert offset == stacked.shape[0]


def test_one_shot_prefill_matches_llama_cpp(case):
    logits = case.run("prefill")
    assert logits.dtype == torch.float32
    assert_matches(logits, case.prefill_ref)


def test_token_by_token_decode_matches_llama_cpp(case):
    """Every position one token at a time, against llama.cpp's own decode and its prefill."""
    logits = case.run("decode")
    assert_matches(logits, case.decode_ref)
    assert_matches(logits, case.prefill_ref)


@pytest.mark.parametrize("whole", [True, False], ids=["one-graph", "graph-per-stretch"])
@pytest.mark.parametrize("sizes", [[1], [5, 1, 1, 1, 1, 1, 1, 1, 9, 1, 1, 2, 1]], ids=["decode", "chunks-between"])
def test_fixed_shape_decode_matches_llama_cpp(case, sizes, whole, monkeypatch):
    """The GPU's decode paths run here, `static_decode` on: each one-token step runs on
    kimi_k3_static's buffers (conv tails and S written in place, the MLA cache a fixed
    buffer read through a mask, growing 64 -> 128 rows); chunks run eagerly between
    decode runs, the rows moving back and forth.
    - one-graph: resident experts made graph-safe on the CPU (GROUPED_DEVICES), so the
      step is the one function a GPU captures whole;
    - graph-per-stretch: experts served eagerly (as a pack serves them), the step is
      one function per stretch between routing points, the AttnRes snapshots in the
      state's bank rows between them."""
    import engine.experts

    if whole:
        monkeypatch.setattr(engine.experts, "GROUPED_DEVICES", ("cuda", "cpu"))
    model = case.model
    steps = count_calls(monkeypatch, type(model), "_step_static")
    stretches = count_calls(monkeypatch, type(model), "_stretch")
    model.static_decode = True
    try:
        logits = run_chunks(model, case.tokens, sizes)
    finally:
        model.static_decode = None
        model._static = None
    assert_matches(logits, case.prefill_ref)
    chunks, fed = [], 0
    while fed < N_TOKENS:  # run_chunks' cycle of sizes
        chunks.append(sizes[len(chunks) % len(sizes)])
        fed += chunks[-1]
    decode_steps = chunks.count(1)
    assert decode_steps > 0
    moe_layers = sum(layer.moe is not None for layer in model.layers)
    assert len(steps) == (decode_steps if whole else 0)
    assert len(stretches) == (0 if whole else decode_steps * (moe_layers + 1))


def test_dense_weights_kept_quantized_match_llama_cpp(q_case, monkeypatch):
    """A GPU's loader keeps the Q2_K / Q3_K / Q6_K / Q8_0 matrices as the file has them
    (quant_gemv reads them in place): prefill, and the fixed-shape decode steps, match
    llama.cpp as the materialized weights do."""
    import engine.experts

    model = load_dense_quantized(q_case.path, monkeypatch)
    assert_matches(run_chunks(model, q_case.tokens, [N_TOKENS]), q_case.prefill_ref)
    monkeypatch.setattr(engine.experts, "GROUPED_DEVICES", ("cuda", "cpu"))
    model.static_decode = True
    assert_matches(run_chunks(model, q_case.tokens, [5, 1]), q_case.prefill_ref)


def test_grown_cache_never_meets_a_graph_of_the_old_one(f32_case, monkeypatch):
    """A long conversation's first decode step grows the MLA cache (64 -> 128 rows); a
    short one decoding afterwards must not find a step graph captured on the old buffer.
    And the whole-step function captures no graphs of its own pieces (the MoE's)."""
    import engine.experts

    monkeypatch.setattr(engine.experts, "GROUPED_DEVICES", ("cuda", "cpu"))
    model, tokens = f32_case.model, f32_case.tokens
    stale = record_graph_buffers(monkeypatch, model._graphs)
    keys = count_calls(monkeypatch, model._graphs, "run")
    begins = count_calls(monkeypatch, model._graphs, "step_begins")  # where the graph cap is enforced
    model.static_decode = True
    try:
        short, long = model.new_state(), model.new_state()
        out = [model.forward(tokens[:5], short)] + [model.forward(tokens[i:i + 1], short) for i in (5, 6)]
        model.forward(tokens[:70], long)
        model.forward(tokens[70:71], long)
        out.append(model.forward(tokens[7:8], short))
    finally:
        model.static_decode = None
        model._static = None
    assert stale == []
    assert len(begins) == 4  # once per decode step, never for a prompt chunk
    # One-row MoE graphs come only from the eager path: none ran (the chunks are several rows).
    assert {call[0][0] for call in keys} == {"step", "moe"}
    assert all(call[2].shape[0] > 1 for call in keys if call[0][0] == "moe")
    assert_matches(torch.cat(out), f32_case.prefill_ref[:8])


def test_chunked_prefill_matches_llama_cpp(f32_case):
    """Chunk edges inside the conv window (kernel 4), across KDA chunks (32) and MLA cache
    growth; in float64 the chunked run equals the one-shot run to ~1e-12."""
    sizes = [1, 3, 16, 2, 5, 7, 40]
    assert_matches(run_chunks(f32_case.model, f32_case.tokens, sizes), f32_case.prefill_ref)
    model64 = load_model(F32_PATH, RuntimeOptions(device="cpu", dtype=torch.float64))
    one_shot = run_chunks(model64, f32_case.tokens, [N_TOKENS])
    assert rel_l2(run_chunks(model64, f32_case.tokens, sizes), one_shot).max() < 1e-10


def test_prompt_chunks_with_only_their_last_logits_match_llama_cpp(f32_case):
    """A prompt fed as the service feeds it (each chunk's last logits only, the AttnRes
    bank's last rows with them) gives those logits, and leaves the state from which the
    rest of the sequence matches too."""
    logits, where = model_helpers.run_prompt_then_rest(f32_case.model, f32_case.tokens, chunk=24, prompt=60)
    assert where[:4] == [23, 47, 59, 60]
    assert_matches(logits, f32_case.prefill_ref[where])


def test_a_chunk_in_pieces_matches_llama_cpp(case, monkeypatch):
    """A chunk longer than a piece: the mixers piece by piece (each piece with its rows of
    the AttnRes bank, the dense FFN too), the routed experts once (80 tokens in pieces of
    at most 24: four of 20; layer 0 is dense, and the bank gains checkpoints between layers)."""
    monkeypatch.setattr(common, "PROMPT_PIECE", 24)
    assert common.pieces(N_TOKENS) == [slice(i, i + 20) for i in range(0, N_TOKENS, 20)]
    assert_matches(run_chunks(case.model, case.tokens, [N_TOKENS]), case.prefill_ref)
    logits, where = model_helpers.run_prompt_then_rest(case.model, case.tokens, chunk=50, prompt=70)
    assert_matches(logits, case.prefill_ref[where])
    recording = RecordingExperts(resident_experts(GGUFSource.open(case.path)), seed=3)
    run_chunks(load_model(case.path, experts=recording), case.tokens[:50], [50])
    assert [block for block, _ in recording.calls] == list(range(1, case.model.config.n_layers))  # once per MoE layer


def test_a_chunk_calls_the_layer_hook_after_every_layer(f32_case):
    seen: list[tuple[int, int]] = []
    f32_case.model.forward(f32_case.tokens[:10], f32_case.model.new_state(), on_layer=lambda *a: seen.append(a))
    layers = f32_case.model.config.n_layers
    assert seen == [(i, layers) for i in range(1, layers + 1)]


def test_float64_run_shows_both_float32_runs_are_rounding(case):
    """Our float64 run is the near-exact value. Our float32 runs and llama.cpp's (prefill
    and decode) are all rounding-level away from it: measured on tiny-f32, ours 1.7e-4
    (prefill) / 9.6e-5 (decode), llama.cpp's 4.5e-5 / 9.0e-5, so neither side is
    systematically off and the differences between them are float32 rounding, amplified
    by the tiny random model (per-head RMSNorm of small KDA outputs). In float64, decode,
    the recurrent and the chunked (parallel) KDA forms agree to ~1e-12: the incremental
    state and the chunked delta rule are exact."""
    model64 = load_model(case.path, RuntimeOptions(device="cpu", dtype=torch.float64))
    exact = run_chunks(model64, case.tokens, [N_TOKENS])  # chunked KDA (kda_chunk = 32)
    assert exact.dtype == torch.float64
    assert rel_l2(run_chunks(model64, case.tokens[:24], [1]), exact[:24]).max() < 1e-10
    model64.kda_chunk = 0  # token-by-token delta rule inside the one-shot prefill
    assert rel_l2(run_chunks(model64, case.tokens, [N_TOKENS]), exact).max() < 1e-10
    for ours in (case.run("prefill"), case.run("decode")):
        assert rel_l2(ours, exact).max() < REL_TOL / 2
    for theirs in (case.prefill_ref, case.decode_ref):
        assert rel_l2(theirs, exact).max() < REL_TOL / 2
    assert_matches(exact.float(), case.prefill_ref)


def test_softplus_decay_variant_matches_llama_cpp(f32_case):
    """Without kda.gate_lower_bound, llama.cpp decays with -exp(A_log) * softplus(...)."""
    model = load_model(F32_PATH)
    model.config = dataclasses.replace(model.config, gate_lower_bound=None)
    logits = run_chunks(model, f32_case.tokens, [N_TOKENS])
    assert_matches(logits, f32_case.softplus_ref)
    assert rel_l2(logits, f32_case.prefill_ref).max() > 100 * REL_TOL  # the two decays differ


def test_the_oracle_is_sensitive(f32_case):
    """A wrong detail (here: no MLA output gate) shows far above the tolerance."""
    model = load_model(F32_PATH)
    for layer in model.layers:
        if layer.mla is not None:
            layer.mla.gate = None
    assert rel_l2(run_chunks(model, f32_case.tokens, [N_TOKENS]), f32_case.prefill_ref).max() > 30 * REL_TOL


def test_quantized_path_equals_dequantized_float32_path(q_case):
    """Q2_K/Q3_K experts give exactly the logits of float32 experts holding their
    dequantized values (the float32 twin llama.cpp's reference was computed on)."""
    quantized = resident_experts(GGUFSource.open(Q_PATH))
    stacked = {}
    for block, roles in quantized._stacked.items():
        stacked[block] = {}
        for role, t in roles.items():
            values = t.dequantize(torch.float32).contiguous()
            stacked[block][role] = QuantTensor(values.view(-1).view(torch.uint8), 0, t.shape)
    assert all(t.ggml_type in (10, 11) for roles in quantized._stacked.values() for t in roles.values())
    tokens = q_case.tokens[:40]
    with_quant = run_chunks(load_model(Q_PATH, experts=quantized), tokens, [40])
    with_f32 = run_chunks(load_model(Q_PATH, experts=ResidentExperts(stacked)), tokens, [40])
    assert torch.equal(with_quant, with_f32)


# -- experts only through the provider, and through a real pack ----------------------------------


def test_each_moe_layer_acquires_once_per_chunk(f32_case):
    recording = RecordingExperts(resident_experts(GGUFSource.open(F32_PATH)), seed=3)
    model = load_model(F32_PATH, experts=recording)
    logits = run_chunks(model, f32_case.tokens[:50], [50])
    assert [block for block, _ in recording.calls] == list(range(1, 8))  # layer 0 is dense
    for _, ids in recording.calls:
        assert ids == sorted(set(ids)), "unique expert ids, ascending"
    # Delivery order and fresh copies do not matter: bit-identical to the resident provider.
    assert torch.equal(logits, run_chunks(f32_case.model, f32_case.tokens[:50], [50]))



def test_fixed_shape_decode_hands_the_provider_the_next_layers_scores_on_this_layers_input(f32_case):
    """As for DeepSeek-V4: a pack's fixed-shape step computes the guess's scores (the next
    MoE layer's router on this layer's MoE input) inside the stretch's graph; they are the
    scores the eager path computes on that input, and the provider guesses their top-k."""
    recording = RecordingExperts(resident_experts(GGUFSource.open(F32_PATH)), seed=3)
    model = load_model(F32_PATH, experts=recording)
    blocks = model_helpers.guessed_blocks_of_fixed_shape_steps(model, recording, f32_case.tokens[:23], prompt=20)
    assert blocks == list(range(2, 8)) * 3  # MoE layers 1-7 guess the next, each step


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    from packer.builder import build_pack

    return {kind: build_pack(path, tmp_path_factory.mktemp(f"k3_pack_{kind}"))
            for kind, path in (("f32", F32_PATH), ("q", Q_PATH))}


@pytest.mark.parametrize("mode", ["prefill", "decode", "fixed-shape decode", "grouped fixed-shape decode"])
def test_pack_with_tiny_expert_cache_matches_llama_cpp(case, packs, mode, monkeypatch):
    """The experts streamed from a real Expert Pack through an ExpertCache smaller than a
    layer's experts: misses and evictions on every step, and the one-shot prefill needs more
    experts per layer than fit (acquire_chunks). Bit-identical to the resident run.
    "fixed-shape decode" is a GPU's pack step: one function (graph) per stretch between
    routing points on the fixed-shape state, the pack's experts served between them;
    "grouped" runs them as a GPU does, all k from the cache's slots in one grouped call
    once the streaming batch settled (the resident model then runs the whole step)."""
    import engine.experts
    from engine.runtime import ExpertCache, ExpertStore, StreamingBatch

    if mode.startswith("grouped"):
        monkeypatch.setattr(engine.experts, "GROUPED_DEVICES", ("cuda", "cpu"))
    settled = count_calls(monkeypatch, StreamingBatch, "settle")

    store = ExpertStore(packs[case.kind])
    c = case.model.config
    slots = min(c.n_experts_used + 1, c.n_experts - 1)  # f32: 3 of 8 experts; q: 2 of 3 (= top-k)
    stride = store.manifest.expert_stride
    cache = ExpertCache(store, device="cpu", cache_bytes=slots * stride, reserve_bytes=0,
                        host_cache_bytes=2 * stride, speculative="tail")  # next-layer guesses, a RAM tier
    assert cache.slot_count == slots < c.n_experts
    chunked = []
    acquire_chunks = cache.acquire_chunks

    def counting_acquire_chunks(block, expert_ids, *args, **kwargs):
        chunked.append(block)
        return acquire_chunks(block, expert_ids, *args, **kwargs)

    cache.acquire_chunks = counting_acquire_chunks
    try:
        model = load_model(packs[case.kind], experts=cache)
        model.static_decode = mode.endswith("fixed-shape decode")
        logits = run_chunks(model, case.tokens, [N_TOKENS] if mode == "prefill" else [1])
        stats = cache.telemetry.snapshot()
    finally:
        cache.close()
        store.close()
    if mode.endswith("fixed-shape decode"):
        resident = case.model
        resident.static_decode = True
        try:
            assert torch.equal(logits, run_chunks(resident, case.tokens, [1]))
        finally:
            resident.static_decode = None
            resident._static = None
    else:
        assert torch.equal(logits, case.run(mode))
    assert_matches(logits, case.prefill_ref if mode == "prefill" else case.decode_ref)
    n_moe = c.n_layers - c.n_dense_layers
    assert len(settled) == (N_TOKENS * n_moe if mode.startswith("grouped") else 0)
    if mode == "prefill":
        assert len(chunked) == n_moe  # every MoE layer needed more experts than slots
    else:
        assert stats["cache_misses"] > N_TOKENS and stats["cache_evictions"] > N_TOKENS
        assert stats["host_demotions"] > 0
        if slots > c.n_experts_used:  # a slot a guess may take while the acquire holds top-k
            assert stats["prefetch_issued"] > 0


# -- configuration and refused variants ------------------------------------------------------------


def _write_variant(tmp_path, rename=None, replace_tensors=None, drop=(), metadata_update=None, drop_keys=()):
    tensors = mf.make_tensors(mf.F32_SPEC)
    for old, new in (rename or {}).items():
        tensors[new] = tensors.pop(old)
    tensors.update(replace_tensors or {})
    for name in drop:
        del tensors[name]
    metadata = mf.make_metadata(mf.F32_SPEC)
    metadata.update(metadata_update or {})
    for key in drop_keys:
        del metadata[key]
    return mf.write_model(tmp_path, mf.F32_SPEC, tensors, metadata, shards=1)


def test_committed_fixture_is_what_the_generator_writes(tmp_path):
    """The variants below are built by the same generator: it must reproduce the committed file."""
    path = mf.write_model(tmp_path, mf.F32_SPEC)
    assert path.read_bytes() == F32_PATH.read_bytes()


def test_config_from_gguf_metadata(f32_case):
    source = GGUFSource.open(F32_PATH)
    config = KimiK3Config.from_metadata(source.metadata, list(source.tensors))
    s = mf.F32_SPEC
    assert (config.hidden_size, config.n_layers, config.n_heads, config.kda_head_dim) == (
        s["hidden"], s["layers"], s["heads"], s["kda_head_dim"])
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_nope_dim, config.qk_rope_dim, config.v_head_dim) == (
        s["q_lora"], s["kv_lora"], s["nope"], s["rope"], s["v_head"])
    assert config.mla_layers == tuple(i in s["mla"] for i in range(s["layers"]))
    assert (config.situ_beta, config.situ_linear_beta, config.conv_kernel) == (2.0, 3.0, 4)
    assert config.vocab_size == s["vocab"]


def test_config_names_every_missing_key():
    metadata = GGUFSource.open(F32_PATH).metadata
    metadata = {k: v for k, v in metadata.items()
                if k not in ("kimi-k3.kda.head_dim", "kimi-k3.attn_res.block_size")}
    with pytest.raises(KimiK3ConfigError) as err:
        KimiK3Config.from_metadata(metadata)
    assert "kimi-k3.kda.head_dim" in str(err.value) and "kimi-k3.attn_res.block_size" in str(err.value)


def test_config_refuses_other_architectures():
    with pytest.raises(KimiK3ConfigError, match="not a Kimi-K3"):
        KimiK3Config.from_metadata({"general.architecture": "deepseek4"})


def test_head_count_kv_other_than_kda_or_mla_is_refused():
    metadata = dict(GGUFSource.open(F32_PATH).metadata)
    kv = list(metadata["kimi-k3.attention.head_count_kv"])
    kv[5] = 4
    metadata["kimi-k3.attention.head_count_kv"] = kv
    with pytest.raises(KimiK3ConfigError, match=r"head_count_kv\[5\] is 4"):
        KimiK3Config.from_metadata(metadata)


@pytest.mark.parametrize("old,new,message", [
    ("blk.3.attn_res_score.weight", "blk.3.attn_res_proj.weight", "norm and projection are stored apart"),
    ("blk.2.ffn_routed_down.weight", "blk.2.ffn_latent_down.weight", "ffn_latent_"),
    ("blk.1.ssm_a", "blk.1.ssm_a_log", "A_log"),
    ("blk.4.ssm_dt.bias", "blk.4.attn_q.bias", "not part of a Kimi-K3 KDA layer"),
])
def test_other_converters_tensor_names_are_refused(tmp_path, old, new, message):
    path = _write_variant(tmp_path, rename={old: new})
    with pytest.raises(KimiK3ConfigError, match=message) as err:
        load_model(path)
    assert new in str(err.value)


def test_ssm_a_per_channel_shape_is_refused(tmp_path):
    path = _write_variant(tmp_path, replace_tensors={"blk.2.ssm_a": -np.ones(mf.F32_SPEC["kda_head_dim"], np.float32)})
    with pytest.raises(KimiK3ConfigError, match=r"blk\.2\.ssm_a has shape \(16,\) \(one per channel"):
        load_model(path)


def test_ssm_a_positive_sign_is_refused(tmp_path):
    a = mf.make_tensors(mf.F32_SPEC)["blk.0.ssm_a"]
    path = _write_variant(tmp_path, replace_tensors={"blk.0.ssm_a": -a})
    with pytest.raises(KimiK3ConfigError, match=r"blk\.0\.ssm_a is positive"):
        load_model(path)


def test_missing_tensor_is_named(tmp_path):
    path = _write_variant(tmp_path, drop=["blk.7.attn_gate.weight", "blk.6.ssm_norm.weight"])
    with pytest.raises(KimiK3ConfigError, match=r"lacks tensors blk\.6\.ssm_norm\.weight"):
        load_model(path)


def test_supported_layout_variants_compute_the_same_model(tmp_path, f32_case):
    """3-D conv kernels (quantization drops the trailing 1) and a fused attn_kv_b
    ([heads * (nope + v), kv_lora]) instead of attn_k_b / attn_v_b."""
    tensors = mf.make_tensors(mf.F32_SPEC)
    s = mf.F32_SPEC
    replaced, renamed_away = {}, []
    for name, value in tensors.items():
        if ".ssm_conv1d_" in name:
            replaced[name] = value.reshape(value.shape[1], 1, value.shape[3])
    for layer in s["mla"]:
        k_b = tensors[f"blk.{layer}.attn_k_b.weight"]  # [heads, kv_lora, nope]
        v_b = tensors[f"blk.{layer}.attn_v_b.weight"]  # [heads, v, kv_lora]
        fused = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [heads, nope + v, kv_lora]
        replaced[f"blk.{layer}.attn_kv_b.weight"] = np.ascontiguousarray(fused.reshape(-1, s["kv_lora"]))
        renamed_away += [f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"]
    path = _write_variant(tmp_path, replace_tensors=replaced, drop=renamed_away)
    logits = run_chunks(load_model(path), f32_case.tokens, [N_TOKENS])
    assert rel_l2(logits, f32_case.run("prefill")).max() < 1e-5
    assert_matches(logits, f32_case.prefill_ref)


# -- command line ------------------------------------------------------------------------------------


def test_cli_logits_kimi_k3_gguf_and_pack(f32_case, q_case, packs, tmp_path):
    from app.cli import main

    runs = [(F32_PATH, f32_case, "prefill", ["--chunk", "13"]), (F32_PATH, f32_case, "decode", []),
            (packs["q"], q_case, "prefill", ["--cache-mib", "1"])]
    for i, (model, case, mode, extra) in enumerate(runs):
        out = tmp_path / f"{i}.npy"
        text = ",".join(str(t) for t in case.tokens.tolist())
        assert main(["logits", str(model), "--tokens", text, "--out", str(out), "--mode", mode,
                     "--device", "cpu", *extra]) == 0
        logits = torch.from_numpy(np.load(out))
        assert logits.dtype == torch.float32 and logits.shape == (N_TOKENS, 256)
        assert_matches(logits, case.prefill_ref)


def _byte_level_tokenizer_metadata(vocab_size: int) -> dict:
    """A byte-level BPE vocabulary as GGUF metadata: the single bytes, with byte 0's slot
    given to one merged token ("hi") because GGUF cannot store an empty merges list."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    byte_to_char, extra = {}, 0
    for b in range(256):
        if b in printable:
            byte_to_char[b] = chr(b)
        else:
            byte_to_char[b] = chr(256 + extra)
            extra += 1
    assert vocab_size == 256
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "kimi-k2",
        "tokenizer.ggml.tokens": ["hi", *(byte_to_char[b] for b in range(1, 256))],
        "tokenizer.ggml.merges": ["h i"],
        "tokenizer.ggml.token_type": [1] * 256,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 0,
    }


def test_engine_service_reports_a_refused_variant_as_a_bad_model(tmp_path):
    """The chat service turns a refused Kimi-K3 layout into a clear 'bad_pack' error, not a 'bug'."""
    import threading

    from engine.service import EngineService
    from engine.service_events import ErrorEvent, PhaseEvent

    a = mf.make_tensors(mf.F32_SPEC)["blk.0.ssm_a"]
    path = _write_variant(tmp_path, replace_tensors={"blk.0.ssm_a": -a},
                          metadata_update=_byte_level_tokenizer_metadata(256))
    events, done = [], threading.Event()

    def on_event(event):
        events.append(event)
        if isinstance(event, PhaseEvent) and event.phase == "idle":
            done.set()

    service = EngineService(on_event, RuntimeOptions(device="cpu"))
    try:
        service.load(str(path))
        assert done.wait(60)
    finally:
        service.shutdown()
    errors = [e for e in events if isinstance(e, ErrorEvent)]
    assert len(errors) == 1, events
    assert errors[0].kind == "bad_pack" and "blk.0.ssm_a is positive" in errors[0].message, errors[0]
