"""The built-in demo model: deterministic, a real deepseek4 GGUF + Expert Pack, honestly labelled."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

import engine.demo as demo
from engine.demo import (
    DEMO_MODEL_NAME,
    GGUF_NAME,
    DemoModelError,
    demo_dir,
    ensure_demo_pack,
    is_demo_ref,
    weights_path,
)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPERTDESK_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_demo_is_built_deterministically(tmp_path, monkeypatch):
    packs = []
    for name in ("a", "b"):
        monkeypatch.setenv("EXPERTDESK_HOME", str(tmp_path / name))
        packs.append(ensure_demo_pack())
    manifests = [json.loads((p / "manifest.json").read_text()) for p in packs]
    for key in ("hashes_sha256", "dense_sha256", "config_sha256", "experts_file_size"):
        assert manifests[0][key] == manifests[1][key]
    assert manifests[0]["source"] == manifests[1]["source"]
    for name in ("experts.bin", "expert_hashes.bin", "dense.gguf"):
        assert _sha256(packs[0] / name) == _sha256(packs[1] / name)
    assert _sha256(packs[0].parent / GGUF_NAME) == _sha256(packs[1].parent / GGUF_NAME)
    assert ensure_demo_pack() == packs[1]  # second use: the existing pack, not a rebuild


def test_the_demo_is_small_and_lives_in_expertdesk_home(home):
    pack = ensure_demo_pack()
    assert pack.is_relative_to(home)
    weights = weights_path().stat().st_size
    assert weights <= 25_000_000  # small enough to ship in the repository and the wheel
    total = sum(f.stat().st_size for f in pack.iterdir())
    assert total < 2 * weights


def test_the_demo_is_a_real_deepseek4_gguf_with_tokenizer_and_chat_format(home):
    from engine.text import GGUFTokenizer, builtin_format_for_vocab
    from packer.gguf_source import GGUFSource

    pack = ensure_demo_pack()
    source = GGUFSource.open(pack.parent / GGUF_NAME)
    meta = source.metadata
    assert meta["general.architecture"] == "deepseek4"
    assert meta["general.name"] == DEMO_MODEL_NAME
    assert "blk.1.ffn_gate_exps.weight" in source.tensors and "blk.0.ffn_gate_tid2eid.weight" in source.tensors
    manifest = json.loads((pack / "manifest.json").read_text())
    assert manifest["architecture"] == "deepseek4"
    assert manifest["layers"][0]["roles"][0]["tensor"].startswith("blk.0.ffn_")
    tok = GGUFTokenizer.from_metadata(meta)
    assert tok.pre == "deepseek-v3"
    assert builtin_format_for_vocab(tok) == "deepseek-v4"
    text = "What does json.dumps do? Ünïcödé 🙂 123456"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("The json module")) < len("The json module")  # real merges, not bytes


def test_demo_word_and_labels(demo_loaded):
    assert is_demo_ref("demo") and is_demo_ref(" Demo ") and not is_demo_ref("demo.gguf")
    event, snapshot = demo_loaded
    assert event.is_demo and event.model_name == DEMO_MODEL_NAME == "ExpertDesk demo (tiny, not a real model)"
    assert event.architecture == "deepseek4"
    assert snapshot["model"]["is_demo"] is True


@pytest.fixture
def demo_loaded(home):
    from engine.options import RuntimeOptions
    from engine.service import EngineService
    from engine.service_events import ModelLoadedEvent

    events = []
    service = EngineService(events.append, RuntimeOptions(device="cpu"))
    try:
        service.load("demo")
        assert service.wait_idle(60)
        loaded = [e for e in events if isinstance(e, ModelLoadedEvent)]
        assert loaded, events
        yield loaded[0], service.snapshot()
    finally:
        service.shutdown()


def test_the_trained_demo_says_recognisable_things(home):
    """The shipped weights were trained on Python docstrings: greedy replies are English-like."""
    from engine.options import RuntimeOptions
    from engine.service import EngineService
    from engine.service_events import DoneEvent, GenerateRequest
    from engine.text import SamplingParams

    events = []
    service = EngineService(events.append, RuntimeOptions(device="cpu"))
    try:
        service.load("demo")
        request = GenerateRequest([{"role": "user", "content": "Hello!"}], SamplingParams(temperature=0, max_tokens=40))
        service.submit(request)
        assert service.wait_idle(60)
    finally:
        service.shutdown()
    done = [e for e in events if isinstance(e, DoneEvent)][0]
    assert "demo" in done.text.lower(), done.text


def _recognised_words() -> set[str]:
    """Words of Python's own documentation (the `help()` topics and the docstrings of some
    core modules): a dictionary of the English and Python words a reply should be made of."""
    import importlib
    import inspect
    import re
    from pydoc_data.topics import topics

    texts = list(topics.values())
    for name in ("builtins", "json", "collections", "os", "re", "itertools", "functools", "typing", "pathlib",
                 "string", "textwrap", "inspect", "dataclasses", "enum", "io", "math"):
        module = importlib.import_module(name)
        texts += [inspect.getdoc(module) or ""] + [inspect.getdoc(getattr(module, a)) or "" for a in dir(module)]
    return {w.lower() for text in texts for w in re.findall(r"[A-Za-z]+", text)}


def _shipped(name: str) -> dict:
    return json.loads((weights_path().parent / name).read_text(encoding="utf-8"))


def test_the_demo_answers_in_english_and_python(home):
    """Greedy answers to the three prompts of samples.json are made of real words (the demo
    before issue 19 answered "lzleoverifyIntole: a Python source fileofSTEP 3.")."""
    import re

    from engine.options import RuntimeOptions
    from engine.service import EngineService
    from engine.service_events import DoneEvent, GenerateRequest
    from engine.text import SamplingParams

    prompts = [s["prompt"] for s in _shipped("samples.json")["samples"]]
    assert prompts == ["Write a Python function that reverses a list.", "What does json.dumps do?",
                       "Explain what a Python dictionary is."]
    known = _recognised_words()
    events: list = []
    service = EngineService(events.append, RuntimeOptions(device="cpu"))
    answers = []
    try:
        service.load("demo")
        for prompt in prompts:
            events.clear()
            service.submit(GenerateRequest([{"role": "user", "content": prompt}],
                                           SamplingParams(temperature=0, max_tokens=60)))
            assert service.wait_idle(120)
            answers.append([e for e in events if isinstance(e, DoneEvent)][0].text)
    finally:
        service.shutdown()
    for prompt, answer in zip(prompts, answers):
        words = [w.lower() for w in re.findall(r"[A-Za-z]{3,}", answer)]
        assert len(words) >= 5, (prompt, answer)
        assert sum(w in known for w in words) >= 0.65 * len(words), (prompt, answer)
    assert "def " in answers[0], answers[0]  # Python code for the Python question
    assert "json" in answers[1].lower(), answers[1]


def test_the_loss_curve_and_samples_belong_to_the_shipped_weights():
    """train_demo.py writes loss.json, loss.svg and samples.json in the run that writes the
    weights: they name the weights' digest, the training loss went down, and the held-out
    loss was measured along the way. (A few MB of text overfit this model after about 5
    passes: the shipped run's held-out loss fell from 5.08 to 3.66 at step 500, then rose
    to 3.85 by step 923; the shipped weights are step 500's.)"""
    import xml.etree.ElementTree as ET

    from engine.demo import load_demo_weights

    digest = hashlib.sha256(weights_path().read_bytes()).hexdigest()
    loss, samples = _shipped("loss.json"), _shipped("samples.json")
    assert loss["weights_sha256"] == samples["weights_sha256"] == digest
    metadata = {key: value for key, _kind, value in load_demo_weights()[0]}
    assert metadata["general.description"] == loss["description"]
    held = [e["held_out_loss"] for e in loss["log"] if e["held_out_loss"] is not None]
    assert len(held) >= 2 and min(held) < held[0] - 1.0
    # The shipped weights are those of the lowest held-out loss (train_demo.py --keep-best).
    at_export = [e["held_out_loss"] for e in loss["log"] if e["step"] == loss["exported_step"]]
    assert at_export == [min(held)]
    train = [e["train_loss"] for e in loss["log"]]
    assert train[-1] < train[0] - 3.0
    svg = ET.parse(weights_path().parent / "loss.svg").getroot()
    assert svg.tag.endswith("svg") and len(svg.findall("{http://www.w3.org/2000/svg}path")) >= 3


def test_missing_weights_say_what_to_do(home, monkeypatch, tmp_path):
    monkeypatch.setattr(demo, "weights_path", lambda: tmp_path / "nowhere.npz")
    with pytest.raises(DemoModelError, match="missing from this installation"):
        demo_dir()


def test_home_defaults_to_the_user_cache_dir(monkeypatch):
    monkeypatch.delenv("EXPERTDESK_HOME", raising=False)
    import platformdirs

    assert demo.expertdesk_home() == demo.Path(platformdirs.user_cache_dir("ExpertDesk", appauthor=False))
    monkeypatch.setenv("EXPERTDESK_HOME", os.fspath(demo.Path("/tmp/x")))
    assert demo.expertdesk_home() == demo.Path("/tmp/x")
