"""benchmarks/bench_moe_quant.py in its CPU smoke mode: a decode step's K-quant experts (the
torch path on a CPU without Triton), timed, checked against the reference, one result file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_moe_quant_smoke_on_cpu(tmp_path):
    out = tmp_path / "moe-quant.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_moe_quant.py"), "--device", "cpu", "--experts", "4",
           "--k", "2", "--d-in", "256", "--inter", "256", "--iters", "2", "--per-graph", "1", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {"machine", "command", "date", "rows", "settings"} <= set(data)
    # 2 experts x (gate + up: 256 rows of 256 Q2_K values, 84 bytes a unit; down: 256 rows of
    # 256 Q3_K values, 110 bytes a unit)
    assert data["expert_bytes_per_call"] == 2 * (2 * 256 * 84 + 256 * 110)
    (row,) = data["rows"]
    assert row["us_per_call"] > 0 and row["gate_up_config"] is None and row["down_config"] is None
    assert data["rel_l2_vs_reference"] <= 1e-6  # the path it timed is the reference itself here


def test_expert_kernels_take_their_own_configs_else_the_gemvs(monkeypatch):
    from gguf.constants import GGMLQuantizationType as Q

    from engine.kernels import moe_quant, quant_gemv

    monkeypatch.setitem(moe_quant.KERNEL_CONFIGS["down"], int(Q.Q3_K), (8, 2, 1, 2))
    assert moe_quant._config("down", int(Q.Q3_K), 3072) == (8, 2, 1, 2)
    assert moe_quant._config("gate_up", int(Q.Q3_K), 3072) == quant_gemv.config(Q.Q3_K, 3072)
    assert moe_quant._config("down", int(Q.Q2_K), 3072) == quant_gemv.config(Q.Q2_K, 3072)
