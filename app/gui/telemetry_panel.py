"""Live telemetry dock: charts and counters of the expert cache and the SSD, from engine snapshots.

Driven by the engine bridge's snapshot timer, which reads ``EngineService.snapshot()``
a few times a second (a thread-safe copy of the runtime's counters), never by a signal
per token. Each snapshot turns the change since the previous one into the charted rates:
cache hit rate, SSD GB per generated token, decode tok/s and SSD read bandwidth.
``io_errors`` above zero is shown as an error with what to do, not as a number.

The charts are plain widgets that paint a cached pixmap (``TrendChart``): the panel is
on screen while replies stream, so its repaints must cost the GUI thread next to
nothing while the engine thread holds the GIL most of the time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPen, QPixmap, QPolygonF
from PySide6.QtWidgets import (
    QDockWidget,
    QGridLayout,
    QLabel,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from app.gui.theme import ERROR_COLOR, WARNING_COLOR

HISTORY_POINTS = 1200  # five minutes at 4 Hz
# Charts redraw at most twice a second (counters follow every snapshot).
REDRAW_INTERVAL_S = 0.5
CHART_HEIGHT = 110
MIN_INTERVAL_S = 0.2  # shortest interval a charted rate is computed over

Snapshot = dict[str, Any]


@dataclass(frozen=True)
class ChartSpec:
    key: str
    title: str
    unit: str
    color: str


CHARTS = (
    ChartSpec("hit_rate", "Cache hit rate", "%", "#2da44e"),
    ChartSpec("ssd_gb_per_token", "SSD GB per token", "GB", "#bf8700"),
    ChartSpec("decode_tok_s", "Decode speed", "tok/s", "#0969da"),
    ChartSpec("read_mb_s", "SSD read bandwidth", "MB/s", "#8250df"),
    ChartSpec("drive_busy", "Drive busy", "%", "#cf222e"),
)

COUNTERS = (
    ("cache_hits", "Cache hits"),
    ("cache_misses", "Cache misses"),
    ("cache_evictions", "Evictions"),
    ("host_hits", "Misses served from RAM"),
    ("prefetch_hits", "Prefetched, then used"),
    ("pack_read_bytes", "Read from pack"),
    ("h2d_bytes", "Copied to device"),
    ("fallback_count", "Fallbacks"),
    ("io_errors", "I/O errors"),
    ("vram", "VRAM cache"),
    ("host", "Host RAM tier"),
)


def rates_between(before: Snapshot, after: Snapshot, tokens: int) -> dict[str, float]:
    """The charted values for the interval between two snapshots (``tokens`` generated in it).

    A value is left out when the interval has nothing to measure it by (no cache
    lookups, no tokens), so idle time does not draw misleading zeros.
    """
    dt = float(after.get("time", 0)) - float(before.get("time", 0))
    if dt <= 0:
        return {}
    out: dict[str, float] = {}
    hits = after.get("cache_hits", 0) - before.get("cache_hits", 0)
    misses = after.get("cache_misses", 0) - before.get("cache_misses", 0)
    read = after.get("pack_read_bytes", 0) - before.get("pack_read_bytes", 0)
    if hits + misses > 0:
        out["hit_rate"] = 100.0 * hits / (hits + misses)
    if tokens > 0:
        out["ssd_gb_per_token"] = read / 1e9 / tokens
        out["decode_tok_s"] = tokens / dt
    if tokens > 0 or read > 0:
        out["read_mb_s"] = read / 1e6 / dt
        busy = after.get("drive_busy_seconds", 0) - before.get("drive_busy_seconds", 0)
        out["drive_busy"] = min(100.0, 100.0 * busy / dt)  # the rest of the time the drive waited for us
    return out


def _nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k that is >= value (tidy axis limits)."""
    import math

    exponent = math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if step * 10**exponent >= value:
            return step * 10**exponent
    return 10 ** (exponent + 1)


