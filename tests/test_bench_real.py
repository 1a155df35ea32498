"""benchmarks/bench_real.py runs the product's loader and models end to end in its CPU
smoke mode (a small real-geometry GGUF, resident, then a pack built by the product's
packer read through the real ExpertStore under an emulated drive-rate cap)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_real_smoke_on_cpu_measures_resident_and_pack(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_real.py"), "--device", "cpu", "--scale", "small",
           "--layers", "4", "--context", "24", "--pack-context", "8", "--steps", "3", "--drives", "0.2",
           "--cache-mib", "1", "--host-cache-mib", "1", "--dense", "gguf,bf16", "--work", str(tmp_path / "work"),
           "--dtype", "float32,bfloat16/float32", "--out", str(out)]
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
        assert row["drive"].startswith("emulated 0.2 GB/s")
        assert 0 <= row["hit_rate"] < 1 and row["ssd_gb_per_token"] > 0  # a 1 MiB cache streams
        # The cap holds: the tokens cannot take less time than their bytes at 0.2 GB/s.
        assert row["ms_per_token_mean"] >= 0.95 * row["drive_ms_per_token"]
