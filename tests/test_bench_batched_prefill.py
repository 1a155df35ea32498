"""benchmarks/bench_batched_prefill.py in its CPU smoke mode: the product's batched prefill
over strided Q2_K / Q3_K tables, every budget and way of reading the rows, one result file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_batched_prefill_smoke_on_cpu(tmp_path):
    out = tmp_path / "batched.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_batched_prefill.py"), "--device", "cpu",
           "--tokens", "24", "--d-in", "256", "--inter", "256", "--experts", "12", "--k", "4",
           "--budgets", "1,auto", "--iters", "1", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {"machine", "command", "date", "rows"} <= set(data)
    rows = data["rows"]
    assert [(r["budget"], r["reads"]) for r in rows] == [("1", "in place"), ("1", "gathered"),
                                                         ("auto", "in place"), ("auto", "gathered")]
    # One expert's three dequantized roles (float32 on the CPU) are 768 KiB: a 1 MiB budget
    # holds one at a time; the CPU's default holds them all.
    assert rows[0]["batches"] == rows[0]["experts_used"] > 1 and rows[2]["batches"] < rows[0]["batches"]
    for row in rows:
        assert row["ms"] > 0 and row["tok_s"] > 0
        # Float32 on the CPU: the same products, summed in another order where the batches
        # differ (sums of 256 terms: within 256 * 2**-24 of the largest output, about 1.5e-5).
        assert row["max_rel_diff_vs_first_row"] <= 256 * 2.0 ** -24
