"""benchmarks/bench_sampling.py times the product's Sampler at the real vocabularies and
writes its table as JSON (a smoke run: one call per row)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_sampling_writes_a_row_per_vocabulary_logits_and_setting(tmp_path):
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_sampling import PARAMS, VOCABS, main

    out = tmp_path / "sampling.json"
    result = main(["--calls", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result))
    assert {"machine", "command", "date", "code", "rows"} <= set(data)
    assert len(data["rows"]) == len(VOCABS) * 2 * len(PARAMS)
    assert all(row["ms_per_token"] > 0 for row in data["rows"])
