"""Prompt chunks in bf16, decode steps in float32 (`RuntimeOptions.decode_dtype`).

On a GPU a prompt chunk needs bf16's tensor cores, while a decode step reads weights,
not activations, so float32 costs it little and brings it close to a float32 run
(benchmarks/bench_precision.py measures how close). The model keeps its state in the
decode dtype: a bf16 chunk writes its rows widened (exactly: every bf16 value is a
float32 value) and reads the state rounded to bf16.

The reference is built apart from that mode, from two plain models: the prompt
through a bf16 model, its state widened to float32 by `widened` below, the decode
steps through a float32 model. Both sides then run the same operations on the same
values, so the logits must be EQUAL, not close: any cast in the wrong place (a bf16
decode step, a state kept in bf16, a chunk that reads float32 rows unrounded) changes
bits. A prompt chunk after decode steps is checked the same way against a bf16 model
whose state holds the mixed state's rows rounded to bf16 (`cast_like`); the rows of the
steps before it must stay in the state unrounded, and the steps after it must equal the
float32 model's steps on that state.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from engine.demo import write_demo_gguf
from engine.loader import load_model
from engine.memory_plan import plan_for_loaded
from engine.models.common import GrowingRows
from engine.options import RuntimeOptions
from model_helpers import count_calls

KIMI = Path(__file__).parent / "fixtures" / "kimi_k3"
BF16, F32 = torch.bfloat16, torch.float32
MIXED = RuntimeOptions(device="cpu", dtype="bfloat16", decode_dtype="float32")


def widened(state):
    """A copy of a model state with every floating tensor in float32."""
    return _mapped(state, lambda t: t.float())


def cast_like(state, template):
    """A copy of `state` whose floating tensors take the dtypes of `template`'s (a state of
    the same model and position, from another dtype)."""
    flat = []
    _mapped(template, lambda t: flat.append(t.dtype) or t)
    dtypes = iter(flat)
    return _mapped(state, lambda t: t.to(next(dtypes)))


def _mapped(state, fn):
    if isinstance(state, torch.Tensor):
        return fn(state) if state.is_floating_point() else state
    if isinstance(state, GrowingRows):
        rows = fn(state.rows)
        copy = GrowingRows(rows.shape[1], rows.dtype, rows.device)
        copy.append(rows)
        return copy
    if isinstance(state, list):
        return [_mapped(item, fn) for item in state]
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return dataclasses.replace(state, **{f.name: _mapped(getattr(state, f.name), fn)
                                             for f in dataclasses.fields(state)})
    return state


def floating_dtypes(state) -> set[torch.dtype]:
    found: set[torch.dtype] = set()
    _mapped(state, lambda t: found.add(t.dtype) or t)
    return found


class Models:
    """One GGUF loaded three ways: bf16, float32, and bf16 chunks with float32 decode."""

    def __init__(self, path: Path) -> None:
        self.low = load_model(path, RuntimeOptions(device="cpu", dtype="bfloat16"))
        self.high = load_model(path, RuntimeOptions(device="cpu", dtype="float32"))
        self.mixed = load_model(path, MIXED)
        # A prompt past the demo's 128-row sliding window and past CSA / HCA windows
        # (ratios 4 and 8): rows are trimmed, windows pooled, CSA overlaps carried.
        self.tokens = torch.randint(0, self.mixed.config.vocab_size, (170,), generator=torch.Generator().manual_seed(7))

    def fixed_shape(self, on: bool) -> None:
        for model in (self.low, self.high, self.mixed):
            model.static_decode = True if on else None
            model._static = None


@pytest.fixture(scope="module", params=["deepseek4-demo", "kimi-k3-f32", "kimi-k3-q2k"])
def models(request, tmp_path_factory):
    if request.param == "deepseek4-demo":
        return Models(write_demo_gguf(tmp_path_factory.mktemp("demo") / "demo.gguf"))
    name = "tiny-f32.gguf" if request.param == "kimi-k3-f32" else "tiny-q2k-00001-of-00003.gguf"
    return Models(KIMI / name)


@pytest.fixture(params=["eager", "fixed-shape"])
def decode_path(request, models, monkeypatch):
    """Decode steps eagerly, or on the fixed-shape state a GPU captures (run here on the
    CPU, Kimi-K3's with its resident experts made graph-safe, as on a GPU)."""
    import engine.experts

    if request.param == "fixed-shape":
        monkeypatch.setattr(engine.experts, "GROUPED_DEVICES", ("cuda", "cpu"))
        models.fixed_shape(True)
    yield request.param
    models.fixed_shape(False)


def test_bf16_chunks_then_float32_steps_equal_the_two_models_they_stand_for(models, decode_path, monkeypatch):
    """A conversation: a 2-token and a 148-token chunk, 13 steps, the user's next 2 tokens
    (a chunk starting inside the compressors' open windows, as a real next turn does), then
    5 more steps; every forward against the plain models it stands for."""
    low, high, mixed, tokens = models.low, models.high, models.mixed, models.tokens
    if decode_path == "fixed-shape":
        fixed = count_calls(monkeypatch, type(mixed), "_decode_static")
    state = low.new_state()
    ref = [low.forward(tokens[:2], state), low.forward(tokens[2:150], state)]
    state = widened(state)
    ref += [high.forward(tokens[i:i + 1], state) for i in range(150, 163)]

    ours = mixed.new_state()
    out = [mixed.forward(tokens[:2], ours), mixed.forward(tokens[2:150], ours)]
    assert floating_dtypes(ours) == {F32}  # the chunks' rows were written widened
    out += [mixed.forward(tokens[i:i + 1], ours) for i in range(150, 163)]
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])  # the chunks ran exactly as in bf16
    assert torch.equal(torch.cat(out[2:]), torch.cat(ref[2:]))  # each step exactly as in float32
    if decode_path == "fixed-shape":
        assert sum(call[0] is mixed for call in fixed) == 13

    # The next chunk reads the state rounded to bf16: as a bf16 model holding those rows.
    before = _eager_copy(mixed, ours)
    expected = _bf16_model_on(models, before, tokens[163:165])
    assert torch.equal(mixed.forward(tokens[163:165], ours), expected)
    # ... and keeps the rows of the steps that survive it as they were (float32, not rounded).
    assert floating_dtypes(ours) == {F32}
    _assert_step_rows_kept(before, ours, 2)
    # Steps after it: float32 steps on that state.
    copy = _eager_copy(mixed, ours)
    after = [mixed.forward(tokens[i:i + 1], ours) for i in range(165, 170)]
    assert torch.equal(torch.cat(after), torch.cat([high.forward(tokens[i:i + 1], copy) for i in range(165, 170)]))


