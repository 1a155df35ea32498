"""`expertdesk generate`, `chat` and `bench` on the demo model."""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import main

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("demo_home")  # the session's shared demo build (conftest)


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: expertdesk {command}" in out and "PACKDIR|GGUF|demo" in out
    assert "--cache-mib" in out and "--device" in out
    if command != "bench":
        assert "--temperature" in out and "--think" in out


def test_generate_demo_streams_to_stdout_and_stats_to_stderr(tmp_path, capsys):
    stats_file = tmp_path / "stats.json"
    code = main(["generate", "demo", "--prompt", "What does json.dumps do?", "--temperature", "0",
                 "--max-tokens", "8", "--device", "cpu", "--stats-json", str(stats_file)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.strip()
    assert "[loaded] ExpertDesk demo (tiny, not a real model)" in captured.err and "DEMO" in captured.err
    assert "context 2048, cpu, float32)" in captured.err  # where and in which precision it computes
    assert "decode" in captured.err and "hit rate" in captured.err and "stop:" in captured.err
    record = json.loads(stats_file.read_text())
    assert record["is_demo"] is True and record["sampling"]["temperature"] == 0
    stats = record["stats"]
    for key in ("prompt_tokens", "completion_tokens", "ttft_s", "prefill_tok_s", "decode_tok_s", "hit_rate",
                "ssd_gb_per_token", "stop_reason"):
        assert key in stats
    assert 1 <= stats["completion_tokens"] <= 8


def test_generate_is_reproducible_and_honours_stop(capsys):
    args = ["generate", "demo", "--prompt", "Tell me the Zen of Python.", "--temperature", "0.8", "--seed", "5",
            "--max-tokens", "10", "--device", "cpu"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_generate_reports_a_bad_model(tmp_path, capsys):
    code = main(["generate", str(tmp_path / "nope.gguf"), "--prompt", "hi", "--device", "cpu"])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_generate_refuses_bad_sampling(capsys):
    assert main(["generate", "demo", "--prompt", "hi", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_generate_as_a_console_command(demo_home):
    env = dict(os.environ, EXPERTDESK_HOME=str(demo_home), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "app", "generate", "demo", "--prompt", "Hi", "--max-tokens", "4",
                           "--temperature", "0", "--device", "cpu"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and "tok/s" in proc.stderr


def test_bench_demo_writes_the_reference_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "demo", "--suite", "seed10", "--max-tokens", "2", "--device", "cpu", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "| model | prefill tok/s (Alpaca / MMLU) | decode tok/s (Alpaca / MMLU) | hit rate " \
           "| SSD GB per generated token |" in captured.out
    assert "mmlu-professional_law-10971" in captured.out
    data = json.loads(out.read_text())
    assert data["command"].startswith("expertdesk bench demo --suite seed10 --max-tokens 2")
    assert data["date"] and data["machine"]["cpu_count"] and data["machine"]["torch"]
    assert data["model"]["is_demo"] is True and data["settings"]["temperature"] == 0
    assert [p["sample_id"] for p in data["prompts"]][:3] == ["alpaca-37246", "mmlu-abstract_algebra-14",
                                                             "alpaca-50812"]
    assert len(data["prompts"]) == 10
    for row in data["prompts"]:
        assert row["error"] is None
        for key in ("prefill_tok_s", "decode_tok_s", "hit_rate", "ssd_gb_per_token", "prompt_tokens",
                    "completion_tokens"):
            assert key in row
        assert 1 <= row["completion_tokens"] <= 2
    assert set(data["summary"]) == {"Alpaca", "MMLU"}
    assert data["summary"]["MMLU"]["requests"] == 5
    assert 0 <= data["summary"]["Alpaca"]["hit_rate"] <= 1


def test_bench_suite_is_the_reference_protocol():
    from engine.bench_suites import SEED10, SEED10_MAX_TOKENS, SEED10_TEMPERATURE, suite

    assert SEED10_TEMPERATURE == 0 and SEED10_MAX_TOKENS == 200
    assert [p.dataset for p in SEED10] == ["Alpaca", "MMLU"] * 5
    assert SEED10[4].prompt == "Translate this phrase from Spanish to English: El sol no brilla hoy."
    assert "S_n for n = 10" in SEED10[1].prompt and "D. 105" in SEED10[1].prompt
    with pytest.raises(ValueError, match="seed10"):
        suite("nope")


def test_chat_streams_resets_and_exits(monkeypatch, capsys):
    lines = iter(["Hello!", "/reset", "What is the json module?", "/exit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    code = main(["chat", "demo", "--temperature", "0", "--max-tokens", "6", "--device", "cpu"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.count("model> ") == 2
    assert "[new conversation]" in captured.err
    assert captured.err.count("stop: max_tokens") + captured.err.count("stop: eos") == 2


def test_chat_ctrl_c_stops_the_reply_and_a_second_quits(monkeypatch, capsys):
    from app import cli_chat
    from engine.service_events import TokenEvent

    real_run = cli_chat.TerminalEngine.run_request
    presses = {"n": 0}

    class CtrlCAfterTwoTokens:
        """The event queue as the main thread sees it, with Ctrl+C pressed after two tokens."""

        def __init__(self, inner, times):
            self.inner, self.tokens, self.times = inner, 0, times

        def get(self, *args, **kwargs):
            if self.tokens >= 2 and self.times:
                self.times -= 1
                presses["n"] += 1
                raise KeyboardInterrupt
            event = self.inner.get(*args, **kwargs)
            self.tokens += isinstance(event, TokenEvent)
            return event

    def run_request(self, request, on_text, _times=iter([1, 2])):  # noqa: B008 (one iterator shared by all calls, on purpose)
        inner = self.events
        self.events = CtrlCAfterTwoTokens(inner, next(_times))
        try:
            return real_run(self, request, on_text)
        finally:
            self.events = inner

    lines = iter(["Tell me the Zen of Python.", "Tell me the Zen of Python.", "/exit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    monkeypatch.setattr(cli_chat.TerminalEngine, "run_request", run_request)
    code = main(["chat", "demo", "--temperature", "0", "--max-tokens", "150", "--device", "cpu"])
    captured = capsys.readouterr()
    assert code == 0
    # First reply: one Ctrl+C stops it and the chat goes on; second reply: two Ctrl+C quit.
    assert captured.err.count("[stopping - press Ctrl+C again to quit]") == 2
    assert captured.err.count("stop: cancelled") == 1
    assert "[quit]" in captured.err and presses["n"] == 3


def test_chat_eof_quits(monkeypatch, capsys):
    def eof(prompt=""):
        raise EOFError

    monkeypatch.setattr(builtins, "input", eof)
    assert main(["chat", "demo", "--device", "cpu"]) == 0


def test_log_level_applies_to_every_command_and_writes_the_log_file(tmp_path, monkeypatch, capsys):
    from app.logging_setup import configure_logging

    logs = tmp_path / "logs"
    monkeypatch.setenv("EXPERTDESK_LOG_DIR", str(logs))
    monkeypatch.delenv("EXPERTDESK_LOG_LEVEL", raising=False)
    bad = str(tmp_path / "nope.gguf")
    try:
        assert main(["--log-level", "debug", "generate", bad, "--prompt", "hi", "--device", "cpu"]) == 2
        text = (logs / "expertdesk.log").read_text(encoding="utf-8")
        assert "DEBUG app.cli" in text and f"generate {bad}" in text
        assert "DEBUG app.cli" in capsys.readouterr().err  # and on stderr

        (logs / "expertdesk.log").unlink()
        assert main(["generate", bad, "--prompt", "hi", "--device", "cpu"]) == 2  # default: warning
        assert not (logs / "expertdesk.log").exists() or "DEBUG" not in (logs / "expertdesk.log").read_text()
        assert main(["verify", str(tmp_path / "no-pack"), "--log-level", "info"]) != 0  # after the command too
        monkeypatch.setenv("EXPERTDESK_LOG_LEVEL", "debug")
        assert main(["verify", str(tmp_path / "no-pack")]) != 0
        assert f"verify {tmp_path / 'no-pack'}" in (logs / "expertdesk.log").read_text(encoding="utf-8")
    finally:
        monkeypatch.undo()
        configure_logging()  # back to the session's log folder, at warning
