"""Run slow work (opening a GGUF, preflight probes, building, verifying) off the GUI thread.

``BackgroundTask`` runs one function on a Python thread and reports back through Qt
signals. The task object has no Qt parent on purpose: its C++ side lives as long as
the Python object, which the worker thread itself keeps alive, so a signal is never
emitted from a dead object even when the dialog that started it is closed mid-way.
Signals emitted on the worker thread reach GUI-thread receivers as queued calls.

Progress is throttled: the worker may report thousands of times; the GUI thread sees
at most one update per ``min_interval_s`` (plus every phase change and the last one).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, Signal

from app.gui.qt_compat import protect_none_refcount

# Every task that has not finished yet: keeps the Python wrapper (and so the QObject) alive.
_RUNNING: set[BackgroundTask] = set()
_RUNNING_LOCK = threading.Lock()


class BackgroundTask(QObject):
    """``fn(report)`` on a worker thread; ``report(item)`` sends progress to the GUI thread.

    Signals: ``progress(item)`` (throttled), ``succeeded(result)``, ``failed(exception)``,
    then always ``finished()``.
    """

    progress = Signal(object)
    succeeded = Signal(object)
    failed = Signal(object)
    finished = Signal()

    def __init__(self, fn: Callable[[Callable[[Any], None]], Any], *, name: str = "expertdesk-task",
                 min_interval_s: float = 0.1) -> None:
        protect_none_refcount()
        super().__init__(None)
        self._fn = fn
        self._name = name
        self._interval = min_interval_s
        self._last_emit = 0.0
        self._last_phase: object = None
        self._thread: threading.Thread | None = None
        self._delivered = False
        self.result: Any = None
        self.error: BaseException | None = None

    @property
    def running(self) -> bool:
        """From `start` until the result or the error is handed over: it is marked before
        `succeeded` / `failed` is emitted, so their receivers see a task that no longer
        runs (the thread may live a moment longer, emitting `finished`). A page that
        checked the thread instead ignored a "Try again" clicked at once."""
        return self._thread is not None and self._thread.is_alive() and not self._delivered

    def start(self) -> BackgroundTask:
        with _RUNNING_LOCK:
            _RUNNING.add(self)
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Join the worker thread (tests, shutdown); True once it has ended."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _report(self, item: Any) -> None:
        now = time.monotonic()
        phase = getattr(item, "phase", None), getattr(item, "stage", None)
        last = getattr(item, "done", 0) >= getattr(item, "total", 1) > 0
        if phase != self._last_phase or last or now - self._last_emit >= self._interval:
            self._last_emit = now
            self._last_phase = phase
            self.progress.emit(item)

    def _run(self) -> None:
        try:
            self.result = self._fn(self._report)
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the GUI, none kills the thread silently
            self.error = exc
            self._delivered = True
            self.failed.emit(exc)
        else:
            self._delivered = True
            self.succeeded.emit(self.result)
        finally:
            self.finished.emit()
            with _RUNNING_LOCK:
                _RUNNING.discard(self)


def running_tasks() -> list[BackgroundTask]:
    """Tasks still running (tests wait for them before the next test starts)."""
    with _RUNNING_LOCK:
        return list(_RUNNING)
