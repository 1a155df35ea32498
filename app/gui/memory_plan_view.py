"""The memory plan as the wizard's checks page shows it: one stacked bar per memory.

Why: `engine.memory_plan` decides who gets how much of the VRAM (dense weights, KV
state at the wanted context, activations, safety margin, expert cache) and of the RAM
(host-RAM expert tier, margin for the OS and the app). `expertdesk check --source`
prints it as text bars; here the same plan is one compact bar per memory with a segment
per consumer, and a wrapped legend under it naming each segment with its size (the
text is in labels, never painted into the bar, so it wraps instead of being cut).
The plan is computed on the checks' worker thread (`wizard_logic.check_target`);
this widget only draws it.
"""

from __future__ import annotations

import html
from typing import Any

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPaintEvent, QPalette
from PySide6.QtWidgets import QLabel, QSizePolicy, QVBoxLayout, QWidget

from app.gui.theme import SPACE
from packer.diskio import format_bytes

FREE = "left free"  # the part of a memory no consumer is planned to use
# One colour per consumer, (light theme, dark theme); readable on both window colours.
SEGMENT_COLORS = {
    "dense weights": ("#0969da", "#4493f8"),
    "kv state": ("#bf8700", "#d29922"),
    "activations": ("#8250df", "#a371f7"),
    "margin": ("#6e7781", "#8b949e"),
    "expert cache": ("#1a7f37", "#3fb950"),
    "host expert tier": ("#1a7f37", "#3fb950"),
    "OS + app margin": ("#6e7781", "#8b949e"),
    FREE: ("#d0d7de", "#30363d"),
}
OTHER_COLOR = ("#bc4c00", "#db6d28")
BAR_HEIGHT = 14
MIN_SEGMENT_PX = 3  # a consumer of a few MiB next to GiBs still shows as a sliver


def _dark(widget: QWidget) -> bool:
    return widget.palette().color(QPalette.ColorRole.Window).lightness() < 128


def segment_label(name: str, plan: Any) -> str:
    """What the legend calls a consumer ('kv state' says the context it is sized for,
    'activations' the prompt chunk)."""
    if name == "kv state":
        return f"KV state at {plan.context_tokens:,} tokens"
    if name == "activations":
        return f"activations (prompt chunks of {plan.prompt_chunk:,} tokens)"
    return name


class StackedBar(QWidget):
    """A horizontal bar split into `segments` ((consumer, bytes)) in proportion to `total`."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.segments: list[tuple[str, int]] = []
        self.total = 0
        self.setFixedHeight(BAR_HEIGHT)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt naming
        return QSize(240, BAR_HEIGHT)

    def set_segments(self, segments: list[tuple[str, int]], total: int) -> None:
        self.segments, self.total = list(segments), max(0, int(total))
        self.update()

    def color(self, name: str) -> QColor:
        return QColor(SEGMENT_COLORS.get(name, OTHER_COLOR)[_dark(self)])

    def segment_rects(self) -> list[tuple[str, QRectF]]:
        """Each segment's rectangle: width in proportion to its bytes, at least a sliver
        when it has any, the last one ending at the bar's right edge."""
        width = float(self.width())
        shown = [(n, b) for n, b in self.segments if b > 0]
        if not shown or self.total <= 0:
            return []
        widths = [max(MIN_SEGMENT_PX, width * b / self.total) for _, b in shown]
        excess = sum(widths) - width
        if excess > 0:  # the slivers came out of the widest segment
            widest = widths.index(max(widths))
            widths[widest] = max(MIN_SEGMENT_PX, widths[widest] - excess)
        rects, x = [], 0.0
        for (name, _), w in zip(shown, widths):
            rects.append((name, QRectF(x, 0.0, min(w, width - x), float(self.height()))))
            x += w
        return rects

    def paintEvent(self, _event: QPaintEvent) -> None:  # noqa: N802 - Qt naming
        painter = QPainter(self)
        try:
            painter.fillRect(self.rect(), self.color(FREE))
            for name, rect in self.segment_rects():
                painter.fillRect(rect, self.color(name))
        finally:
            painter.end()


class MemoryPlanView(QWidget):
    """The plan's bars: the device memory (GPU, or RAM when the model runs on the CPU)
    and, on a GPU machine, the RAM of the host expert tier. Hidden without a plan."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("memoryPlanView")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(SPACE["xs"])
        self.heading = self._label()
        layout.addWidget(self.heading)
        self.titles: dict[str, QLabel] = {}
        self.bars: dict[str, StackedBar] = {}
        self.legends: dict[str, QLabel] = {}
        for memory in ("device", "ram"):
            self.titles[memory] = self._label()
            self.bars[memory] = StackedBar(self)
            self.legends[memory] = self._label()
            for widget in (self.titles[memory], self.bars[memory], self.legends[memory]):
                layout.addWidget(widget)
        self.plan: Any = None
        self.setVisible(False)

    def _label(self) -> QLabel:
        label = QLabel(self)
        label.setWordWrap(True)
        label.setTextFormat(Qt.TextFormat.RichText)
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        return label

    def set_plan(self, plan: Any) -> None:
        """Show `plan` (engine.memory_plan.MemoryPlan), or hide when it is None."""
        self.plan = plan
        self.setVisible(plan is not None)
        if plan is None:
            return
        self.heading.setText(f"<b>Memory plan</b> for a context of {plan.context_tokens:,} tokens: what each "
                             "consumer gets when this model loads; the expert cache takes what is left, "
                             "in whole experts.")
        on_gpu = str(plan.device).startswith("cuda")
        memories = {"device": ("GPU memory" if on_gpu else "RAM (no GPU: the model runs on the CPU)",
                               plan.device_total, plan.device_parts),
                    "ram": ("RAM (host expert tier)", plan.ram_total, plan.ram_parts)}
        for memory, (title, total, parts) in memories.items():
            shown = bool(parts) and total > 0
            for widget in (self.titles[memory], self.bars[memory], self.legends[memory]):
                widget.setVisible(shown)
            if not shown:
                continue
            segments = [(name, int(nbytes)) for name, nbytes in parts.items()]
            left = total - sum(b for _, b in segments)
            if left > 0:
                segments.append((FREE, left))
            bar = self.bars[memory]
            bar.set_segments(segments, total)
            self.titles[memory].setText(f"<b>{html.escape(title)}</b>: {format_bytes(total)} to share")
            self.legends[memory].setText(" &nbsp; ".join(
                f'<span style="color:{bar.color(name).name()}">■</span>&nbsp;'
                f"{html.escape(segment_label(name, plan))}&nbsp;{format_bytes(nbytes)}"
                for name, nbytes in segments))
            described = ", ".join(f"{segment_label(n, plan)} {format_bytes(b)}" for n, b in segments)
            bar.setAccessibleName(f"{title} plan")
            bar.setAccessibleDescription(described)
            bar.setToolTip(described)
