"""The routing trace format (docs/traces.md): v2 round trips, v1 files, bad files, the
recorder on a real model, `expertdesk generate --trace`, the committed demo fixture
and the synthetic generator's calibration."""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.experts import NextLayer
from engine.runtime.trace import (
    CALIBRATED,
    VERSION,
    AccessTrace,
    RoutingRecorder,
    synthetic_trace,
    trace_statistics,
)

FIXTURE = Path(__file__).resolve().parents[1] / "benchmarks" / "traces" / "demo-seed10.npz"


def routing_trace() -> AccessTrace:
    trace = AccessTrace({"source": "test", "n_experts": 8})
    trace.record(0, [3, 1], step=0, token=0, weights=[0.75, 0.25], guess_layer=1, guess=[5, 2, 7],
                 guess_scores=[2.0, 1.5, 0.5])
    trace.record(0, [3, 4], step=0, token=1, weights=[0.5, 0.5])  # prefill: 2 tokens, one acquire
    trace.record(1, [5, 6], step=0, token=0, weights=[0.6, 0.4])
    trace.record(0, [2, 2, 7], step=1, token=2, weights=[0.3, 0.9, 0.7], guess_layer=1, guess=[6, 0],
                 guess_scores=[1.0, 0.25])
    trace.record(1, [6], step=1)  # an acquire row (the cache's own record)
    return trace


@pytest.mark.parametrize("suffix", [".npz", ".json"])
def test_v2_round_trip_keeps_weights_guesses_and_meta(tmp_path, suffix):
    trace = routing_trace()
    trace.save(tmp_path / f"t{suffix}")
    loaded = AccessTrace.load(tmp_path / f"t{suffix}")
    assert loaded.meta == {"source": "test", "n_experts": 8}
    assert list(loaded.acquires()) == [(0, 0, (3, 1, 4)), (0, 1, (5, 6)), (1, 0, (2, 7)), (1, 1, (6,))]
    rows, original = list(loaded.routing()), list(trace.routing())
    assert [r[:4] for r in rows] == [r[:4] for r in original]
    assert [r[4] for r in rows] == [pytest.approx(r[4]) for r in original]  # float32 on disk
    assert rows[3] == (1, 2, 0, (2, 7), pytest.approx((0.3, 0.7)))  # duplicates dropped, first weight kept
    records = loaded.acquire_records()
    assert records[0].guess == ()  # a two-token step: the runtime guesses in decode only
    assert records[2].guess_layer == 1 and records[2].guess == (6, 0)
    assert loaded.accesses == 8 and len(loaded) == 4 and loaded.rows == 5


def test_npz_fields_are_the_documented_ones(tmp_path):
    routing_trace().save(tmp_path / "t.npz")
    with np.load(tmp_path / "t.npz") as npz:
        assert sorted(npz.files) == sorted(["header", "step", "token", "layer", "offsets", "experts", "weights",
                                            "guess_layer", "guess_offsets", "guess", "guess_scores"])
        header = json.loads(str(npz["header"]))
        assert header == {"format": "expertdesk-trace", "version": VERSION, "meta": {"source": "test", "n_experts": 8}}
        assert npz["experts"].dtype == np.int32 and npz["weights"].dtype == np.float32
        assert npz["offsets"].tolist() == [0, 2, 4, 6, 8, 9]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "traces.md").read_text(encoding="utf-8")
    for name in header | {k: 1 for k in ("step", "token", "offsets", "guess_offsets", "guess_scores")}:
        assert f"`{name}`" in doc, name


def test_version_1_files_still_load(tmp_path):
    v1 = {"step": [0, 0, 1], "layer": [3, 4, 3], "offsets": [0, 2, 3, 5], "experts": [5, 1, 0, 2, 7]}
    with open(tmp_path / "v1.npz", "wb") as f:
        np.savez_compressed(f, **{k: np.asarray(v) for k, v in v1.items()})
    (tmp_path / "v1.json").write_text(json.dumps({"format": "expertdesk-trace", "version": 1, **v1}))
    for name in ("v1.npz", "v1.json"):
        trace = AccessTrace.load(tmp_path / name)
        assert list(trace.acquires()) == [(0, 3, (5, 1)), (0, 4, (0,)), (1, 3, (2, 7))]
        assert all(math.isnan(w) for *_, weights in trace.routing() for w in weights)  # none: no routing rows


def test_bad_files_name_the_problem(tmp_path):
    (tmp_path / "new.json").write_text(json.dumps({"format": "expertdesk-trace", "version": VERSION + 1}))
    with pytest.raises(ValueError, match=f"version {VERSION + 1} is newer"):
        AccessTrace.load(tmp_path / "new.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "something-else", "version": 1}))
    with pytest.raises(ValueError, match="is not 'expertdesk-trace'"):
        AccessTrace.load(tmp_path / "other.json")
    bad = {"format": "expertdesk-trace", "version": 1, "step": [0], "layer": [1], "offsets": [0, 5],
           "experts": [1]}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="not a consistent expert trace"):
        AccessTrace.load(tmp_path / "bad.json")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a readable expert trace.*--trace"):
        AccessTrace.load(tmp_path / "junk.npz")
    assert not zipfile.is_zipfile(tmp_path / "junk.npz")
    with pytest.raises(ValueError, match="2 experts but 1 weights"):
        AccessTrace().record(0, [1, 2], weights=[1.0])


