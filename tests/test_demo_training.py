"""`resources/demo/train_demo.py` end to end on a toy model (CPU): the weights it writes
load in the product's engine, and the loss curve and samples come with them."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "resources" / "demo" / "train_demo.py"


@pytest.fixture(scope="module")
def train_demo():
    pytest.importorskip("transformers.models.deepseek_v4", reason="needs transformers with DeepSeek-V4 (>= 5.17)")
    spec = importlib.util.spec_from_file_location("train_demo", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_smoke_run_writes_weights_the_engine_loads(train_demo, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    assert train_demo.main(["--smoke", "--device", "cpu", "--steps", "6", "--batch", "4", "--log-every", "3",
                            "--eval-every", "3", "--sample-tokens", "6", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    weights = out / "expertdesk-demo.npz"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()

    loss = json.loads((out / "loss.json").read_text())
    assert loss["weights_sha256"] == digest and loss["steps"] == 6
    assert [e["step"] for e in loss["log"]] == [3, 6]
    assert all(math.isfinite(e["train_loss"]) and math.isfinite(e["held_out_loss"]) for e in loss["log"])
    svg = ET.parse(out / "loss.svg").getroot()
    assert len(svg.findall("{http://www.w3.org/2000/svg}path")) == 3  # axes, train, held-out

    samples = json.loads((out / "samples.json").read_text())
    assert samples["weights_sha256"] == digest
    assert [s["prompt"] for s in samples["samples"]] == ["Write a Python function that reverses a list.",
                                                         "What does json.dumps do?",
                                                         "Explain what a Python dictionary is."]
    assert all(1 <= s["completion_tokens"] <= 6 for s in samples["samples"])
    assert all(f">>> {s['prompt']}\n{s['answer']}\n" in printed for s in samples["samples"])
    # Each prompt is also answered with the chat window's default sampling, one seeded draw.
    assert all(1 <= s["sampled"]["completion_tokens"] <= 6 and s["sampled"]["sampling"]["temperature"] > 0
               and f"\n{s['sampled']['answer']}\n[sampled" in printed for s in samples["samples"])

    # The product loads the written weights as its demo (the GGUF and pack are built from them).
    import engine.demo as demo
    from engine.options import RuntimeOptions
    from engine.service import EngineService
    from engine.service_events import ModelLoadedEvent

    monkeypatch.setattr(demo, "weights_path", lambda: weights)
    monkeypatch.setenv("EXPERTDESK_HOME", str(tmp_path / "home"))
    events: list = []
    service = EngineService(events.append, RuntimeOptions(device="cpu"))
    try:
        service.load("demo")
        assert service.wait_idle(60)
    finally:
        service.shutdown()
    loaded = [e for e in events if isinstance(e, ModelLoadedEvent)]
    assert loaded and loaded[0].is_demo and loaded[0].architecture == "deepseek4", events


def test_a_smoke_run_never_overwrites_the_shipped_demo(train_demo, capsys):
    with pytest.raises(SystemExit) as exc:
        train_demo.main(["--smoke", "--device", "cpu"])
    assert exc.value.code == 2
    assert "--smoke would overwrite the shipped demo" in capsys.readouterr().err
