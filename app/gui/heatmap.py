"""The expert heat map: one row per MoE layer, one column per expert, coloured by where it sits.

Colour says the tier (device tier, host-RAM tier, SSD only), intensity how much the
expert was used lately (the cache's decayed use count, on a log scale relative to the
busiest expert of the map). One glance shows whether the cache holds the right
experts: bright cells should be green (in VRAM), and amber or grey bright cells are
experts the model keeps reading from RAM or the drive.

Cheap by construction, like the telemetry charts: the cells are one small QImage made
with numpy (one pixel per expert), scaled into a cached pixmap with the labels, rebuilt
only when the map, the colours or the size changed. Hovering paints a frame over the
pixmap and shows a tooltip (layer, expert, place, uses); nothing else runs per event.
"""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import QPointF, QRect, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QImage, QPainter, QPen, QPixmap
from PySide6.QtWidgets import QToolTip, QWidget

from engine.service_events import PLACE_DEVICE, PLACE_RAM, PLACE_SSD, ExpertMap

HEATMAP_HEIGHT = 190
# Tier colours per theme (dark: brighter); index = PLACE_* value.
PLACE_COLORS = {
    False: {PLACE_SSD: "#6e7781", PLACE_RAM: "#bf8700", PLACE_DEVICE: "#1a7f37"},
    True: {PLACE_SSD: "#8b949e", PLACE_RAM: "#d29922", PLACE_DEVICE: "#3fb950"},
}
LEAST = 0.16  # intensity of an expert never used lately (still shows its tier)


def place_name(place: int, device: str) -> str:
    """'VRAM' / 'RAM tier' / 'SSD only' (on a CPU the device tier is a cache in RAM too: 'CPU cache')."""
    if place == PLACE_DEVICE:
        return "VRAM" if device.startswith("cuda") else "CPU cache"
    return "RAM tier" if place == PLACE_RAM else "SSD only"


def cell_colors(places: np.ndarray, uses: np.ndarray, dark: bool, background: QColor) -> np.ndarray:
    """ARGB32 pixels (uint32, the maps' shape): the tier colour mixed into the background by use."""
    top = float(uses.max()) if uses.size else 0.0
    level = np.log1p(uses) / np.log1p(top) if top > 0 else np.zeros_like(uses)
    alpha = LEAST + (1 - LEAST) * np.clip(level, 0.0, 1.0)
    bg = np.array([background.red(), background.green(), background.blue()], dtype=np.float64)
    rgb = np.empty(places.shape + (3,), dtype=np.float64)
    for place, name in PLACE_COLORS[dark].items():
        color = QColor(name)
        rgb[places == place] = (color.red(), color.green(), color.blue())
    mixed = bg + (rgb - bg) * alpha[..., None]
    r, g, b = (np.rint(mixed[..., i]).astype(np.uint32) for i in range(3))
    return (0xFF000000 | (r << 16) | (g << 8) | b).astype(np.uint32)


