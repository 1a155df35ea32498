"""Helpers for the GUI tests: a scripted stand-in engine and small waiting utilities.

``ScriptedEngineService`` has EngineService's interface (load / submit / cancel /
snapshot / shutdown, events on its own worker thread) and streams a fixed Markdown
reply at a chosen speed. The main GUI tests drive the real EngineService on the demo
model; this one serves tests that need exact control (a long reply, an I/O error).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.service_events import (
    LOAD_REQUEST_ID,
    DoneEvent,
    ErrorEvent,
    GenerateRequest,
    ModelLoadedEvent,
    PhaseEvent,
    ReplyStats,
    TokenEvent,
)

SCRIPTED_REPLY = (
    "Here is a function that adds two numbers:\n\n"
    "```python\ndef add(a: int, b: int) -> int:\n    \"\"\"Return the sum.\"\"\"\n    return a + b\n```\n\n"
    "It works for **any** integers, and `add(2, 3)` returns `5`.\n\n"
    "| input | output |\n|---|---|\n| 2, 3 | 5 |\n| -1, 1 | 0 |\n"
)
SCRIPTED_REASONING = "The user wants a small example. A two-line function is enough."


class ScriptedEngineService:
    """EngineService look-alike: replies with ``reply`` split into ~4-character tokens."""

    def __init__(
        self,
        on_event: Callable[[object], None],
        options: Any = None,
        *,
        reply: str = SCRIPTED_REPLY,
        reasoning: str = SCRIPTED_REASONING,
        token_delay_s: float = 0.002,
        io_error_after: int | None = None,
    ) -> None:
        self._on_event = on_event
        self.options = options
        self.reply = reply
        self.reasoning = reasoning
        self.token_delay_s = token_delay_s
        self.io_error_after = io_error_after
        self.requests: list[GenerateRequest] = []
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._cancelled: set[str] = set()
        self._counters = {"cache_hits": 0, "cache_misses": 0, "cache_evictions": 0, "pack_read_bytes": 0,
                          "h2d_bytes": 0, "fallback_count": 0, "io_errors": 0, "slot_count": 28, "slots_used": 0,
                          "cache_bytes": 28 * 2**20, "host_bytes_used": 0, "host_bytes_budget": 0}
        self._status = {"phase": "idle", "request_id": None, "done": 0, "total": 0, "completion_tokens": 0}
        self._loaded = False
        self._thread = threading.Thread(target=self._run, name="scripted-engine", daemon=True)
        self._thread.start()

    def load(self, model_ref: str, options: Any = None) -> None:
        self.options = options if options is not None else self.options
        self._ref = model_ref
        self._jobs.put(("load", model_ref))

    def set_options(self, options: Any) -> None:
        self.options = options
        self._jobs.put(("load", self._ref))

    def submit(self, request: GenerateRequest) -> str:
        self.requests.append(request)
        self._jobs.put(("generate", request))
        return request.request_id

    def cancel(self, request_id: str | None = None) -> None:
        with self._lock:
            self._cancelled.add(request_id or self._status["request_id"] or "")

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            data = dict(self._status)
            data["runtime"] = dict(self._counters, time=time.time())
        data["time"] = time.time()
        return data

    def expert_map(self) -> None:
        return None  # experts held in memory, like a GGUF loaded without a pack

    def shutdown(self, timeout: float = 10.0) -> None:
        self.cancel(None)
        self._jobs.put(("stop", None))
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            kind, payload = self._jobs.get()
            if kind == "stop":
                return
            if kind == "load":
                self._on_event(PhaseEvent(LOAD_REQUEST_ID, "loading", 0, 1, "scripted"))
                self._loaded = True
                self._on_event(ModelLoadedEvent("Scripted test model", "deepseek4", True, 4096, "cpu"))
                self._on_event(PhaseEvent(LOAD_REQUEST_ID, "idle"))
            else:
                self._generate(payload)

    def _generate(self, request: GenerateRequest) -> None:
        rid = request.request_id
        start = time.perf_counter()
        with self._lock:
            self._status.update(phase="prefill", request_id=rid, done=0, total=10, completion_tokens=0)
        self._on_event(PhaseEvent(rid, "prefill", 0, 10))
        self._on_event(PhaseEvent(rid, "prefill", 10, 10))
        self._on_event(PhaseEvent(rid, "decoding", 0, request.sampling.max_tokens))
        pieces = [(True, self.reasoning[i:i + 4]) for i in range(0, len(self.reasoning), 4)] if request.thinking \
            else []
        pieces += [(False, self.reply[i:i + 4]) for i in range(0, len(self.reply), 4)]
        answer, thought, reason, count = [], [], "eos", 0
        for reasoning, text in pieces:
            with self._lock:
                cancelled = rid in self._cancelled
            if cancelled:
                reason = "cancelled"
                break
            if count >= request.sampling.max_tokens:
                reason = "max_tokens"
                break
            if self.io_error_after is not None and count >= self.io_error_after:
                with self._lock:
                    self._counters["io_errors"] += 1
                    self._status.update(phase="idle", request_id=None)
                self._on_event(ErrorEvent(rid, "io", "reading experts from the pack failed: [Errno 5] EIO. "
                                                     "Check the drive and send again"))
                self._on_event(PhaseEvent(rid, "idle"))
                return
            time.sleep(self.token_delay_s)
            count += 1
            with self._lock:
                self._status.update(phase="decoding", done=count, completion_tokens=count)
                self._counters["cache_hits"] += 5
                self._counters["cache_misses"] += 1
                self._counters["pack_read_bytes"] += 1 << 20
                self._counters["h2d_bytes"] += 1 << 20
                self._counters["slots_used"] = min(28, self._counters["slots_used"] + 1)
            (thought if reasoning else answer).append(text)
            self._on_event(TokenEvent(rid, text, reasoning))
        elapsed = time.perf_counter() - start
        stats = ReplyStats(prompt_tokens=10, completion_tokens=count, ttft_s=0.01, prefill_tok_s=1000.0,
                           decode_tok_s=count / max(elapsed, 1e-6), hit_rate=5 / 6,
                           ssd_gb_per_token=(1 << 20) / 1e9, stop_reason=reason, cache_hits=5 * count,
                           cache_misses=count, pack_read_bytes=count << 20, elapsed_s=elapsed)
        with self._lock:
            self._cancelled.discard(rid)
            self._status.update(phase="idle", request_id=None)
        self._on_event(DoneEvent(rid, stats, "".join(answer), "".join(thought)))
        self._on_event(PhaseEvent(rid, "idle"))


def scripted_factory(**overrides: Any) -> Callable[..., ScriptedEngineService]:
    """A service_factory for MainWindow / EngineBridge that builds a ScriptedEngineService."""

    def make(on_event: Callable[[object], None], options: Any = None) -> ScriptedEngineService:
        return ScriptedEngineService(on_event, options, **overrides)

    return make


# Fixtures and helpers for tests that open the real window ------------------------------
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def gui_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, demo_home: Path) -> Path:
    """Fresh config and data dirs (settings, history) for one test; the shared demo cache."""
    monkeypatch.setenv("EXPERTDESK_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("EXPERTDESK_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("EXPERTDESK_HOME", str(demo_home))
    return tmp_path


@pytest.fixture
def open_window(qtbot, gui_env):
    """Factory: a shown MainWindow on the real engine (CPU) with the demo model loaded."""
    from app.gui.main_window import MainWindow
    from app.gui.settings import AppSettings

    windows = []

    def open_(*, service_factory=None, wait_loaded: bool = True, settings=None):
        window = MainWindow(settings=settings or AppSettings(device="cpu"), service_factory=service_factory)
        qtbot.addWidget(window)
        window.show()
        windows.append(window)
        if wait_loaded:
            qtbot.waitUntil(lambda: window.bridge.loaded is not None, timeout=60_000)
        return window

    yield open_
    for window in windows:
        window.close()


def set_sampling(window, *, max_tokens: int, seed: int | None = 7, temperature: float | None = None) -> None:
    """Set the conversation panel's sampling (applied to the next message sent)."""
    panel = window.settings_panel
    panel.max_tokens.setValue(max_tokens)
    panel.seed.setValue(-1 if seed is None else seed)
    if temperature is not None:
        panel.temperature.setValue(temperature)
    panel.flush()


