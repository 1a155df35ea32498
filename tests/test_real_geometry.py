"""benchmarks/real_geometry.py (real-geometry GGUFs with random weights) and the expert
store's emulated-drive rate cap.

The generated files are checked where it matters to the benchmarks: the engine loads
them and computes finite logits with input-dependent routing, the packer builds an
Expert Pack from them and the pack computes the same logits, the real tokenizer
machinery works on the synthetic vocabulary, the full-size byte totals match the
published files, and the bytes do not depend on the thread count.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from engine.loader import load_model, open_model_source, resident_experts
from engine.options import RuntimeOptions
from engine.runtime import ExpertStore, RuntimeStartError
from engine.runtime.store import ReadRateLimiter
from engine.text.chat_template import builtin_format_for_vocab
from engine.text.tokenizer import GGUFTokenizer
from pack_factory import make_pack, role_spec

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("real_geometry", ROOT / "benchmarks" / "real_geometry.py")
rg = importlib.util.module_from_spec(_spec)
sys.modules["real_geometry"] = rg
_spec.loader.exec_module(rg)

CPU_BUFFERED = RuntimeOptions(device="cpu", dtype=torch.float32, direct_io=False)
PROMPT = "Summarize the movie \"Toy Story\" in two sentences."


class RoutingRecorder:
    """Delegates to a provider and records every layer's routing (`chosen` per call)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.chosen: dict[int, list[torch.Tensor]] = {}

    def routed(self, block, x, chosen, weights, activation, next_layer=None):
        self.chosen.setdefault(block, []).append(chosen.clone())
        return self._inner.routed(block, x, chosen, weights, activation, next_layer)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _forward(model, ids: list[int]) -> torch.Tensor:
    return model.forward(torch.tensor(ids), model.new_state())


# -- full-size geometry ----------------------------------------------------------------------------


def test_full_size_byte_totals_match_the_published_files():
    """Experts exactly as the specs compute them; whole files within 0.1% of the seed's
    155.10 GB (DeepSeek, llama-quantize's MXFP4_MOE types) and 1009.51 GB (Kimi-K3)."""
    rows, other = rg.layer_bytes("deepseek-v4-flash")
    assert len(rows) == 43
    per_expert = 3 * 4096 * 2048 * 17 // 32  # 13.37 MB
    assert {r.experts for r in rows} == {256 * per_expert}
    spec_total = sum(r.dense + r.experts for r in rows) + other
    assert 155.5e9 < spec_total < 155.8e9  # the spec's BF16 compressor/indexer, F32 hyper-connections
    rows_q, other_q = rg.layer_bytes("deepseek-v4-flash", dense_types="mxfp4-moe")
    assert abs(sum(r.dense + r.experts for r in rows_q) + other_q - 155.10e9) < 0.001 * 155.10e9

    rows, other = rg.layer_bytes("kimi-k3")
    assert len(rows) == 93 and rows[0].experts == 0
    per_expert = 2 * 3072 * 3584 * 84 // 256 + 3584 * 3072 * 110 // 256  # Q2_K gate/up, Q3_K down: 11.96 MB
    assert {r.experts for r in rows[1:]} == {896 * per_expert}
    assert sum(1 for r in rows if r.kind.startswith("mla")) == 24
    assert abs(sum(r.dense + r.experts for r in rows) + other - 1009.51e9) < 0.001 * 1009.51e9
    report = rg.totals_report("kimi-k3", n_layers=8)
    assert "8-layer file" in report and "985.575 GB" in report