def _eager_copy(model, state):
    """A copy of `state` with its rows in its own tensors (given back from the model's
    fixed-shape buffers first, as the model's next chunk would)."""
    if state.in_static:
        model._static.give_back(state)
    return copy.deepcopy(state)


def _bf16_model_on(models: Models, state, chunk: torch.Tensor) -> torch.Tensor:
    """The bf16 model's logits for `chunk` on `state`'s rows rounded to bf16."""
    template = models.low.new_state()
    models.low.forward(models.tokens[: state.position], template)  # the same structure, bf16 dtypes
    rounded = cast_like(state, template)
    rounded.position = state.position
    return models.low.forward(chunk, rounded)


def _assert_step_rows_kept(before, after, n: int) -> None:
    """Rows written before an n-token chunk that the state still holds are unchanged: the
    window's and conv tails' older rows (shifted by n), an open compressor window's rows
    (or, once it closed, the CSA overlap's), the compressed entries and MLA rows."""
    for b, a in zip(before.layers, after.layers):
        if hasattr(b, "window"):  # DeepSeek-V4
            survivors = a.window.shape[0] - n
            assert survivors > 0 and torch.equal(a.window[:survivors], b.window[b.window.shape[0] - survivors:])
            for bc, ac in ((b.compressor, a.compressor), (b.indexer, a.indexer)):
                if bc is None:
                    continue
                held = bc.pending_kv.shape[0]
                assert torch.equal(ac.entries.rows[:bc.entries.n], bc.entries.rows)
                if ac.pending_kv.shape[0] == held + n:  # the window is still open
                    assert torch.equal(ac.pending_kv[:held], bc.pending_kv)
                    assert torch.equal(ac.pending_gate[:held], bc.pending_gate)
                elif ac.overlap_kv is not None:  # it closed: CSA keeps its first half
                    assert torch.equal(ac.overlap_kv[:held], bc.pending_kv[:, :ac.overlap_kv.shape[1]])
        elif hasattr(b, "conv"):  # Kimi-K3 KDA
            for bt, at in zip(b.conv, a.conv):
                assert torch.equal(at[: at.shape[0] - n], bt[n:])
        else:  # Kimi-K3 MLA
            assert torch.equal(a.cache.rows[: b.cache.n], b.cache.rows)


def test_the_mixed_mode_differs_from_both_plain_dtypes(models):
    """The equalities above are not vacuous: bf16 decode steps, and float32 chunks, give
    other logits on these models."""
    low, high, mixed, tokens = models.low, models.high, models.mixed, models.tokens
    runs = {}
    for name, model in (("low", low), ("high", high), ("mixed", mixed)):
        state = model.new_state()
        chunk = model.forward(tokens[:40], state)
        runs[name] = (chunk, torch.cat([model.forward(tokens[i:i + 1], state) for i in range(40, 44)]))
    assert torch.equal(runs["mixed"][0], runs["low"][0]) and not torch.equal(runs["mixed"][0], runs["high"][0])
    assert not torch.equal(runs["mixed"][1], runs["low"][1]) and not torch.equal(runs["mixed"][1], runs["high"][1])


