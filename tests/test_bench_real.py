"""benchmarks/bench_real.py runs the product's loader and models end to end in its CPU
smoke mode (a small real-geometry GGUF, resident, then a pack built by the product's
packer read through the real ExpertStore under an emulated drive-rate cap)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_real_smoke_on_cpu_measures_resident_and_pack(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_real.py"), "--device", "cpu", "--scale", "small",
           "--layers", "4", "--context", "24", "--pack-context", "8", "--steps", "3", "--drives", "0.2",
           "--cache-mib", "1", "--host-cache-mib", "1", "--dense", "gguf,bf16", "--work", str(tmp_path / "work"),
           "--dtype", "float32,bfloat16/float32", "--out", str(out), "--timeline"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    files = list(out.glob("real-deepseek-v4-flash-*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert {"machine", "command", "date", "rows", "gguf_bytes"} <= set(data)
    modes = [r["mode"] for r in data["rows"]]
    assert modes == ["resident"] * 4 + ["pack-seed", "pack"]
    assert [(r["dtype"], r["dense"]) for r in data["rows"][:4]] == [
        ("float32", "gguf"), ("float32", "bf16"), ("bfloat16/float32", "gguf"), ("bfloat16/float32", "bf16")]
    kept, copies = data["rows"][:2]
    for resident in data["rows"][:4]:
        assert resident["ms_per_token_median"] > 0 and resident["dense_bytes"] > 0 and resident["expert_bytes"] > 0
    # The file's Q8_0 / BF16 matrices take fewer bytes than their copies in the compute dtype
    # (Q8_0: 34 bytes per 32 values against 64 in bf16 and 128 in float32).
    assert kept["dense_bytes"] < 0.75 * copies["dense_bytes"]
    for row in data["rows"][4:]:
        assert row["drive"] == "emulated 0.2 GB/s (tmpfs + rate cap, in order)"
        assert 0 <= row["hit_rate"] < 1 and row["ssd_gb_per_token"] > 0  # a 1 MiB cache streams
        # The cap holds: the tokens cannot take less time than their bytes at 0.2 GB/s.
        assert row["ms_per_token_mean"] >= 0.95 * row["drive_ms_per_token"]
        # The bound: the drive's time for the bytes read, or the compute (the first resident row)
        assert row["bound_ms"] == max(row["drive_ms_per_token"], data["rows"][0]["ms_per_token_median"])
        assert row["of_bound"] == row["bound_ms"] / row["ms_per_token_median"] and "bound_note" not in row
        # --timeline: the steps after the first, each MoE layer's reads and where its time went
        timeline = row["timeline"]
        assert timeline["steps"] == 2 and timeline["ms"]["step_ms"]["n"] == 2
        ms = {name: v["median"] for name, v in timeline["ms"].items()}
        assert ms["reads_pending_ms"] > 0 and ms["mid.reads_span"] > 0
        # a layer's reads land before its experts' provider call returns
        assert ms["mid.landed_to_routed_end_host"] >= 0 and ms["mid.routed_host"] >= ms["mid.reads_span"]
        # the prefetch pump's passes and the reads submitted between a layer's last landing and its return
        assert 0 <= ms["mid.pump_busy_landed_to_routed_end"] <= ms["mid.landed_to_routed_end_host"]
        assert ms["mid.submits_landed_to_routed_end"] >= 0
        # the hash layers' experts are prefetched at each step's start, except in the seed profile (no prefetches)
        assert (ms["prefetch_exact_host_per_step"] > 0) == (row["mode"] == "pack")


def test_pack_rows_without_a_resident_row_are_read_against_the_drive_time(tmp_path):
    # --shared-drive: the emulated drive shares its rate among the reads in flight; the cap holds the same
    out = tmp_path / "results"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_real.py"), "--device", "cpu", "--scale", "small",
           "--layers", "4", "--pack-context", "8", "--steps", "2", "--drives", "0.2", "--skip-resident",
           "--cache-mib", "1", "--host-cache-mib", "1", "--work", str(tmp_path / "work"), "--out", str(out),
           "--shared-drive"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (path,) = out.glob("real-deepseek-v4-flash-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["pack-seed", "pack"]
    # --read-splits auto: the fewest sub-reads that reach 0.2 GB/s at the measured one-thread rate
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_real import emulation_splits

    one_thread = json.loads(path.read_text())["one_thread_read_gbps"]
    assert one_thread > 0
    for row in rows:
        assert row["read_splits"] == emulation_splits(0.2, one_thread)
        assert row["drive"] == "emulated 0.2 GB/s (tmpfs + rate cap, shared)"
        assert row["bound_ms"] == row["drive_ms_per_token"] > 0 and "no resident decode" in row["bound_note"]
        assert 0 < row["of_bound"] <= 1 / 0.95  # the cap holds within 5%, as in the test above
        # the prompt starts from an empty cache: it reads at least each layer's first token's experts, and
        # never faster than the drive
        assert row["prefill_tokens"] == 8 and row["prefill_ssd_gb"] > 0
        assert row["prefill_drive_ms"] == pytest.approx(row["prefill_ssd_gb"] / 0.2 * 1e3)
        assert 0 < row["prefill_of_drive"] <= 1 / 0.95


def test_emulation_splits_are_the_fewest_that_reach_the_drive_rate():
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_real import emulation_splits

    # one reader thread at 6.1 GB/s (an H100 machine's tmpfs): 12.5 GB/s needs 3 (2 give 12.2),
    # 7 GB/s needs 2; a slow copy never splits past 8; a drive slower than one thread, 1
    assert [emulation_splits(12.5, 6.1), emulation_splits(7, 6.1), emulation_splits(12.5, 1.0),
            emulation_splits(0.2, 6.1)] == [3, 2, 8, 1]


def test_kernel_configs_of_a_sweep_are_taken_and_recorded(tmp_path, monkeypatch):
    # run_h200.sh TUNED=1: bench_real takes the configs its call's sweeps found best
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_quant_gemv import x16_best
    from benchmarks.bench_real import apply_kernel_configs
    from engine.kernels import moe_quant, quant_gemv

    monkeypatch.setattr(quant_gemv, "X16_CONFIGS", dict(quant_gemv.X16_CONFIGS))
    monkeypatch.setattr(quant_gemv, "X16_MANY_ROWS_CONFIGS", dict(quant_gemv.X16_MANY_ROWS_CONFIGS))
    monkeypatch.setattr(moe_quant, "KERNEL_CONFIGS", {"gate_up": {}, "down": {}})
    sweeps = [{"matrix": "a", "ggml_type": "Q2_K", "config": [2, 2, 1, 2], "us": 10.0, "x16": True},
              {"matrix": "a", "ggml_type": "Q2_K", "config": [4, 2, 2, 2], "us": 8.0, "x16": True},
              {"matrix": "b", "ggml_type": "Q2_K", "config": [2, 2, 1, 2], "us": 50.0, "x16": True},
              {"matrix": "b", "ggml_type": "Q2_K", "config": [4, 2, 2, 2], "us": 60.0, "x16": True},
              {"matrix": "c", "ggml_type": "Q6_K", "config": [2, 2, 1, 1], "us": 1.0, "x16": False}]
    best = x16_best(sweeps, {"a": 7168, "b": quant_gemv.X16_MANY_ROWS, "c": 10})
    assert best == {"configs": {"Q2_K": [4, 2, 2, 2]}, "many_rows_configs": {"Q2_K": [2, 2, 1, 2]}}
    gemv_file, moe_file = tmp_path / "quant-gemv.json", tmp_path / "moe-quant.json"
    gemv_file.write_text(json.dumps({"x16_best": best}))
    moe_file.write_text(json.dumps({"settings": {"gate_type": "Q2_K", "down_type": "Q3_K"},
                                    "best_by_kernel": {"gate_up": [8, 8, 2, 4], "down": [2, 2, 1, 2]}}))
    applied = apply_kernel_configs([gemv_file, moe_file, tmp_path / "missing.json"])
    assert quant_gemv.x16_config(10, 7168) == (4, 2, 2, 2)
    assert quant_gemv.x16_config(10, quant_gemv.X16_MANY_ROWS) == (2, 2, 1, 2)
    assert moe_quant.KERNEL_CONFIGS == {"gate_up": {10: (8, 8, 2, 4)}, "down": {11: (2, 2, 1, 2)}}
    assert applied["moe_quant"] == {"gate_up Q2_K": [8, 8, 2, 4], "down Q3_K": [2, 2, 1, 2]}


def test_a_profile_tally_counts_kernels_syncs_and_host_ops():
    """`_tally` (both profiles): CUDA events are kernels (count, busy time, time by name);
    the host's are ops by self time and calls, and the sync ops are counted as syncs."""
    from types import SimpleNamespace

    import torch

    from benchmarks.bench_real import _tally

    def event(name, cuda, us):
        kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        return SimpleNamespace(name=name, device_type=kind, time_range=SimpleNamespace(elapsed_us=lambda: us),
                               self_cpu_time_total=us)

    events = [event("_gate_up_kernel", True, 30.0), event("_gate_up_kernel", True, 10.0), event("gemm", True, 5.0),
              event("aten::mm", False, 7.0), event("aten::mm", False, 3.0), event("cudaStreamSynchronize", False, 2.0),
              event("aten::_local_scalar_dense", False, 1.0)]
    tally = _tally(SimpleNamespace(events=lambda: events))
    assert (tally.kernels, tally.busy_us, tally.syncs) == (3, 45.0, 2)
    assert tally.top_kernels(1) == [("_gate_up_kernel", 40.0)]
    assert tally.top_host(2) == [("aten::mm", [10.0, 2]), ("cudaStreamSynchronize", [2.0, 1])]
