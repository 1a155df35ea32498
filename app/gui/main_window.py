"""The main window. For now a welcome screen; the chat window replaces its body."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QMainWindow, QVBoxLayout, QWidget

from app import __version__

WELCOME_TEXT = (
    "<h2>ExpertDesk</h2>"
    "<p>Run DeepSeek-V4-Flash and Kimi-K3 on one PC: routed experts stream from an "
    "Expert Pack on your SSD into a GPU cache, and every selected expert runs.</p>"
    "<p>The chat window is being built. Today the command line packs and checks models: "
    "run <code>expertdesk --help</code>.</p>"
)


class MainWindow(QMainWindow):
    """Top-level window of the app."""

    def __init__(self) -> None:
        super().__init__()
        self.setWindowTitle(f"ExpertDesk {__version__}")
        self.resize(960, 640)
        body = QWidget(self)
        layout = QVBoxLayout(body)
        welcome = QLabel(WELCOME_TEXT, body)
        welcome.setObjectName("welcome")
        welcome.setWordWrap(True)
        welcome.setTextFormat(Qt.TextFormat.RichText)
        welcome.setAlignment(Qt.AlignmentFlag.AlignCenter)
        welcome.setAccessibleName("Welcome")
        layout.addWidget(welcome)
        self.setCentralWidget(body)