def send_and_wait(qtbot, window, text: str, *, timeout_ms: int = 60_000) -> int:
    """Type a message, press Enter, wait until the reply is saved and shown; returns its message id."""
    from PySide6.QtCore import Qt

    window.composer.set_text(text)
    with qtbot.waitSignal(window.controller.replyFinished, timeout=timeout_ms) as blocker:
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    return blocker.args[0]


def run_kill_child(data_dir: str, max_tokens: int) -> None:
    """Child process of the kill -9 test: open the window, send a message, report every flush shown.

    Prints one JSON line per event on stdout: {"loaded"}, {"sent": message text}, then
    {"shown": reply text on screen} after each flush has been saved and rendered.
    """
    os.environ["QT_QPA_PLATFORM"] = "offscreen"
    os.environ["EXPERTDESK_DATA_DIR"] = data_dir
    import torch
    from PySide6.QtWidgets import QApplication

    torch.set_num_threads(1)
    app = QApplication(sys.argv[:1])
    from app.gui.main_window import MainWindow
    from app.gui.settings import AppSettings

    window = MainWindow(settings=AppSettings(device="cpu"))
    window.show()

    def report(**item) -> None:
        sys.stdout.write(json.dumps(item) + "\n")
        sys.stdout.flush()

    def on_loaded(_event) -> None:
        report(loaded=True)
        set_sampling(window, max_tokens=max_tokens)
        window.controller.send("Tell me about json.dumps and pathlib, at length.")
        report(sent="Tell me about json.dumps and pathlib, at length.")

    def on_text(request_id: str, _text: str, _reasoning: str) -> None:
        # Connected after the controller's own slot: it runs once the flush is saved and shown.
        active = window.controller.active
        if active is not None and active.request_id == request_id:
            widget = window.chat_view.widget_for(active.message_id)
            report(shown=widget.content, reasoning=widget.reasoning)

    window.bridge.modelLoaded.connect(on_loaded)
    window.bridge.textArrived.connect(on_text)
    app.exec()


if __name__ == "__main__":
    run_kill_child(sys.argv[1], int(sys.argv[2]))
