"""Dark and light themes: a Fusion palette per theme, following the system unless overridden.

The system's choice comes from ``QStyleHints.colorScheme()`` (Qt 6.5+). We set our own
palettes instead of relying on the platform theme so that both themes look the same
on every OS (and under the offscreen platform the tests use), and so that the HTML in
the chat view (see ``markdown_render.HtmlColors``) matches the widgets around it.

On top of the palette, one application style sheet gives every screen the same
spacing, corner radius and type scale (``SPACE``, ``TYPE_SCALE``): buttons, fields,
lists, tool bar and dock titles, and labels marked ``role="heading"`` / ``"title"`` /
``"muted"`` / ``"small"`` (``set_role``). The main window sets it on itself, so its
dialogs get it too, and rebuilds it when the theme or the font size changes (style
sheets take absolute point sizes). Not on the QApplication: re-polishing every widget
of the application after a palette change crashed PySide6 6.12 with the wizard open.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication, QStyleFactory, QWidget

from app.gui import icons
from app.gui.markdown_render import DARK_COLORS, LIGHT_COLORS, HtmlColors

# Accent colours the widgets use outside the palette (status, errors, stats).
ERROR_COLOR = {False: "#cf222e", True: "#ff7b72"}
OK_COLOR = {False: "#1a7f37", True: "#3fb950"}
WARNING_COLOR = {False: "#9a6700", True: "#d29922"}
MUTED_COLOR = {False: LIGHT_COLORS.muted, True: DARK_COLORS.muted}

# Spacing in pixels, for margins and gaps: every layout takes one of these.
SPACE = {"xs": 4, "s": 8, "m": 12, "l": 16, "xl": 24}
# Text sizes relative to the body font (the user's font size in Preferences).
TYPE_SCALE = {"small": 0.88, "body": 1.0, "heading": 1.15, "title": 1.45}

_SURFACES = {  # colours the style sheet uses beyond the palette
    False: {"border": "#d0d7de", "hover": "#eaeef2", "pressed": "#d8dee4", "accent": "#0969da",
            "selected": "#ddf4ff", "button": "#f6f8fa", "base": "#ffffff", "text": "#1f2328"},
    True: {"border": "#3d444d", "hover": "#30363d", "pressed": "#3d444d", "accent": "#4493f8",
           "selected": "#1c2b41", "button": "#2d333b", "base": "#0d1117", "text": "#e6edf3"},
}


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
    icons.retheme(dark)
    return dark


def set_role(widget: QWidget, role: str) -> QWidget:
    """Mark a label (or any widget) as "title", "heading", "muted" or "small" text for the style sheet."""
    widget.setProperty("role", role)
    return widget


def style_sheet(dark: bool, points: float) -> str:
    """The application style sheet for a theme and a body font size in points."""
    c = _SURFACES[dark]
    muted = MUTED_COLOR[dark]
    s, m = SPACE["s"], SPACE["m"]

    def size(step: str) -> str:
        return f"{points * TYPE_SCALE[step]:.1f}pt"

    return f"""
        QPushButton {{ padding: 5px {m}px; border: 1px solid {c['border']}; border-radius: 6px;
                       background-color: {c['button']}; color: {c['text']}; min-height: 18px; }}
        QPushButton:hover {{ background-color: {c['hover']}; }}
        QPushButton:pressed {{ background-color: {c['pressed']}; }}
        QPushButton:default {{ border-color: {c['accent']}; }}
        QPushButton:disabled {{ color: {muted}; }}
        QLineEdit, QPlainTextEdit {{ border: 1px solid {c['border']}; border-radius: 6px; padding: 4px {s - 2}px;
                                     background-color: {c['base']}; }}
        QLineEdit:focus, QPlainTextEdit:focus {{ border-color: {c['accent']}; }}
        QToolBar {{ spacing: {SPACE['xs']}px; padding: {SPACE['xs']}px {s}px; border: none; }}
        QToolButton {{ padding: 4px 6px; border-radius: 6px; }}
        QToolButton:hover {{ background-color: {c['hover']}; }}
        QToolButton:checked {{ background-color: {c['selected']}; }}
        QListWidget#conversationList {{ border: none; background-color: transparent; }}
        QListWidget#conversationList::item {{ padding: 6px {s}px; border-radius: 6px; }}
        QListWidget#conversationList::item:selected {{ background-color: {c['selected']}; color: {c['text']}; }}
        QListWidget#conversationList::item:hover:!selected {{ background-color: {c['hover']}; }}
        QDockWidget {{ font-weight: 600; }}
        QDockWidget > QWidget {{ font-weight: normal; }}
        QStatusBar {{ border-top: 1px solid {c['border']}; }}
        QLabel[role="title"] {{ font-size: {size('title')}; font-weight: 600; }}
        QLabel[role="heading"] {{ font-size: {size('heading')}; font-weight: 600; }}
        QLabel[role="muted"] {{ color: {muted}; }}
        QLabel[role="small"] {{ font-size: {size('small')}; color: {muted}; }}
    """