def test_release_types_and_small_scale_keeps_names_and_types():
    ds = {p.name: p for p in rg.plan_tensors("deepseek-v4-flash", 5)}
    assert ds["blk.4.ffn_down_exps.weight"].ggml_type == T.MXFP4
    assert ds["blk.4.ffn_down_exps.weight"].shape == (256, 4096, 2048)
    assert ds["blk.0.attn_q_b.weight"].ggml_type == T.Q8_0 and ds["output.weight"].ggml_type == T.Q8_0
    assert ds["blk.2.indexer.attn_q_b.weight"].ggml_type == T.BF16  # layer 2: CSA
    assert "blk.3.indexer.proj.weight" not in ds and ds["blk.3.attn_compressor_ape.weight"].shape == (128, 512)
    assert ds["blk.2.ffn_gate_tid2eid.weight"].ggml_type == T.I32 and "blk.3.ffn_gate_tid2eid.weight" not in ds
    assert ds["blk.3.exp_probs_b.bias"].shape == (256,)
    k3 = {p.name: p for p in rg.plan_tensors("kimi-k3", 4)}
    assert [k3[f"blk.1.ffn_{r}_exps.weight"].ggml_type for r in ("gate", "up", "down")] == [T.Q2_K, T.Q2_K, T.Q3_K]
    assert k3["blk.1.ffn_gate_exps.weight"].shape == (896, 3072, 3584)
    assert k3["output.weight"].ggml_type == T.Q6_K and k3["token_embd.weight"].ggml_type == T.Q2_K
    assert k3["blk.1.attn_v.weight"].ggml_type == T.Q3_K and k3["blk.1.attn_output.weight"].ggml_type == T.Q3_K
    assert k3["blk.0.ffn_down.weight"].ggml_type == T.Q3_K and k3["blk.1.ffn_routed_down.weight"].ggml_type == T.Q2_K
    assert k3["blk.3.attn_k_b.weight"].ggml_type == T.Q8_0  # 128-wide rows: llama.cpp would take IQ4_NL
    assert k3["blk.0.ssm_conv1d_q.weight"].ggml_type == T.F32 and k3["blk.0.ssm_conv1d_q.weight"].shape == (12288, 1, 4)
    assert k3["blk.1.ffn_gate_inp.weight"].ggml_type == T.F32 and "blk.0.ffn_gate_inp.weight" not in k3
    for model, n in (("deepseek-v4-flash", 5), ("kimi-k3", 5)):
        full = [(p.name, p.ggml_type, len(p.shape)) for p in rg.plan_tensors(model, n)]
        small = [(p.name, p.ggml_type, len(p.shape)) for p in rg.plan_tensors(model, n, scale="small")]
        assert full == small


@pytest.mark.parametrize("qtype", [T.MXFP4, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q6_K])
def test_random_blocks_are_valid_and_of_the_requested_scale(qtype):
    rng = np.random.Generator(np.random.SFC64(7))
    target = 4096 ** -0.5
    values = gguf_dequantize(rg.random_blocks(qtype, 2000, target, rng), qtype).astype(np.float64)
    assert np.isfinite(values).all()
    assert 0.8 * target < values.std() < 1.25 * target
    assert abs(values.mean()) < 0.05 * target


def test_bytes_do_not_depend_on_threads_or_chunking(tmp_path, monkeypatch):
    """Chunks of 64 KiB (several per tensor) on 1 and 3 threads give the same file, and
    the file holds exactly the planned tensors."""
    monkeypatch.setattr(rg, "CHUNK_BYTES", 64 << 10)
    a = rg.write_real_geometry_gguf(tmp_path / "a.gguf", "deepseek-v4-flash", 3, scale="small", seed=5, threads=1)
    b = rg.write_real_geometry_gguf(tmp_path / "b.gguf", "deepseek-v4-flash", 3, scale="small", seed=5, threads=3)
    assert a.read_bytes() == b.read_bytes()
    source, _ = open_model_source(a)
    plans = rg.plan_tensors("deepseek-v4-flash", 3, scale="small")
    assert [(n, int(i.ggml_type), tuple(i.shape)) for n, i in source.tensors.items()] == \
        [(p.name, int(p.ggml_type), p.shape) for p in plans]
    table = np.asarray(source.tensor_bytes("blk.0.ffn_gate_tid2eid.weight")).view(np.int32).reshape(-1, 6)
    assert all(len(set(row)) == 6 for row in table[:500].tolist()) and table.max() < 16


# -- small-scale files through the engine and the packer -----------------------------------------------


