"""benchmarks/bench_context.py at a tiny context on the CPU: it runs the product's loader
and models, and the attention state it measures is what the memory plan's formula says
(the reference here is the demo GGUF's own metadata, read with the `gguf` library, and
the published dimensions of DeepSeek-V4-Flash and Kimi-K3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_context.py"


def run(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--work", str(tmp / "work"), "--out", str(tmp / "out"),
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)


def demo_bytes_per_token(gguf: Path) -> float:
    """float32 bytes a token adds, from the file: every compressed layer (ratio r) one
    key_length entry per r tokens, a CSA layer (r = 4) also one indexer key per 4."""
    reader = GGUFReader(gguf)
    head = reader.fields["deepseek4.attention.key_length"].contents()
    index = reader.fields["deepseek4.attention.indexer.key_length"].contents()
    ratios = reader.fields["deepseek4.attention.compress_ratios"].contents()
    return sum((head + (index if r == 4 else 0)) * 4 / r for r in ratios if r)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("context")
    result = run("--contexts", "160,288", "--steps", "2", "--real-check", "256,384", tmp=tmp)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    files = list((tmp / "out").glob("context-*.json"))
    assert len(files) == 1 and str(files[0]) in result.stdout
    return json.loads(files[0].read_text()), tmp, result.stdout


def test_demo_state_matches_the_formula_and_the_file(measured):
    data, tmp, stdout = measured
    assert {"machine", "command", "date", "demo", "real"} <= set(data)
    assert data["machine"]["device"] == "cpu" and "--contexts 160,288" in data["command"]
    demo = data["demo"]
    gguf = next((tmp / "work" / "home").rglob("expertdesk-demo.gguf"))
    per_token = demo_bytes_per_token(gguf)
    assert per_token > 0 and demo["kv_bytes_per_token"] == per_token
    short, long = demo["rows"]
    assert [short["context"], long["context"]] == [160, 288]  # both past the 128-token window
    # The tokens between the two contexts added exactly the file's bytes per token.
    assert long["measured_slope_bytes_per_token"] == per_token
    for row in demo["rows"]:
        assert row["decode_ms_per_token_median"] > 0 and row["prefill_tok_s"] > 0 and len(row["decode_ms"]) == 2
        # The formula bounds what is held, and what is held is most of it (not a loose bound).
        assert 0.8 * row["formula_used_bytes"] <= row["state_used_bytes"] <= row["formula_used_bytes"]
        assert row["state_allocated_bytes"] <= row["formula_planned_bytes"]
        assert row["state_used_bytes_after_decode"] > row["state_used_bytes"]  # the 2 decoded tokens are kept
    assert "demo" in stdout and "decode ms/tok" in stdout


def test_real_geometries_at_published_dimensions(measured):
    data, _, _ = measured
    real = {r["model"]: r for r in data["real"]}
    # DeepSeek-V4-Flash, bf16: 21 CSA layers x (512 + 128 indexer) / 4 + 20 HCA layers x 512 / 128, x 2 bytes.
    assert real["deepseek-v4-flash"]["bf16_full"]["kv_bytes_per_token"] == (21 * 640 / 4 + 20 * 512 / 128) * 2
    # Kimi-K3, bf16: 24 MLA layers x (512 latent + 64 rope); 69 KDA layers' 96 x 128 x 128 fp32 state is fixed.
    k3 = real["kimi-k3"]["bf16_full"]
    assert k3["kv_bytes_per_token"] == 24 * 576 * 2 and k3["fixed_bytes"] >= 69 * 96 * 128 * 128 * 4
    for r in real.values():
        assert [a["tokens"] for a in r["bf16_full"]["at"]] == [8192, 32768]
        small = r["small_check"]  # the real model class, built on a small real-geometry GGUF
        assert small["measured_bytes_per_token"] == small["formula_bytes_per_token"] > 0
        assert 0 < small["measured_fixed_bytes"] <= small["formula_fixed_bytes"]


def test_bad_arguments_say_what_to_use(tmp_path):
    result = run("--real", "llama", tmp=tmp_path)
    assert result.returncode == 2 and "unknown --real model(s) llama" in result.stderr
    assert "deepseek-v4-flash" in result.stderr
