"""The message composer: a text box where Enter sends and Shift+Enter starts a new line."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QHBoxLayout, QPlainTextEdit, QPushButton, QSizePolicy, QVBoxLayout, QWidget

from app.gui import icons


class ComposerEdit(QPlainTextEdit):
    """Plain-text input: Enter or Ctrl+Enter emits ``sendRequested``; Shift+Enter inserts a newline."""

    sendRequested = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt naming
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
                return
            self.sendRequested.emit()
            return
        super().keyPressEvent(event)


class Composer(QWidget):
    """Input box plus a Send button that turns into Stop while a reply is generated."""

    sendRequested = Signal(str)
    stopRequested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.edit = ComposerEdit(self)
        self.edit.setObjectName("composer")
        self.edit.setAccessibleName("Message")
        self.edit.setPlaceholderText("Message the model…  (Enter sends, Shift+Enter for a new line)")
        self.edit.setTabChangesFocus(True)
        self.edit.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.edit.document().contentsChanged.connect(self._fit_height)
        self.edit.sendRequested.connect(self.request_send)
        self.send_button = QPushButton("Send", self)
        self.send_button.setAccessibleName("Send message")
        self.send_button.setToolTip("Send (Enter or Ctrl+Enter)")
        self.send_button.clicked.connect(self.request_send)
        icons.bind(self.send_button, "send")
        self.stop_button = QPushButton("Stop", self)
        self.stop_button.setAccessibleName("Stop generating")
        self.stop_button.setToolTip("Stop the reply (Esc)")
        self.stop_button.clicked.connect(self.stopRequested)
        icons.bind(self.stop_button, "stop")
        self.stop_button.setVisible(False)
        buttons = QVBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(16, 6, 16, 10)
        layout.addWidget(self.edit, 1)
        layout.addLayout(buttons)
        self._can_send = True
        self._fit_height()

    def text(self) -> str:
        return self.edit.toPlainText()

    def set_text(self, text: str) -> None:
        self.edit.setPlainText(text)

    def set_generating(self, generating: bool) -> None:
        """Swap Send for Stop while a reply is being written."""
        self.stop_button.setVisible(generating)
        self.send_button.setVisible(not generating)

    def set_can_send(self, can_send: bool, reason: str = "") -> None:
        """Allow or refuse sending (no model loaded yet); the reason shows as the button's tooltip."""
        self._can_send = can_send
        self.send_button.setEnabled(can_send)
        self.send_button.setToolTip("Send (Enter or Ctrl+Enter)" if can_send else reason)

    def request_send(self) -> None:
        """Emit ``sendRequested`` with the text, unless it is empty or sending is not possible now."""
        text = self.text().strip()
        if not text or not self._can_send or self.stop_button.isVisible():
            return
        self.sendRequested.emit(text)

    def _fit_height(self) -> None:
        # Grow with the text up to ~8 lines, then scroll inside.
        lines = max(2, min(8, int(self.edit.document().size().height())))
        line_height = self.edit.fontMetrics().lineSpacing()
        self.edit.setFixedHeight(lines * line_height + 2 * int(self.edit.document().documentMargin()) + 6)

    def changeEvent(self, event) -> None:  # noqa: N802 - Qt naming
        super().changeEvent(event)
        if event.type() == event.Type.FontChange:
            self._fit_height()