@pytest.mark.parametrize("model, n_layers, routed_blocks", [
    ("deepseek-v4-flash", 4, [3]),  # layers 0, 1 sliding, 2 CSA, 3 HCA; 0-2 hash-routed
    ("kimi-k3", 5, [1, 2, 3, 4]),  # layer 0 dense; 3 MLA, the others KDA
])
def test_small_file_runs_in_the_engine_and_as_a_pack(tmp_path, model, n_layers, routed_blocks):
    from packer.builder import build_pack

    path = rg.write_real_geometry_gguf(tmp_path / f"{model}.gguf", model, n_layers, scale="small", threads=2)
    source, _ = open_model_source(path)
    tokenizer = GGUFTokenizer.from_metadata(source.metadata)
    assert tokenizer.vocab_size == 4096
    assert builtin_format_for_vocab(tokenizer) == ("deepseek-v4" if model == "deepseek-v4-flash" else "kimi-k3")
    ids = tokenizer.encode(PROMPT)
    assert 10 < len(ids) < len(PROMPT)

    recorder = RoutingRecorder(resident_experts(source))
    reference = _forward(load_model(path, CPU_BUFFERED, experts=recorder), ids)
    assert reference.shape == (len(ids), 4096)
    assert torch.isfinite(reference).all() and reference.std() > 0.1
    g = rg.geometry(model, "small")
    for block in routed_blocks:  # the router's choices depend on the token, not on the bias alone
        chosen = torch.cat(recorder.chosen[block])
        assert len(set(chosen.flatten().tolist())) >= min(g.experts, 2 * g.top_k)
        assert len({tuple(sorted(row)) for row in chosen.tolist()}) > len(ids) // 2

    pack = build_pack(path, tmp_path / "pack")
    model_from_pack = load_model(pack, CPU_BUFFERED)
    try:
        from_pack = _forward(model_from_pack, ids)
    finally:
        model_from_pack.experts.close()
    assert torch.equal(from_pack, reference)


def test_cli_prints_totals_and_writes_a_file(tmp_path, capsys):
    out = tmp_path / "k3.gguf"
    argv = ["--model", "kimi-k3", "--layers", "2", "--scale", "small", "--out", str(out), "--threads", "2"]
    assert rg.main(argv) == 0
    text = capsys.readouterr().out
    assert "2-layer file" in text and "wrote" in text
    assert out.stat().st_size > sum(p.nbytes for p in rg.plan_tensors("kimi-k3", 2, scale="small"))


# -- the emulated drive: ExpertStore(rate_limit_bytes_per_s=...) ------------------------------------


def test_rate_limiter_queues_concurrent_reads_on_one_clock():
    """First come, first served: reads started at the same instant end one after the other
    (concurrency does not multiply the rate) and an idle drive earns no credit for a later
    burst."""
    now = [10.0]
    slept = []
    limiter = ReadRateLimiter(100.0, clock=lambda: now[0], sleep=slept.append)
    assert [limiter.start(50) for _ in range(4)] == [10.5, 11.0, 11.5, 12.0]
    limiter.finish(10.5)
    assert slept == [0.5]
    now[0] = 20.0  # idle for 8 s after the last reservation ended
    assert limiter.start(100) == 21.0 and limiter.start(100) == 22.0
    limiter.finish(19.0)  # already past: no sleep
    assert slept == [0.5]
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(RuntimeStartError):
            ReadRateLimiter(bad)


def _shared_limiter(now: list[float], on_sleep=None) -> ReadRateLimiter:
    """A shared-rate limiter at 100 bytes/s on a fake clock that its waits move forward."""
    def sleep(seconds: float) -> None:
        if on_sleep is not None:
            on_sleep(seconds)
        now[0] += seconds
    return ReadRateLimiter(100.0, shared=True, clock=lambda: now[0], sleep=sleep)


