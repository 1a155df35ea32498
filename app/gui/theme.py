"""Dark and light themes: a Fusion palette per theme, following the system unless overridden.

The system's choice comes from ``QStyleHints.colorScheme()`` (Qt 6.5+). We set our own
palettes instead of relying on the platform theme so that both themes look the same
on every OS (and under the offscreen platform the tests use), and so that the HTML in
the chat view (see ``markdown_render.HtmlColors``) matches the widgets around it.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication, QStyleFactory

from app.gui.markdown_render import DARK_COLORS, LIGHT_COLORS, HtmlColors

# Accent colours the widgets use outside the palette (status, errors, stats).
ERROR_COLOR = {False: "#cf222e", True: "#ff7b72"}
OK_COLOR = {False: "#1a7f37", True: "#3fb950"}
WARNING_COLOR = {False: "#9a6700", True: "#d29922"}
MUTED_COLOR = {False: LIGHT_COLORS.muted, True: DARK_COLORS.muted}


def system_prefers_dark() -> bool:
    """True when the OS asks for a dark appearance."""
    hints = QGuiApplication.styleHints()
    return hints is not None and hints.colorScheme() == Qt.ColorScheme.Dark


def resolve_dark(theme: str) -> bool:
    """Whether the setting "system" / "light" / "dark" means dark right now."""
    return theme == "dark" or (theme == "system" and system_prefers_dark())


def html_colors(dark: bool) -> HtmlColors:
    return DARK_COLORS if dark else LIGHT_COLORS


def _palette(dark: bool) -> QPalette:
    roles = QPalette.ColorRole
    if dark:
        colors = {
            roles.Window: "#1e2228", roles.WindowText: "#e6edf3", roles.Base: "#0d1117",
            roles.AlternateBase: "#161b22", roles.Text: "#e6edf3", roles.Button: "#2d333b",
            roles.ButtonText: "#e6edf3", roles.Highlight: "#1f6feb", roles.HighlightedText: "#ffffff",
            roles.ToolTipBase: "#2d333b", roles.ToolTipText: "#e6edf3", roles.PlaceholderText: "#7d8590",
            roles.Link: "#4493f8", roles.BrightText: "#ff7b72", roles.Mid: "#3d444d", roles.Dark: "#010409",
            roles.Light: "#3d444d", roles.Midlight: "#30363d", roles.Shadow: "#000000",
        }
        disabled = "#6e7681"
    else:
        colors = {
            roles.Window: "#f3f4f6", roles.WindowText: "#1f2328", roles.Base: "#ffffff",
            roles.AlternateBase: "#f6f8fa", roles.Text: "#1f2328", roles.Button: "#f6f8fa",
            roles.ButtonText: "#1f2328", roles.Highlight: "#0969da", roles.HighlightedText: "#ffffff",
            roles.ToolTipBase: "#ffffff", roles.ToolTipText: "#1f2328", roles.PlaceholderText: "#6e7781",
            roles.Link: "#0969da", roles.BrightText: "#cf222e", roles.Mid: "#d0d7de", roles.Dark: "#8c959f",
            roles.Light: "#ffffff", roles.Midlight: "#eaeef2", roles.Shadow: "#6e7781",
        }
        disabled = "#8c959f"
    palette = QPalette()
    for role, value in colors.items():
        palette.setColor(role, QColor(value))
    for role in (roles.WindowText, roles.Text, roles.ButtonText):
        palette.setColor(QPalette.ColorGroup.Disabled, role, QColor(disabled))
    return palette


def apply_theme(theme: str) -> bool:
    """Apply "system", "light" or "dark" to the whole application; returns True if the result is dark."""
    app = QApplication.instance()
    dark = resolve_dark(theme)
    if app is None:
        return dark
    if app.style().name().lower() != "fusion":
        fusion = QStyleFactory.create("Fusion")
        if fusion is not None:
            app.setStyle(fusion)
    app.setPalette(_palette(dark))
    return dark
