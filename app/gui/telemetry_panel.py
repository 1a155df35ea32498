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

import bisect
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QPointF, QRectF, QSize, Qt, QTimer
from PySide6.QtGui import QColor, QFont, QPainter, QPen, QPixmap, QPolygonF
from PySide6.QtWidgets import (
    QDockWidget,
    QGridLayout,
    QLabel,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from app.gui.elided_label import ElidedLabel
from app.gui.heatmap import ExpertHeatMap
from app.gui.theme import ERROR_COLOR, SPACE, WARNING_COLOR, set_role
from engine.remote.metrics import describe_remote_metrics
from engine.service_events import ExpertMap

HISTORY_POINTS = 1200  # five minutes at 4 Hz
# Charts redraw at most twice a second (counters follow every snapshot).
REDRAW_INTERVAL_S = 0.5
CHART_HEIGHT = 104
HEATMAP_REFRESH_MS = 1000  # the expert heat map follows the cache once a second
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

# (key, short name in the grid, what it means: the tooltip). The first ones sit two to a
# row; the last two (sizes "used / budget") take a whole row.
COUNTERS = (
    ("cache_hits", "Hits", "Cache hits: experts found in the device tier"),
    ("cache_misses", "Misses", "Cache misses: experts loaded from the RAM tier or the SSD"),
    ("cache_evictions", "Evictions", "Device-tier slots given to another expert"),
    ("host_hits", "From RAM", "Misses served from the host-RAM tier instead of the SSD"),
    ("prefetch_hits", "Prefetched", "Experts prefetched, then used (of those prefetched)"),
    ("fallback_count", "Fallbacks", "A requested path was not usable and another was used (never silent)"),
    ("pack_read_bytes", "SSD read", "Bytes read from the Expert Pack on the drive"),
    ("h2d_bytes", "To device", "Bytes copied into the device tier"),
    ("io_errors", "I/O errors", "Expert reads that failed"),
    ("vram", "VRAM cache", "Device-tier cache: used / budget"),
    ("host", "RAM tier", "Host-RAM tier: used / budget"),
)
WIDE_COUNTERS = ("vram", "host")


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
    """One chart: title and latest value, y and time axes with units, a line; painted from a cached pixmap.

    Deliberately not a plotting library's item tree: while the engine thread runs, every
    call from Qt into Python on the GUI thread has to win the GIL back from it first (up
    to a switch interval, 5 ms, each; far more on a loaded CPU), and a pyqtgraph redraw
    makes hundreds of them (paint, boundingRect, itemChange of every item), which
    stalled the chat for 100-200 ms per chart. Here a repaint is one Python call that
    draws one pixmap, and the pixmap is rebuilt, with a few dozen QPainter calls, only
    when the data, the colours, the scale or the size changed. The y axis (ticks at 0,
    half and top, the unit above it, grid lines) is the cached frame; the time axis
    (seconds before the latest point) and the latest value change with the data and are
    drawn with the line. Hovering draws a marker and the value at the cursor over the
    pixmap (``hover_text``), a few calls per mouse move.
    """

    def __init__(self, spec: ChartSpec, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.spec = spec
        self.percent = spec.unit == "%"
        self.setAccessibleName(spec.title)
        self.setFixedHeight(CHART_HEIGHT)  # a fixed size: counter updates never resize (re-lay out) the charts
        self.setMinimumWidth(120)
        self.setMouseTracking(True)
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent)  # the pixmap covers every pixel
        self._xs: list[float] = []
        self._ys: list[float] = []
        self.y_top = 100.0 if self.percent else 1.0
        self._background = QColor("#ffffff")
        self._foreground = QColor("#424a53")
        self._grid = QColor("#eaeef2")
        self._line = QColor(spec.color)
        self._frame: QPixmap | None = None  # background, title and y scale (the text is the costly part)
        self._plot_rect = QRectF()  # where the line goes, in the frame's coordinates
        self._cache: QPixmap | None = None  # the frame with the line drawn in
        self._hover: int | None = None  # index of the point under the mouse
        self.renders = 0  # how often the line was drawn into a fresh pixmap (tests)

    # Data -------------------------------------------------------------------
    def set_points(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        xs, ys = list(xs), list(ys)
        if xs != self._xs or ys != self._ys:
            self._xs, self._ys = xs, ys
            self._hover = None
            self._invalidate()

    def points(self) -> tuple[list[float], list[float]]:
        """The points drawn now (x: seconds since the panel started)."""
        return list(self._xs), list(self._ys)

    def set_y_top(self, top: float) -> None:
        if top != self.y_top:
            self.y_top = top
            self._invalidate(frame=True)

    def set_colors(self, background: str, foreground: str, grid: str) -> None:
        self._background, self._foreground, self._grid = QColor(background), QColor(foreground), QColor(grid)
        self._invalidate(frame=True)

    def _invalidate(self, frame: bool = False) -> None:
        if frame:
            self._frame = None
        self._cache = None
        self.update()  # a normal, coalesced repaint; nothing is drawn here

    # Hover ------------------------------------------------------------------
    def point_at(self, x: float) -> int | None:
        """Index of the point nearest to widget x, or None without points."""
        if not self._xs or self._plot_rect.isNull():
            return None
        x0, x1 = self._xs[0], self._xs[-1]
        rect = self._plot_rect
        t = x0 + (x - rect.left()) / max(1.0, rect.width()) * (x1 - x0)
        i = bisect.bisect_left(self._xs, t)
        candidates = [j for j in (i - 1, i) if 0 <= j < len(self._xs)]
        return min(candidates, key=lambda j: abs(self._xs[j] - t))

    def hover_text(self) -> str:
        """The read-out at the mouse ("" when not hovering): value with unit, and how long ago."""
        if self._hover is None or self._hover >= len(self._xs):
            return ""
        ago = self._xs[-1] - self._xs[self._hover]
        return f"{_value_label(self._ys[self._hover], self.spec.unit)} · {_ago_label(ago)}"

    def mouseMoveEvent(self, event) -> None:  # noqa: N802 - Qt naming
        index = self.point_at(event.position().x())
        if index != self._hover:
            self._hover = index
            self.update()

    def leaveEvent(self, event) -> None:  # noqa: N802 - Qt naming
        if self._hover is not None:
            self._hover = None
            self.update()
        super().leaveEvent(event)

    # Painting ---------------------------------------------------------------
    def paintEvent(self, event) -> None:  # noqa: N802 - Qt naming
        ratio = self.devicePixelRatioF()
        size = QSize(max(1, round(self.width() * ratio)), max(1, round(self.height() * ratio)))
        if self._frame is None or self._frame.size() != size:
            self._frame = self._render_frame(size, ratio)
            self._cache = None
        if self._cache is None:
            self._cache = self._render_line()
        painter = QPainter(self)
        painter.drawPixmap(0, 0, self._cache)
        if self._hover is not None:
            self._paint_hover(painter)
        painter.end()

    def _fonts(self, painter: QPainter) -> tuple[QFont, QFont]:
        """(title font, axis font) from the widget's font: the type scale's heading-ish and small."""
        title = QFont(self.font())
        title.setPointSizeF(max(7.5, title.pointSizeF() * 0.92))
        title.setWeight(QFont.Weight.DemiBold)
        axis = QFont(self.font())
        axis.setPointSizeF(max(7.0, axis.pointSizeF() * 0.78))
        return title, axis

    def _render_frame(self, size: QSize, ratio: float) -> QPixmap:
        pixmap = QPixmap(size)
        pixmap.setDevicePixelRatio(ratio)
        pixmap.fill(self._background)
        width, height = size.width() / ratio, size.height() / ratio
        painter = QPainter(pixmap)
        title_font, axis_font = self._fonts(painter)
        painter.setFont(title_font)
        title_h = painter.fontMetrics().height()
        painter.setPen(self._foreground)
        painter.drawText(QRectF(4, 2, width - 8, title_h), Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop,
                         self.spec.title)
        painter.setFont(axis_font)
        metrics = painter.fontMetrics()
        line_h = metrics.height()
        ticks = (0.0, self.y_top / 2, self.y_top)
        labels = [_tick_label(t) for t in ticks]
        left = max(metrics.horizontalAdvance(text) for text in labels + [self.spec.unit]) + 10
        # Room above the top tick for the unit, below the zero tick for the time axis: no label is clipped.
        top = 2 + title_h + line_h
        bottom = height - line_h - 4
        right = width - 8
        plot_h = max(1.0, bottom - top)
        painter.drawText(QRectF(0, top - line_h - 1, left - 2, line_h),
                         Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, self.spec.unit)
        align = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
        for value, text in zip(ticks, labels):
            y = bottom - plot_h * value / self.y_top
            painter.setPen(QPen(self._grid, 1))
            painter.drawLine(QPointF(left, y), QPointF(right, y))
            painter.setPen(self._foreground)
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
        rect = self._plot_rect
        title_font, axis_font = self._fonts(painter)
        # The latest value, top right, in the line's colour.
        painter.setFont(title_font)
        painter.setPen(self._line)
        painter.drawText(QRectF(rect.left(), 2, rect.right() - rect.left(), painter.fontMetrics().height()),
                         Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignTop,
                         _value_label(self._ys[-1], self.spec.unit))
        # The time axis: seconds before the latest point.
        painter.setFont(axis_font)
        painter.setPen(self._foreground)
        line_h = painter.fontMetrics().height()
        span = self._xs[-1] - self._xs[0]
        for ago in _time_ticks(span):
            x = rect.right() - (ago / span * rect.width() if span else 0)
            painter.drawLine(QPointF(x, rect.bottom()), QPointF(x, rect.bottom() + 3))
            text = _ago_label(ago)
            w = painter.fontMetrics().horizontalAdvance(text) + 2
            box = QRectF(min(max(x - w / 2, rect.left() - 4), rect.right() + 8 - w), rect.bottom() + 3, w, line_h)
            painter.drawText(box, Qt.AlignmentFlag.AlignCenter, text)
        painter.setPen(QPen(self._line, 1.4))
        polyline = _polyline(self._xs, self._ys, rect.left(), rect.right(), rect.top(), rect.bottom(), self.y_top)
        if len(polyline) == 1:
            painter.setBrush(self._line)
            painter.drawEllipse(polyline[0], 1.8, 1.8)
        else:
            painter.drawPolyline(polyline)
        painter.end()
        return pixmap

    def _paint_hover(self, painter: QPainter) -> None:
        index = self._hover
        rect = self._plot_rect
        if index is None or index >= len(self._xs) or rect.isNull():
            return
        x0, x1 = self._xs[0], self._xs[-1]
        span = (x1 - x0) or 1.0
        x = rect.left() + (rect.width() / 2 if len(self._xs) == 1 else (self._xs[index] - x0) / span * rect.width())
        y = rect.bottom() - rect.height() * min(max(self._ys[index] / self.y_top, 0.0), 1.02)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(QPen(self._foreground, 1, Qt.PenStyle.DotLine))
        painter.drawLine(QPointF(x, rect.top()), QPointF(x, rect.bottom()))
        painter.setPen(QPen(self._line, 1.5))
        painter.setBrush(self._background)
        painter.drawEllipse(QPointF(x, y), 3, 3)
        _title_font, axis_font = self._fonts(painter)
        painter.setFont(axis_font)
        text = self.hover_text()
        metrics = painter.fontMetrics()
        w, h = metrics.horizontalAdvance(text) + 10, metrics.height() + 4
        bx = x + 6 if x + 6 + w <= rect.right() else x - 6 - w
        box = QRectF(max(rect.left(), bx), rect.top(), w, h)
        painter.setPen(QPen(self._grid, 1))
        painter.setBrush(self._background)
        painter.drawRoundedRect(box, 3, 3)
        painter.setPen(self._foreground)
        painter.drawText(box, Qt.AlignmentFlag.AlignCenter, text)


def _value_label(value: float, unit: str) -> str:
    """'91 %', '12.3 tok/s', '0.0021 GB' (3 significant digits)."""
    text = f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if "e" in text:
        text = f"{value:.1e}"
    return f"{text} {unit}"


def _ago_label(seconds: float) -> str:
    """'now', '-30 s', '-2 min' (the time axis, relative to the latest point)."""
    if seconds < 0.5:
        return "now"
    if seconds < 120:
        return f"−{seconds:.0f} s"
    return f"−{seconds / 60:.0f} min"


def _time_ticks(span: float) -> list[float]:
    """Seconds before the latest point to put time ticks at: 0 and up to 3 tidy steps."""
    for step in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600):
        if span / step <= 3:
            return [k * step for k in range(int(span // step) + 1)]
    return [0.0]


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
        layout.setContentsMargins(SPACE["s"], SPACE["s"], SPACE["s"], SPACE["s"])
        layout.setSpacing(SPACE["s"])
        self.error_label = QLabel(body)
        self.error_label.setObjectName("telemetryError")
        self.error_label.setWordWrap(True)
        self.error_label.setAccessibleName("Telemetry error")
        self.error_label.setVisible(False)
        layout.addWidget(self.error_label)
        # A model on a server: what its /metrics offer and what they do not (engine.remote.metrics).
        self.remote_label = QLabel(body)
        self.remote_label.setObjectName("telemetryRemote")
        self.remote_label.setWordWrap(True)
        self.remote_label.setAccessibleName("Server metrics")
        self.remote_label.setVisible(False)
        layout.addWidget(self.remote_label)

        # Counters first, in a compact grid (all of them visible without scrolling).
        grid = QGridLayout()
        grid.setHorizontalSpacing(SPACE["s"])
        grid.setVerticalSpacing(2)
        self.counter_labels: dict[str, ElidedLabel] = {}
        self.counter_names: dict[str, QLabel] = {}
        position = 0
        for key, title, tip in COUNTERS:
            name = set_role(QLabel(title, body), "muted")
            name.setToolTip(tip)
            value = ElidedLabel("–", body)
            value.setObjectName(f"counter_{key}")
            value.setAccessibleName(title)
            value.setToolTip(tip)
            value.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            if key in WIDE_COUNTERS:
                position += position % 2  # a whole row of its own
                row = position // 2
                grid.addWidget(name, row, 0)
                grid.addWidget(value, row, 1, 1, 3)
                position += 2
            else:
                row, pair = divmod(position, 2)
                grid.addWidget(name, row, 2 * pair)
                grid.addWidget(value, row, 2 * pair + 1)
                position += 1
            self.counter_labels[key] = value
            self.counter_names[key] = name
        grid.setColumnStretch(1, 1)
        grid.setColumnStretch(3, 1)
        layout.addLayout(grid)

        self.charts: dict[str, TrendChart] = {}
        for chart in CHARTS:
            self.charts[chart.key] = TrendChart(chart, body)
            layout.addWidget(self.charts[chart.key])

        self.heatmap_title = set_role(QLabel("Experts per layer: where they sit, how much they were used", body),
                                      "heading")
        self.heatmap_title.setWordWrap(True)
        layout.addWidget(self.heatmap_title)
        self.heatmap = ExpertHeatMap(body)
        self.heatmap.setToolTip("Colour: VRAM, RAM tier or SSD only · brighter: used more lately")
        layout.addWidget(self.heatmap)
        layout.addStretch(1)

        scroll = QScrollArea(self)
        scroll.setWidgetResizable(True)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setWidget(body)
        scroll.setMinimumWidth(300)
        self.setWidget(scroll)

        self._map_source: Callable[[], ExpertMap | None] | None = None
        self._map_timer = QTimer(self)
        self._map_timer.setInterval(HEATMAP_REFRESH_MS)
        self._map_timer.timeout.connect(self.refresh_heatmap)
        self._map_timer.start()

        self.set_dark(False)

    def set_dark(self, dark: bool) -> None:
        """Chart colours for the theme."""
        self._dark = dark
        background, foreground, grid = ("#0d1117", "#c9d1d9", "#21262d") if dark else ("#ffffff", "#424a53", "#eaeef2")
        for chart in self.charts.values():
            chart.set_colors(background, foreground, grid)
        self.heatmap.set_colors(dark, background, foreground)
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
        self.heatmap.set_map(None)

    def set_expert_map_source(self, source: Callable[[], ExpertMap | None]) -> None:
        """Where the heat map gets its data (the engine bridge's ``expert_map``), read once a second."""
        self._map_source = source
        self.refresh_heatmap()

    def refresh_heatmap(self) -> None:
        """Read the expert map and show it (only while the panel is shown; a None keeps the last one:
        the engine held the cache's lock, or the model has no pack, which ``reset`` showed already)."""
        if self._map_source is None or not self.isVisible():
            return
        expert_map = self._map_source()
        if expert_map is not None:
            self.heatmap.set_map(expert_map)

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
        remote = describe_remote_metrics(snap)
        if remote != self.remote_label.text():
            self.remote_label.setText(remote)
            self.remote_label.setVisible(bool(remote))
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
        self.refresh_heatmap()

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
