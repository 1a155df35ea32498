"""Start the Qt application and show the main window."""

from __future__ import annotations

import sys


def run_gui(argv: list[str] | None = None) -> int:
    """Open the desktop window and run the Qt event loop until it closes."""
    try:
        from PySide6.QtWidgets import QApplication
    except ImportError as exc:  # pragma: no cover - depends on the installation
        print(
            f"expertdesk: the desktop app needs PySide6, which failed to import ({exc}).\n"
            "Install it with: pip install PySide6-Essentials\n"
            "Every subcommand (see `expertdesk --help`) works without it.",
            file=sys.stderr,
        )
        return 1
    from app.gui.main_window import MainWindow

    app = QApplication.instance() or QApplication(argv if argv is not None else sys.argv)
    app.setApplicationName("ExpertDesk")
    app.setOrganizationName("ExpertDesk")
    window = MainWindow()
    window.show()
    return app.exec()
