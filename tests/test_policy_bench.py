"""benchmarks/bench_policy.py: the policy comparison runs the product's policies and
writes a complete record (machine, command, date, rows that respect Belady)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_policy.py"
_spec = importlib.util.spec_from_file_location("bench_policy", BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_the_small_comparison_writes_its_record(tmp_path, capsys):
    out = bench.main(["--small", "--markdown", "--policies", "forecast,hybrid,lru", "--out", str(tmp_path)])
    record = json.loads(out.read_text(encoding="utf-8"))
    assert record["command"][0] == "bench_policy.py" and record["date"] and record["machine"]["cpu_count"]
    names = {row["trace"] for row in record["rows"]}
    assert names == {"demo", "ds4-calibrated"}
    assert {row["budget"] for row in record["rows"]} == set(bench.BUDGETS)
    for row in record["rows"]:
        assert set(row["policies"]) == {"forecast", "hybrid", "lru"}
        for result in row["policies"].values():
            assert result["hit_rate"] <= row["belady"] + 1e-12  # nothing beats the optimum
            if row["belady"]:
                assert result["over_belady"] == pytest.approx(result["hit_rate"] / row["belady"])
        if row["trace"] == "ds4-calibrated":
            assert 0 < row["oracle"]["hit_rate"] <= row["belady"]
    assert set(record["cost_us_per_acquire"]) == {"forecast", "hybrid", "lru"}
    assert record["trace_statistics"]["demo"]["predictability"] > 0.4
    printed = capsys.readouterr().out
    assert "| trace | budget | slots | Belady hit rate | forecast | hybrid | lru | oracle |" in printed
    assert f"wrote {out}" in printed


def test_unknown_policy_names_fail_fast(tmp_path):
    with pytest.raises(ValueError, match="unknown cache policy 'mru'"):
        bench.main(["--small", "--policies", "mru", "--out", str(tmp_path)])