def test_the_state_and_its_memory_plan_are_in_the_decode_dtype():
    model = load_model(KIMI / "tiny-f32.gguf", MIXED)
    assert (model.dtype, model.decode_dtype) == (BF16, F32)
    assert floating_dtypes(model.new_state()) == {F32}
    plan = plan_for_loaded(model, 1 << 20, 2, 64, torch.device("cpu"), context_tokens=4096)
    same = load_model(KIMI / "tiny-f32.gguf", RuntimeOptions(device="cpu", dtype="bfloat16"))
    assert floating_dtypes(same.new_state()) == {BF16, F32}  # the recurrent state is float32 anyway
    narrow = plan_for_loaded(same, 1 << 20, 2, 64, torch.device("cpu"), context_tokens=4096)
    # Kimi-K3's MLA rows grow with the context: twice the bytes in float32.
    assert plan.kv.per_token == 2 * narrow.kv.per_token > 0


def test_the_plan_before_loading_counts_the_state_in_the_decode_dtype():
    """`expertdesk check` and the setup wizard plan a model not loaded yet (plan_for_source):
    with "Compute replies in float32" its KV rows are float32, twice the bf16 ones."""
    from gguf import GGUFReader

    from engine.memory_plan import plan_for_source

    reader = GGUFReader(KIMI / "tiny-f32.gguf")
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    names = [t.name for t in reader.tensors]

    def plan(options):
        return plan_for_source(metadata, names, dense_bytes=1 << 20, expert_bytes=1 << 16, top_k=2, expert_count=64,
                               gpu_free=16 << 30, gpu_total=24 << 30, ram_available=8 << 30, ram_total=16 << 30,
                               context_tokens=4096, options=options)

    default, mixed = plan(None), plan(RuntimeOptions(decode_dtype="float32"))
    assert default.kv.per_token > 0 and mixed.kv.per_token == 2 * default.kv.per_token
    assert plan(RuntimeOptions(dtype="bfloat16")).kv.per_token == default.kv.per_token  # a GPU's default: bf16
    assert mixed.device_parts["kv state"] > default.device_parts["kv state"]
    assert mixed.device_parts["expert cache"] <= default.device_parts["expert cache"]


def test_check_plans_in_the_dtypes_it_is_given(demo_home, tmp_path, capsys):
    """`expertdesk check --source M --decode-dtype float32` plans the float32 state."""
    import json

    from app.cli import main
    from engine.demo import GGUF_NAME, ensure_demo_pack

    gguf = ensure_demo_pack().parent / GGUF_NAME
    kv = {}
    for flags in ((), ("--dtype", "bfloat16"), ("--dtype", "bfloat16", "--decode-dtype", "float32")):
        main(["check", str(tmp_path / "packs"), "--source", str(gguf), "--json", *flags])
        kv[flags] = json.loads(capsys.readouterr().out)["memory_plan"]["device_parts"]["kv state"]
    assert kv[()] == kv[("--dtype", "bfloat16", "--decode-dtype", "float32")] == 2 * kv[("--dtype", "bfloat16")] > 0


def test_dense_copies_are_made_in_the_wider_dtype(models):
    """Where dense weights are dequantized once (the CPU), the copies are float32: a float32
    decode step reads the file's values, not bf16 roundings of them."""
    matrices = models.mixed.weights.materialized_matrices()
    assert matrices and {m.values.dtype for m in matrices} == {F32}


def test_options_resolve_the_decode_dtype():
    assert RuntimeOptions(device="cpu").resolved_decode_dtype() == F32
    assert RuntimeOptions(device="cpu", dtype="bf16").resolved_decode_dtype() == BF16  # as dtype
    assert RuntimeOptions(device="cpu", dtype="bf16", decode_dtype="float32").resolved_decode_dtype() == F32
    with pytest.raises(ValueError, match="unknown dtype 'half-ish': use float32 or bfloat16"):
        RuntimeOptions(device="cpu", decode_dtype="half-ish").resolved_decode_dtype()


def test_the_command_line_flag_reaches_the_options_and_back():
    import argparse

    from app.cli_options import add_runtime_arguments, runtime_flags, runtime_options

    parser = argparse.ArgumentParser()
    add_runtime_arguments(parser)
    options = runtime_options(parser.parse_args(["--dtype", "bfloat16", "--decode-dtype", "float32"]))
    assert (options.dtype, options.decode_dtype) == ("bfloat16", "float32")
    assert runtime_flags(options) == ["--dtype", "bfloat16", "--decode-dtype", "float32"]
    assert runtime_options(parser.parse_args([])).decode_dtype is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--decode-dtype", "int8"])
