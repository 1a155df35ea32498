"""A one-line label that ends in "…" when it is narrower than its text, with the whole text as tooltip.

Eliding happens when the text or the size changes (``setText``, ``resizeEvent``), never
in ``paintEvent``: the label paints as a plain QLabel, so a label updated several times
a second (telemetry counters) costs no Python call per repaint.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QWidget

MIN_WIDTH = 24  # a layout may shrink it to this; the text is elided to fit


class ElidedLabel(QLabel):
    """QLabel for plain one-line text; ``text()`` is the whole text, ``shown_text()`` what is drawn."""

    def __init__(self, text: str = "", parent: QWidget | None = None, *,
                 mode: Qt.TextElideMode = Qt.TextElideMode.ElideRight) -> None:
        super().__init__(parent)
        self._full = ""
        self._tip = ""
        self._mode = mode
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setMinimumWidth(MIN_WIDTH)  # minimumSize wins over the text's width in layouts
        self.setText(text)

    def setText(self, text: str) -> None:  # noqa: N802 - Qt naming
        if text != self._full:
            self._full = text
            self._elide()

    def text(self) -> str:
        return self._full

    def shown_text(self) -> str:
        return QLabel.text(self)

    def is_elided(self) -> bool:
        return self.shown_text() != self._full

    def setToolTip(self, tip: str) -> None:  # noqa: N802 - Qt naming
        self._tip = tip
        self._update_tip()

    def sizeHint(self):  # noqa: N802 - Qt naming
        hint = super().sizeHint()
        hint.setWidth(self.fontMetrics().horizontalAdvance(self._full) + self.contentsMargins().left()
                      + self.contentsMargins().right() + 2)
        return hint

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt naming
        super().resizeEvent(event)
        self._elide()

    def _elide(self) -> None:
        width = self.contentsRect().width()
        shown = self.fontMetrics().elidedText(self._full, self._mode, width) if width > 0 else self._full
        if shown != QLabel.text(self):
            QLabel.setText(self, shown)
        self._update_tip()

    def _update_tip(self) -> None:
        full = self._full if self.is_elided() else ""
        tip = "\n".join(t for t in (full, self._tip) if t)
        if super().toolTip() != tip:
            super().setToolTip(tip)
