"""benchmarks/bench_pack.py runs end to end at a tiny size (the CPU smoke test of the benchmark)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_pack_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_pack", ROOT / "benchmarks" / "bench_pack.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.model_shape(8) == (2, 256)  # 8 GB: two real DeepSeek-V4-Flash expert layers
    assert bench.model_shape(0.2) == (1, 14)
    result = bench.main(["--dir", str(tmp_path / "disk"), "--gb", "0.06", "--raw-gb", "0.03",
                         "--results-dir", str(tmp_path / "results")])
    out = capsys.readouterr().out
    assert "pack GB/s" in out and "raw read GB/s" in out
    saved = json.loads(Path(result["results_path"]).read_text())
    assert saved["model"] == {"layers": 1, "experts": 4, "expert_bytes": 13369344, "stride": 13369344}
    assert saved["pack_gb_per_s"] > 0 and saved["raw_read_gb_per_s"] > 0 and saved["raw_write_gb_per_s"] > 0
    assert {"host", "cpu_count"} <= saved["machine"].keys() and "bench_pack.py" in saved["command"]
    assert not list((tmp_path / "disk").iterdir()), "source and pack are removed unless --keep"