class Provider:
    """A provider double: records what reached it."""

    def __init__(self) -> None:
        self.calls, self.closed = [], False

    def routed(self, block, x, chosen, weights, activation, next_layer=None):
        self.calls.append(block)
        return x

    def graph_safe(self, x, k):
        return True

    def close(self):
        self.closed = True


def test_the_recorder_rows_steps_and_guesses(tmp_path):
    provider = Provider()
    RoutingRecorder(save_on_close=tmp_path / "r.npz", guess_top=3).install(provider)
    assert provider.graph_safe(None, 2) is False  # no CUDA graph may skip recording
    scores = torch.tensor([[0.1, 0.9, 0.3, 0.8, 0.2]])
    nxt = NextLayer(4, 2, lambda: scores)
    x = torch.zeros(1, 4)
    provider.routed(3, torch.zeros(2, 4), torch.tensor([[0, 1], [2, 1]]), torch.tensor([[0.5, 0.5], [0.7, 0.3]]),
                    None, nxt)  # prefill of 2 tokens: no guess recorded
    provider.routed(4, torch.zeros(2, 4), torch.tensor([[3, 4], [4, 0]]), torch.ones(2, 2), None)
    provider.routed(3, x, torch.tensor([[1, 2]]), torch.tensor([[0.6, 0.4]]), None, nxt)  # decode: a new step
    provider.routed(4, x, torch.tensor([[1, 3]]), torch.tensor([[0.9, 0.1]]), None)
    assert provider.calls == [3, 4, 3, 4]
    provider.close()
    assert provider.closed
    trace = AccessTrace.load(tmp_path / "r.npz")
    assert trace.meta == {"top_k": 2, "n_experts": 5}
    assert [(s, t, layer, e) for s, t, layer, e, _w in trace.routing()] == [
        (0, 0, 3, (0, 1)), (0, 1, 3, (2, 1)), (0, 0, 4, (3, 4)), (0, 1, 4, (4, 0)), (1, 2, 3, (1, 2)),
        (1, 2, 4, (1, 3))]
    records = trace.acquire_records()
    assert [r.experts for r in records] == [(0, 1, 2), (3, 4, 0), (1, 2), (1, 3)]
    assert records[2].guess_layer == 4 and records[2].guess == (1, 3)  # top-k of the guess scores


def test_generate_with_trace_records_the_demo(demo_home, tmp_path):
    from app.cli import main

    out = tmp_path / "demo.npz"
    code = main(["generate", "demo", "--device", "cpu", "--prompt", "What does json.dumps do?", "--temperature",
                 "0", "--max-tokens", "6", "--trace", str(out)])
    assert code == 0
    trace = AccessTrace.load(out)
    meta = trace.meta
    assert meta["source"] == "recorded" and meta["architecture"] == "deepseek4"
    rows = list(trace.routing())
    layers = {layer for _s, _t, layer, _e, _w in rows}
    assert len(layers) == meta["moe_layers"]  # every MoE layer of the demo recorded
    decode = trace.decode_only()
    assert 1 <= len(decode.acquire_records()) // len(layers) <= 6  # one acquire per layer per generated token
    assert all(len(e) == meta["top_k"] and all(0 <= x < meta["n_experts"] for x in e) for *_, e, _w in rows)
    assert all(w > 0 for *_, w in rows for w in w)


def test_a_trace_path_that_cannot_be_written_is_refused_first(tmp_path, capsys):
    from app.cli import main

    (tmp_path / "file").write_text("x")
    code = main(["generate", "demo", "--prompt", "hi", "--trace", str(tmp_path / "file" / "t.npz")])
    err = capsys.readouterr().err
    assert code == 2 and "--trace" in err and "is a file, not a folder" in err


def test_the_committed_demo_trace():
    trace = AccessTrace.load(FIXTURE)
    assert trace.meta["architecture"] == "deepseek4" and trace.meta["n_experts"] == 16
    decode = trace.decode_only()
    assert len(decode.acquire_records()) == trace.meta["moe_layers"] * 400  # 10 prompts x 40 decode tokens
    stats = trace_statistics(decode)
    assert 0.46 <= stats["predictability"] <= 0.72  # within the published range
    assert 0.1 < stats["reuse"] < 0.6


def test_calibrated_generator_measures_as_published():
    stats = trace_statistics(synthetic_trace(layers=6, tokens=1000, seed=3, **CALIBRATED))
    assert stats["zipf"] == pytest.approx(0.65, abs=0.06)
    assert stats["reuse"] == pytest.approx(0.36, abs=0.04)
    assert stats["predictability"] == pytest.approx(0.60, abs=0.03)
