"""The status bar's engine line: phase, progress, a running clock and time since the last progress.

Users' top complaint about big local models is not knowing "slow" from "stuck". While
the engine works, this shows which phase it is in (loading, prefill with a progress
bar, decoding with tokens and speed), a clock running since the work began, and, when
nothing has moved for a few seconds, how long ago the last progress came.
"""

from __future__ import annotations

import time

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QWidget

from engine.service_events import PhaseEvent

CLOCK_INTERVAL_MS = 100
QUIET_AFTER_S = 3.0

PHASE_TITLES = {
    "loading": "Loading model",
    "prefill": "Reading the prompt (prefill)",
    "decoding": "Writing the reply",
    "idle": "Idle",
}


class EngineStatus(QWidget):
    """Phase + progress + clock, for the status bar."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.phase_label = QLabel("Idle", self)
        self.phase_label.setObjectName("phase")
        self.phase_label.setAccessibleName("Engine phase")
        self.progress = QProgressBar(self)
        self.progress.setAccessibleName("Progress")
        self.progress.setMaximumWidth(160)
        self.progress.setTextVisible(False)
        # Keep its place when hidden: showing it must not re-lay out the status bar mid-reply.
        policy = self.progress.sizePolicy()
        policy.setRetainSizeWhenHidden(True)
        self.progress.setSizePolicy(policy)
        self.progress.setVisible(False)
        self.clock_label = QLabel("", self)
        self.clock_label.setObjectName("clock")
        self.clock_label.setAccessibleName("Elapsed time")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(4, 0, 4, 0)
        layout.setSpacing(12)
        layout.addWidget(self.phase_label)
        layout.addWidget(self.clock_label)
        layout.addWidget(self.progress)
        self._timer = QTimer(self)
        self._timer.setInterval(CLOCK_INTERVAL_MS)
        self._timer.timeout.connect(self._tick)
        self.phase = "idle"
        self._started = 0.0
        self._last_progress = 0.0
        self._decode_started: tuple[float, int] | None = None
        self._last_done = 0

    @property
    def working(self) -> bool:
        return self._timer.isActive()

    def start(self, phase: str = "loading", detail: str = "") -> None:
        """Work began (a model load or a reply): start the clock."""
        self._started = self._last_progress = time.monotonic()
        self._decode_started = None
        self._timer.start()
        self.show_phase(PhaseEvent("", phase, 0, 0, detail))

    def stop(self, text: str = "Idle") -> None:
        """Work ended: stop the clock, keep the final time visible."""
        self._timer.stop()
        self.phase = "idle"
        self.progress.setVisible(False)
        self.phase_label.setText(text)
        if self._started:
            self.clock_label.setText(f"took {_clock(time.monotonic() - self._started)}")

    def show_phase(self, event: PhaseEvent) -> None:
        """Show one phase report (called once per flush at most)."""
        now = time.monotonic()
        if event.phase == "idle":
            return  # the reply's end (done / error) decides what the idle line says
        if not self._timer.isActive():
            self._started = now
            self._timer.start()
        if event.phase != self.phase or event.done != self._last_done:
            self._last_progress = now
        self._last_done = event.done
        if event.phase == "decoding" and (self._decode_started is None or self.phase != "decoding"):
            self._decode_started = (now, event.done)
        self.phase = event.phase
        text = PHASE_TITLES.get(event.phase, event.phase)
        if event.phase == "prefill" and event.total:
            text += f" · {event.done:,} / {event.total:,} tokens"
        elif event.phase == "decoding":
            text += f" · {event.done:,} tokens"
            if self._decode_started and event.done > self._decode_started[1] and now > self._decode_started[0]:
                rate = (event.done - self._decode_started[1]) / (now - self._decode_started[0])
                text += f" · {rate:.1f} tok/s"
        elif event.phase == "loading" and event.total:
            text += f" · {event.done} / {event.total}"
        if event.detail:
            text += f" · {event.detail}"
        self.phase_label.setText(text)
        show_bar = event.phase in ("prefill", "loading") and event.total > 0
        self.progress.setVisible(show_bar)
        if show_bar:
            # QProgressBar.setValue repaints synchronously, which composes every pending
            # update of the window (charts included) inside this slot: 100+ ms measured.
            # With updates off it only schedules a normal, coalesced update.
            self.progress.setUpdatesEnabled(False)
            self.progress.setRange(0, event.total)
            self.progress.setValue(min(event.done, event.total))
            self.progress.setUpdatesEnabled(True)
        self._tick()

    def note_progress(self) -> None:
        """Something visible happened (reply text arrived): reset the "last progress" timer."""
        self._last_progress = time.monotonic()

    def _tick(self) -> None:
        now = time.monotonic()
        text = _clock(now - self._started)
        quiet = now - self._last_progress
        if quiet >= QUIET_AFTER_S:
            text += f" · last progress {quiet:.0f} s ago"
        self.clock_label.setText(text)


def _clock(seconds: float) -> str:
    minutes, rest = divmod(max(0.0, seconds), 60)
    return f"{int(minutes)}:{rest:04.1f}"
