"""The decode benchmark runs end to end in its CPU smoke mode: every configuration decodes
the same tokens bit for bit, the bound is computed, and the JSON holds what RESULTS.md needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_decode_small_cpu_writes_json(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--device", "cpu", "--small",
           "--warm", "2", "--tokens", "2", "--rounds", "2", "--no-drop-caches", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    files = list(out.glob("decode-*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert {"machine", "raw", "trace", "resident", "configs", "compute_split", "layers", "date", "command"} <= set(data)
    assert data["raw"]["ssd_gbps"] > 0 and data["raw"]["pinned_gbps"] > 0
    assert abs(data["trace"]["simulated_seed_hit_rate"] - 0.5) < 0.1
    names = [c["name"] for c in data["configs"]]
    for profile in ("seed", "a", "b", "c", "d", "e", "all", "all-ram"):
        assert f"trace-0.14-{profile}" in names
    assert {"router-0.14-seed", "router-0.14-all", "router-0.14-all-ram", "trace-0.05-seed",
            "trace-0.30-all-ram"} <= set(names)
    assert data["raw"]["queue"][1] in {s for d, s in [(r["depth"], r["splits"]) for r in data["raw"]["ssd_runs"]]}
    for c in data["configs"]:
        assert c["identical_to_resident"] is True, c["name"]  # every lever is lossless
        assert c["counters"]["io_errors"] == 0 and c["counters"]["fallback_count"] == 0
        assert c["tok_s"] > 0 and 0 <= c["hit_rate"] <= 1 and c["t_bound_ms"] > 0
        assert c["verified_experts"] > 0
        assert c["t_bound_ms"] >= c["bound_terms_ms"]["compute"]
        assert 0 < c["drive_busy_fraction"] <= 1.0001
    seed = next(c for c in data["configs"] if c["name"] == "trace-0.14-seed")
    # The seed profile is the cache's own planning code: it hits what the calibration simulated.
    assert seed["counters"]["prefetch_issued"] == 0 and seed["counters"]["host_hits"] == 0
    exact = next(c for c in data["configs"] if c["name"] == "trace-0.14-d")
    assert exact["counters"]["prefetch_issued"] > 0
    assert "spec_accuracy" in data["resident"]["router"]
    ram = next(c for c in data["configs"] if c["name"] == "trace-0.14-c")
    assert ram["counters"]["host_demotions"] > 0 and ram["counters"]["d2h_bytes"] > 0  # evictions move down
    prefill = {r["profile"]: r for r in data["prefill"]}
    assert set(prefill) == {"seed", "all"} and data["prefill_resident"]["prompt_tokens"] == 24
    for r in prefill.values():
        assert r["identical_to_resident"] is True and r["counters"]["io_errors"] == 0
        assert r["t_bound_s"] >= r["bound_terms_s"]["compute"] > 0 and r["ssd_gb"] > 0
    assert not (tmp_path / "work" / "decode-small.expertpack").exists()  # synthetic pack removed
    assert "all-resident" in result.stdout and "wrote" in result.stdout
