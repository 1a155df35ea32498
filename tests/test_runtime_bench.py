"""The runtime benchmark runs end to end in its CPU smoke mode and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_runtime_small_cpu_writes_json(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_runtime.py"), "--device", "cpu", "--small",
           "--seconds", "0.5", "--no-drop-caches", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    files = list(out.glob("runtime-*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert {"machine", "pack", "settings", "miss_delivery", "h2d", "policy", "date", "command"} <= set(data)
    assert data["machine"]["torch"] and data["machine"]["hostname"] and "fstype" in data["machine"]["disk"]
    delivery = data["miss_delivery"]
    for phase in ("raw_direct", "raw_direct_continuous", "cache_direct", "raw_buffered", "cache_buffered"):
        assert delivery[phase]["gbps"] > 0, phase
    assert delivery["cache_direct"]["io_errors"] == 0 and delivery["cache_direct"]["fallback_count"] == 0
    assert delivery["cache_direct"]["verified_experts"] > 0
    assert delivery["cache_buffered"]["buffered_reads"] > 0
    assert delivery["page_cache_drop_method"] == "posix_fadvise(DONTNEED)"
    assert data["h2d"]["gbps"] > 0 and data["h2d"]["ssd_reads_during"] == 0
    rows = data["policy"]["rows"]
    assert [r["capacity_fraction"] for r in rows] == [0.05, 0.15, 0.40]
    assert all(0 < r["ours_over_optimal"] <= 1 for r in rows)
    assert not (tmp_path / "work" / "bench-small.expertpack").exists()  # synthetic pack removed
    assert "policy vs Belady" in result.stdout and "wrote" in result.stdout