class ExpertHeatMap(QWidget):
    """Paints an ``ExpertMap``; ``set_map`` with a new one, ``None`` for "no expert cache"."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Expert heat map")
        self.setFixedHeight(HEATMAP_HEIGHT)
        self.setMinimumWidth(120)
        self.setMouseTracking(True)
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent)
        self.map: ExpertMap | None = None
        self._places = np.zeros((0, 0), dtype=np.uint8)
        self._uses = np.zeros((0, 0), dtype=np.float64)
        self._dark = False
        self._background = QColor("#ffffff")
        self._foreground = QColor("#424a53")
        self._cache: QPixmap | None = None
        self._grid = QRectF()  # where the cells are, in widget coordinates
        self.hover: tuple[int, int] | None = None  # (row, expert) under the mouse
        self.renders = 0

    # Data -------------------------------------------------------------------
    def set_map(self, expert_map: ExpertMap | None) -> None:
        if expert_map == self.map:
            return
        self.map = expert_map
        self.hover = None
        if expert_map is None:
            self._places = np.zeros((0, 0), dtype=np.uint8)
            self._uses = np.zeros((0, 0), dtype=np.float64)
        else:
            shape = (len(expert_map.blocks), expert_map.num_experts)
            self._places = np.frombuffer(expert_map.places, dtype=np.uint8).reshape(shape)
            self._uses = np.asarray(expert_map.uses, dtype=np.float64).reshape(shape)
        self._invalidate()

    def set_colors(self, dark: bool, background: str, foreground: str) -> None:
        self._dark = dark
        self._background, self._foreground = QColor(background), QColor(foreground)
        self._invalidate()

    def counts(self) -> dict[int, int]:
        """How many experts sit in each place (PLACE_* -> count)."""
        return {place: int((self._places == place).sum()) for place in (PLACE_DEVICE, PLACE_RAM, PLACE_SSD)}

    def _invalidate(self) -> None:
        self._cache = None
        self.update()

    # Hover ------------------------------------------------------------------
    def cell_at(self, pos: QPointF) -> tuple[int, int] | None:
        """(row, expert) under a point in widget coordinates, or None."""
        rows, cols = self._places.shape
        grid = self._grid
        if not rows or not cols or not grid.contains(pos):
            return None
        row = min(rows - 1, int((pos.y() - grid.top()) / grid.height() * rows))
        col = min(cols - 1, int((pos.x() - grid.left()) / grid.width() * cols))
        return row, col

    def describe(self, row: int, expert: int) -> str:
        """The hover read-out of one cell."""
        assert self.map is not None
        place = place_name(int(self._places[row, expert]), self.map.device)
        return (f"Layer blk.{self.map.blocks[row]} · expert {expert}\n{place} · "
                f"recent uses {self._uses[row, expert]:.1f}")

    def mouseMoveEvent(self, event) -> None:  # noqa: N802 - Qt naming
        cell = self.cell_at(event.position())
        if cell != self.hover:
            self.hover = cell
            self.update()
        if cell is None:
            QToolTip.hideText()
        else:
            QToolTip.showText(event.globalPosition().toPoint(), self.describe(*cell), self)

    def leaveEvent(self, event) -> None:  # noqa: N802 - Qt naming
        self.hover = None
        QToolTip.hideText()
        self.update()
        super().leaveEvent(event)

    # Painting ---------------------------------------------------------------
    def paintEvent(self, event) -> None:  # noqa: N802 - Qt naming
        if self._cache is None or self._cache.size() != self._pixel_size():
            self._cache = self._render()
        painter = QPainter(self)
        painter.drawPixmap(0, 0, self._cache)
        rows, cols = self._places.shape
        if self.hover is not None and rows and cols:
            grid = self._grid
            w, h = grid.width() / cols, grid.height() / rows
            painter.setPen(QPen(self._foreground, 1.5))
            painter.drawRect(QRectF(grid.left() + self.hover[1] * w, grid.top() + self.hover[0] * h, w, h))
        painter.end()

    def _pixel_size(self) -> QSize:
        ratio = self.devicePixelRatioF()
        return QSize(max(1, round(self.width() * ratio)), max(1, round(self.height() * ratio)))

    def _render(self) -> QPixmap:
        ratio = self.devicePixelRatioF()
        pixmap = QPixmap(self._pixel_size())
        pixmap.setDevicePixelRatio(ratio)
        pixmap.fill(self._background)
        width, height = self.width(), self.height()
        painter = QPainter(pixmap)
        font = painter.font()
        font.setPointSizeF(max(7.0, font.pointSizeF() * 0.85))
        painter.setFont(font)
        metrics = painter.fontMetrics()
        line = metrics.height()
        painter.setPen(self._foreground)
        rows, cols = self._places.shape
        if not rows or self.map is None:
            painter.drawText(QRectF(0, 0, width, height), Qt.AlignmentFlag.AlignCenter,
                             "No expert cache: this model's experts\nare all in memory (no Expert Pack).")
            painter.end()
            self._grid = QRectF()
            return pixmap
        self.renders += 1
        first, last = f"blk.{self.map.blocks[0]}", f"blk.{self.map.blocks[-1]}"
        left = max(metrics.horizontalAdvance(first), metrics.horizontalAdvance(last)) + 6
        legend_h = line + 6
        top, bottom, right = line + 2, height - legend_h - line - 2, width - 4
        self._grid = QRectF(QPointF(left, top), QPointF(right, bottom))
        # Axis captions and ticks (units: layers down, experts across).
        painter.drawText(QRectF(0, 0, width, line), Qt.AlignmentFlag.AlignLeft, "Layer ↓   Expert →")
        align_right = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
        painter.drawText(QRectF(0, top, left - 4, line), align_right, first)
        painter.drawText(QRectF(0, bottom - line, left - 4, line), align_right, last)
        painter.drawText(QRectF(left, bottom + 1, 40, line), Qt.AlignmentFlag.AlignLeft, "0")
        painter.drawText(QRectF(right - 60, bottom + 1, 60, line), Qt.AlignmentFlag.AlignRight, str(cols - 1))
        # The cells: one pixel per expert, scaled up without smoothing.
        pixels = np.ascontiguousarray(cell_colors(self._places, self._uses, self._dark, self._background))
        image = QImage(pixels.data, cols, rows, cols * 4, QImage.Format.Format_ARGB32)
        painter.drawImage(self._grid, image)
        # Legend: the three places with how many experts sit in each.
        counts = self.counts()
        x = 0.0
        y = height - legend_h + 3
        for place in (PLACE_DEVICE, PLACE_RAM, PLACE_SSD):
            painter.fillRect(QRectF(x, y + 2, line - 4, line - 4), QColor(PLACE_COLORS[self._dark][place]))
            text = f"{place_name(place, self.map.device)} {counts[place]:,}"
            painter.drawText(QRectF(x + line, y, width, line), Qt.AlignmentFlag.AlignLeft, text)
            x += line + metrics.horizontalAdvance(text) + 12
        self.legend_width = x
        painter.end()
        return pixmap

    def grid_rect(self) -> QRect:
        """Where the cells are drawn (tests)."""
        return self._grid.toAlignedRect()