def test_shared_rate_limiter_divides_the_rate_among_reads_in_flight():
    """Processor sharing: two 50-byte reads started together at 100 B/s both end after 1 s
    (not 0.5 and 1.0 s); a read started 0.5 s into a 100-byte read takes half the rate
    from then on, so both end at 1.5 s; an idle drive earns no credit."""
    now = [10.0]
    limiter = _shared_limiter(now)
    first, second = limiter.start(50), limiter.start(50)
    limiter.finish(first)
    assert now[0] == pytest.approx(11.0)
    limiter.finish(second)  # ended with the first: no further wait
    assert now[0] == pytest.approx(11.0)

    big = limiter.start(100)  # alone from 11.0: 50 bytes served by 11.5
    now[0] = 11.5
    small = limiter.start(50)
    limiter.finish(big)  # the last 50 bytes at 50 B/s, beside the small read's 50
    assert now[0] == pytest.approx(12.5)
    limiter.finish(small)
    assert now[0] == pytest.approx(12.5)

    now[0] = 30.0  # idle for 17.5 s
    limiter.finish(limiter.start(100))
    assert now[0] == pytest.approx(31.0)


def test_shared_rate_limiter_slows_a_read_already_waiting():
    """A read that starts while another waits on its estimated end pushes that end later:
    the waiter wakes at its old estimate, finds its bytes not all served, and waits again.
    100 bytes from 10.0 alone would end at 11.0; another 100 from 10.5 makes it 11.5, and
    the later read ends at 12.0 (200 bytes at 100 B/s from 10.0)."""
    now = [10.0]
    later: list[float] = []

    def start_a_read_meanwhile(seconds: float) -> None:
        if not later:
            now[0] += 0.5
            later.append(limiter.start(100))
            now[0] -= 0.5  # the sleep itself moves the clock by `seconds`
    limiter = _shared_limiter(now, start_a_read_meanwhile)
    limiter.finish(limiter.start(100))
    assert now[0] == pytest.approx(11.5)
    limiter.finish(later[0])
    assert now[0] == pytest.approx(12.0)


def _read_everything(store, pack, rounds: int, threads: int) -> int:
    """Read every expert `rounds` times from `threads` threads at once; check the bytes."""
    keys = [(li, layer.block, e) for li, layer in enumerate(pack.manifest.layers)
            for e in range(pack.manifest.num_experts)] * rounds
    lock, total = threading.Lock(), [0]

    def read(key):
        li, block, expert = key
        data = store.read_expert(li, expert)
        assert bytes(data.numpy()) == pack.block_bytes(block, expert)
        with lock:
            total[0] += data.numel()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, keys))
    return total[0]


@pytest.fixture
def big_pack(tmp_path):
    roles = (role_spec("gate", 256, 1024), role_spec("up", 256, 1024), role_spec("down", 1024, 256))
    return make_pack(tmp_path / "rate.expertpack", blocks=(1, 2), num_experts=8, roles=roles)  # ~0.84 MB / expert


@pytest.mark.parametrize("shared", [False, True], ids=["in-order", "shared"])
def test_rate_cap_bounds_the_aggregate_read_rate(big_pack, shared):
    """~40 MB through 8 concurrent readers, 16 I/O threads and 2 sub-reads per expert at a
    200 MB/s cap take at least 40 MB / 200 MB/s, whichever way the rate is divided among
    the reads in flight (only the lower bound is asserted: a busy CPU may make it slower,
    never faster)."""
    rate = 200e6
    with ExpertStore(big_pack.path, direct_io=False, read_splits=2, io_threads=16,
                     rate_limit_bytes_per_s=rate, rate_limit_shared=shared) as store:
        assert store.rate_limit_bytes_per_s == rate and store._rate_limiter.shared is shared
        started = time.perf_counter()
        total = _read_everything(store, big_pack, rounds=3, threads=8)
        elapsed = time.perf_counter() - started
        busy = store.telemetry.get("drive_busy_seconds")
    assert total > 38e6
    assert elapsed >= total / rate - 0.005
    assert busy >= total / rate - 0.005  # the emulated drive was busy for all of it


def test_no_rate_cap_by_default(big_pack):
    with ExpertStore(big_pack.path, direct_io=False, read_splits=2, io_threads=16) as store:
        assert store.rate_limit_bytes_per_s is None and store._rate_limiter is None
        assert _read_everything(store, big_pack, rounds=1, threads=8) > 12e6
