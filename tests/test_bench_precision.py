"""benchmarks/bench_precision.py end to end on the CPU with the demo: every row it reports,
including the engine's mixed mode (bf16 prefill, float32 decode)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_precision_reports_every_run_on_cpu(tmp_path):
    out = tmp_path / "precision.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_precision.py"), "--device", "cpu", "--tokens", "24",
           "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {"machine", "command", "date", "rows"} <= set(data)
    runs = {(r["input"], r["forward"], r["dtype"]) for r in data["rows"]}
    for name in ("random token ids", "text (json module docs and source)"):
        for forward in ("prefill", "decode"):
            assert (name, forward, "bfloat16 vs float32") in runs
        assert (name, "decode", "bf16 prefill, float32 decode (--decode-dtype float32), vs float32") in runs
    for row in data["rows"]:
        # The decode rows compare the 12 steps after a 12-token prompt, the prefill rows all 24.
        assert row["positions"] == (12 if row["forward"] == "decode" else 24)
        assert math.isfinite(row["rel_l2_max"]) and 0 <= row["top1_agreement"] <= 1
        assert len(row["route_flips_per_layer"]) == 6  # the demo's six MoE layers, every one recorded