def human_bytes(n: float) -> str:
    """Bytes in B / KiB / MiB / GiB / TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" or abs(n) >= 100 else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


class TrendChart(QWidget):
    """One chart: a title, a y scale and a line through the points; painted from a cached pixmap.

    Deliberately not a plotting library's item tree: while the engine thread runs, every
    call from Qt into Python on the GUI thread has to win the GIL back from it first (up
    to a switch interval, 5 ms, each; far more on a loaded CPU), and a pyqtgraph redraw
    makes hundreds of them (paint, boundingRect, itemChange of every item), which
    stalled the chat for 100-200 ms per chart. Here a repaint is one Python call that
    draws one pixmap, and the pixmap is rebuilt, with a handful of QPainter calls, only
    when the data, the colours, the scale or the size changed.
    """

    def __init__(self, spec: ChartSpec, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.spec = spec
        self.percent = spec.unit == "%"
        self.setAccessibleName(spec.title)
        self.setFixedHeight(CHART_HEIGHT)  # a fixed size: counter updates never resize (re-lay out) the charts
        self.setMinimumWidth(120)
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent)  # the pixmap covers every pixel
        self._xs: list[float] = []
        self._ys: list[float] = []
        self.y_top = 100.0 if self.percent else 1.0
        self._background = QColor("#ffffff")
        self._foreground = QColor("#424a53")
        self._line = QColor(spec.color)
        self._frame: QPixmap | None = None  # background, title and scale (the text is the costly part)
        self._plot_rect = QRectF()  # where the line goes, in the frame's coordinates
        self._cache: QPixmap | None = None  # the frame with the line drawn in
        self.renders = 0  # how often the line was drawn into a fresh pixmap (tests)

    # Data -------------------------------------------------------------------
    def set_points(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        xs, ys = list(xs), list(ys)
        if xs != self._xs or ys != self._ys:
            self._xs, self._ys = xs, ys
            self._invalidate()

    def points(self) -> tuple[list[float], list[float]]:
        """The points drawn now (x: seconds since the panel started)."""
        return list(self._xs), list(self._ys)

    def set_y_top(self, top: float) -> None:
        if top != self.y_top:
            self.y_top = top
            self._invalidate(frame=True)

    def set_colors(self, background: str, foreground: str) -> None:
        self._background, self._foreground = QColor(background), QColor(foreground)
        self._invalidate(frame=True)

    def _invalidate(self, frame: bool = False) -> None:
        if frame:
            self._frame = None
        self._cache = None
        self.update()  # a normal, coalesced repaint; nothing is drawn here

    # Painting ---------------------------------------------------------------
    def paintEvent(self, event) -> None:  # Qt naming
        ratio = self.devicePixelRatioF()
        size = QSize(max(1, round(self.width() * ratio)), max(1, round(self.height() * ratio)))
        if self._frame is None or self._frame.size() != size:
            self._frame = self._render_frame(size, ratio)
            self._cache = None
        if self._cache is None:
            self._cache = self._render_line()
        painter = QPainter(self)
        painter.drawPixmap(0, 0, self._cache)
        painter.end()

    def _render_frame(self, size: QSize, ratio: float) -> QPixmap:
        pixmap = QPixmap(size)
        pixmap.setDevicePixelRatio(ratio)
        pixmap.fill(self._background)
        width, height = size.width() / ratio, size.height() / ratio
        painter = QPainter(pixmap)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        font = painter.font()
        font.setPointSizeF(8.5)
        painter.setFont(font)
        metrics = painter.fontMetrics()
        line_h = metrics.height()
        painter.setPen(self._foreground)
        title_h = line_h + 4
        painter.drawText(QRectF(0, 2, width, title_h), Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignTop,
                         f"{self.spec.title} ({self.spec.unit})")
        ticks = (0.0, self.y_top / 2, self.y_top)
        labels = [_tick_label(t) for t in ticks]
        left = max(metrics.horizontalAdvance(text) for text in labels) + 10
        top, bottom, right = title_h + line_h / 2, height - line_h / 2 - 2, width - 8
        plot_h = max(1.0, bottom - top)
        align = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
        for value, text in zip(ticks, labels):
            y = bottom - plot_h * value / self.y_top
            painter.drawText(QRectF(0, y - line_h / 2, left - 6, line_h), align, text)
            painter.drawLine(QPointF(left - 4, y), QPointF(left, y))
        painter.drawLine(QPointF(left, top), QPointF(left, bottom))
        painter.end()
        self._plot_rect = QRectF(QPointF(left + 2, top), QPointF(right, bottom))
        return pixmap

    def _render_line(self) -> QPixmap:
        pixmap = QPixmap(self._frame)  # implicitly shared until painted on: a cheap copy
        if not self._xs:
            return pixmap
        self.renders += 1
        painter = QPainter(pixmap)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(QPen(self._line, 1.2))
        rect = self._plot_rect
        polyline = _polyline(self._xs, self._ys, rect.left(), rect.right(), rect.top(), rect.bottom(), self.y_top)
        if len(polyline) == 1:
            painter.setBrush(self._line)
            painter.drawEllipse(polyline[0], 1.8, 1.8)
        else:
            painter.drawPolyline(polyline)
        painter.end()
        return pixmap


def _tick_label(value: float) -> str:
    """A y-axis label: 0, 50, 100, 2.5, 0.0005 (no trailing zeros, no exponent for tidy values)."""
    if value == 0:
        return "0"
    text = f"{value:.4g}"
    return text if "e" not in text else f"{value:.1e}"


def _polyline(xs: Sequence[float], ys: Sequence[float], left: float, right: float, top: float,
              bottom: float, y_top: float) -> QPolygonF:
    """The points in widget coordinates: x spans the data's time range, y 0..y_top (clipped).

    More points than pixel columns are thinned to each column's lowest and highest value
    (in time order), which looks the same and keeps the polyline a few hundred points long.
    """
    x0, x1 = xs[0], xs[-1]
    span = (x1 - x0) or 1.0
    width = max(1.0, right - left)
    height = bottom - top
    columns = max(1, int(width))
    pairs = list(zip(xs, ys))
    if len(pairs) > 2 * columns:
        buckets: dict[int, list[tuple[float, float]]] = {}
        for x, y in pairs:
            buckets.setdefault(int((x - x0) / span * (columns - 1)), []).append((x, y))
        pairs = []
        for bucket in buckets.values():
            low, high = min(bucket, key=lambda p: p[1]), max(bucket, key=lambda p: p[1])
            pairs.extend(sorted({low, high}))
    single = len(pairs) == 1
    return QPolygonF([
        QPointF(left + (width / 2 if single else (x - x0) / span * width),
                bottom - height * min(max(y / y_top, 0.0), 1.02))
        for x, y in pairs
    ])


class TelemetryPanel(QDockWidget):
    """Charts over time and counters of the running engine, fed by ``show_snapshot``.

    A snapshot is the bridge's flattened dict: runtime counters plus ``phase`` and
    ``tokens_generated`` (all replies, never decreasing). Points are added while the
    engine works or when counters moved, so idle time does not flatten the charts.
    """

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Telemetry", parent)
        self.setObjectName("telemetryDock")
        self.setAccessibleName("Telemetry panel")
        self._t0 = time.monotonic()
        self._previous: tuple[Snapshot, int] | None = None
        self.series: dict[str, tuple[deque[float], deque[float]]] = {
            c.key: (deque(maxlen=HISTORY_POINTS), deque(maxlen=HISTORY_POINTS)) for c in CHARTS
        }
        self.last_snapshot: Snapshot | None = None
        self._dark = False
        self._dirty = False  # points added since the last redraw
        self._last_redraw = 0.0
        self._y_top: dict[str, float] = {}

        body = QWidget()
        layout = QVBoxLayout(body)
        layout.setContentsMargins(6, 6, 6, 6)
        self.error_label = QLabel(body)
        self.error_label.setObjectName("telemetryError")
        self.error_label.setWordWrap(True)
        self.error_label.setAccessibleName("Telemetry error")
        self.error_label.setVisible(False)
        layout.addWidget(self.error_label)

        self.charts: dict[str, TrendChart] = {}
        for chart in CHARTS:
            self.charts[chart.key] = TrendChart(chart, body)
            layout.addWidget(self.charts[chart.key])

        grid = QGridLayout()
        grid.setHorizontalSpacing(12)
        self.counter_labels: dict[str, QLabel] = {}
        for row, (key, title) in enumerate(COUNTERS):
            name = QLabel(title, body)
            value = QLabel("–", body)
            value.setObjectName(f"counter_{key}")
            value.setAccessibleName(title)
            value.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            value.setWordWrap(True)
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            grid.addWidget(name, row, 0)
            grid.addWidget(value, row, 1)
            self.counter_labels[key] = value
        grid.setColumnStretch(1, 1)
        layout.addLayout(grid)
        layout.addStretch(1)

        scroll = QScrollArea(self)
        scroll.setWidgetResizable(True)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setWidget(body)
        scroll.setMinimumWidth(280)
        self.setWidget(scroll)

        self.set_dark(False)

    def set_dark(self, dark: bool) -> None:
        """Chart colours for the theme."""
        self._dark = dark
        background, foreground = ("#0d1117", "#c9d1d9") if dark else ("#ffffff", "#424a53")
        for chart in self.charts.values():
            chart.set_colors(background, foreground)
        if self.last_snapshot is not None:
            self._show_counters(self.last_snapshot)

    def reset(self) -> None:
        """Forget the history (a different model was loaded)."""
        self._previous = None
        for xs, ys in self.series.values():
            xs.clear()
            ys.clear()
        for chart in self.charts.values():
            chart.set_points([], [])
            chart.set_y_top(100.0 if chart.percent else 1.0)
        self._y_top.clear()

    def flush(self) -> None:
        """Draw points still waiting for the next redraw (a reply just ended)."""
        if self._dirty:
            self.redraw()

    def point_count(self, key: str) -> int:
        return len(self.series[key][0])

    def show_snapshot(self, snap: Snapshot) -> None:
        """Update counters and charts from one snapshot (a few times a second)."""
        tokens = int(snap.get("tokens_generated", 0) or 0)
        self.last_snapshot = snap
        self._show_counters(snap)
        previous = self._previous
        if previous is not None and float(snap.get("time", 0)) - float(previous[0].get("time", 0)) < MIN_INTERVAL_S:
            # An extra snapshot right after another (a reply just ended): a rate over a few
            # milliseconds is noise, so the next regular snapshot covers this interval too.
            return
        self._previous = (snap, tokens)
        if previous is None:
            return
        before, before_tokens = previous
        moved = snap.get("pack_read_bytes", 0) != before.get("pack_read_bytes", 0) or tokens != before_tokens or (
            snap.get("cache_hits", 0) + snap.get("cache_misses", 0)
            != before.get("cache_hits", 0) + before.get("cache_misses", 0))
        if not (moved or snap.get("phase") in ("prefill", "decoding")):
            return
        x = time.monotonic() - self._t0
        for key, value in rates_between(before, snap, tokens - before_tokens).items():
            xs, ys = self.series[key]
            xs.append(x)
            ys.append(value)
            self._dirty = True
        if self._dirty and time.monotonic() - self._last_redraw >= REDRAW_INTERVAL_S:
            self.redraw()

    def redraw(self) -> None:
        """Hand the collected points to the charts (only when shown; showEvent catches up).

        Cheap: each chart only takes the points and schedules a repaint, which rebuilds
        its pixmap once.
        """
        self._last_redraw = time.monotonic()
        if not self.isVisible():
            return
        self._dirty = False
        for key, chart in self.charts.items():
            xs, ys = self.series[key]
            chart.set_points(xs, ys)
            if key != "hit_rate" and ys:
                self._fit_y(key, max(ys))

    def _fit_y(self, key: str, highest: float) -> None:
        # Grow the range at once, shrink it only when the data fell well below, so the
        # scale does not jump with every point.
        top = self._y_top.get(key, 0.0)
        if highest > top or highest < top * 0.4:
            top = _nice_ceiling(highest * 1.15) if highest > 0 else 1.0
            self._y_top[key] = top
            self.charts[key].set_y_top(top)

    def showEvent(self, event) -> None:  # noqa: N802 - Qt naming
        super().showEvent(event)
        self.redraw()

    def _show_counters(self, snap: Snapshot) -> None:
        texts = {key: f"{int(snap.get(key, 0) or 0):,}"
                 for key in ("cache_hits", "cache_misses", "cache_evictions", "host_hits", "fallback_count",
                             "io_errors")}
        issued = int(snap.get("prefetch_issued", 0) or 0)
        texts["prefetch_hits"] = f"{int(snap.get('prefetch_hits', 0) or 0):,} of {issued:,}" if issued else "–"
        texts["pack_read_bytes"] = human_bytes(snap.get("pack_read_bytes", 0) or 0)
        texts["h2d_bytes"] = human_bytes(snap.get("h2d_bytes", 0) or 0)
        slots, used = int(snap.get("slot_count", 0) or 0), int(snap.get("slots_used", 0) or 0)
        budget = int(snap.get("cache_bytes", 0) or 0)
        per_slot = budget / slots if slots else 0
        texts["vram"] = f"{human_bytes(used * per_slot)} / {human_bytes(budget)}" if slots else "–"
        host_budget = int(snap.get("host_bytes_budget", 0) or 0)
        host_used = int(snap.get("host_bytes_used", 0) or 0)
        texts["host"] = f"{human_bytes(host_used)} / {human_bytes(host_budget)}" if host_budget else "off"
        io_errors = int(snap.get("io_errors", 0) or 0)
        fallbacks = int(snap.get("fallback_count", 0) or 0)
        styles = {
            "io_errors": f"color: {ERROR_COLOR[self._dark]}; font-weight: bold;" if io_errors else "",
            "fallback_count": f"color: {WARNING_COLOR[self._dark]};" if fallbacks else "",
        }
        # Touch a label only when its text or style changes: each change re-lays out the
        # dock and a style sheet re-polishes the widget, several times a second otherwise.
        for key, label in self.counter_labels.items():
            if label.text() != texts[key]:
                label.setText(texts[key])
            style = styles.get(key, "")
            if label.styleSheet() != style:
                label.setStyleSheet(style)
        if slots:
            tip = f"{used} of {slots} expert slots in use"
            if self.counter_labels["vram"].toolTip() != tip:
                self.counter_labels["vram"].setToolTip(tip)
        if io_errors:
            self.error_label.setText(
                f'<span style="color:{ERROR_COLOR[self._dark]};"><b>Error: {io_errors} expert read(s) failed.</b> '
                "The SSD or the Expert Pack could not be read, so replies that needed those experts failed. "
                "Check the drive (dmesg, SMART), then run <code>expertdesk verify</code> on the pack; "
                "rebuild the pack if it reports damage.</span>"
            )
        self.error_label.setVisible(bool(io_errors))
