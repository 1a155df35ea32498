"""Start the Qt application and show the main window."""

from __future__ import annotations

import sys


def run_gui(argv: list[str] | None = None, quit_after_s: float | None = None, log_level: str | None = None) -> int:
    """Open the desktop window and run the Qt event loop until it closes.

    `quit_after_s` closes the window after that many seconds: installers and CI use it
    to prove the app starts on a machine without a screen. `log_level`: see
    `app.logging_setup.configure_logging` (None: $EXPERTDESK_LOG_LEVEL, else warning).
    """
    from app.logging_setup import configure_logging

    configure_logging(log_level)
    from app.gui.system_libs import install_hint, missing_xcb_libraries, uses_xcb

    if uses_xcb():
        missing = missing_xcb_libraries()
        if missing:  # Qt would fail to import or abort in QApplication, naming the wrong library
            print(install_hint(missing), file=sys.stderr)
            return 1
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
    from app.gui.qt_compat import protect_none_refcount

    protect_none_refcount()
    app = QApplication.instance() or QApplication(argv if argv is not None else sys.argv)
    app.setApplicationName("ExpertDesk")
    app.setOrganizationName("ExpertDesk")
    app.setDesktopFileName("expertdesk")  # Wayland/X11 match the window to the menu entry and its icon
    from app.gui.icons import app_icon

    app.setWindowIcon(app_icon())
    try:
        window = MainWindow()
    except Exception as exc:  # the window handles what it knows (history, engine); this is the last resort
        import logging

        logging.getLogger(__name__).exception("the window could not be opened")
        message = (f"ExpertDesk could not open its window: {exc}\n\nThe details are in the log "
                   "(expertdesk.log in the user log folder, or $EXPERTDESK_LOG_DIR). Please report this error.")
        print(f"expertdesk: {message}", file=sys.stderr)
        if quit_after_s is None and app.platformName() not in ("offscreen", "minimal"):
            from PySide6.QtWidgets import QMessageBox

            QMessageBox.critical(None, "ExpertDesk", message)
        return 1
    window.show()
    if quit_after_s is not None:
        from PySide6.QtCore import QTimer

        QTimer.singleShot(int(quit_after_s * 1000), window.close)
    return app.exec()
