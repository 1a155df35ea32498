"""The app's icons: line SVGs from resources/icons/, drawn in the theme's text colour.

The SVGs use ``stroke="currentColor"``; here that becomes the palette's text colour (a
muted one for disabled icons), rendered once per theme and size and cached. ``bind``
gives an action or a button its icon and remembers the pair, so that ``retheme``
(called by ``theme.apply_theme``) redraws every icon in the other theme's colour.
"""

from __future__ import annotations

import weakref
from functools import cache

from PySide6.QtCore import QByteArray, QRectF, Qt
from PySide6.QtGui import QAction, QIcon, QPainter, QPixmap
from PySide6.QtSvg import QSvgRenderer
from PySide6.QtWidgets import QAbstractButton

from engine.resources import resource_path

ICON_NAMES = (
    "add", "add-model", "connection", "copy", "delete", "export", "folder", "library", "new-chat", "open-file",
    "preferences", "quit", "regenerate", "rename", "search", "send", "server", "settings", "stop", "telemetry", "theme",
    "verify", "verify-full", "zoom-in", "zoom-out",
)
APP_ICON = "expertdesk"
_SIZES = (16, 20, 24, 32, 48)
_COLORS = {False: ("#424a53", "#afb8c1"), True: ("#c9d1d9", "#6e7681")}  # (normal, disabled) per dark

_bound: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_dark = False


@cache
def _svg(name: str) -> str:
    return resource_path(f"icons/{name}.svg").read_text(encoding="utf-8")


def _pixmap(svg: str, size: int, ratio: float = 2.0) -> QPixmap:
    """The SVG rendered at ``size`` logical pixels, sharp on screens up to ``ratio``."""
    pixmap = QPixmap(round(size * ratio), round(size * ratio))
    pixmap.setDevicePixelRatio(ratio)
    pixmap.fill(Qt.GlobalColor.transparent)
    painter = QPainter(pixmap)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    QSvgRenderer(QByteArray(svg.encode())).render(painter, QRectF(0, 0, size, size))
    painter.end()
    return pixmap


@cache
def icon(name: str, dark: bool | None = None) -> QIcon:
    """Icon ``name`` (one of ICON_NAMES) in the colours of the dark or light theme (default: the current one)."""
    if dark is None:
        return icon(name, _dark)
    if name not in ICON_NAMES:
        raise KeyError(f"no icon {name!r}; the icons are {', '.join(ICON_NAMES)}")
    normal, disabled = _COLORS[dark]
    result = QIcon()
    for size in _SIZES:
        result.addPixmap(_pixmap(_svg(name).replace("currentColor", normal), size), QIcon.Mode.Normal)
        result.addPixmap(_pixmap(_svg(name).replace("currentColor", disabled), size), QIcon.Mode.Disabled)
    return result


@cache
def app_icon() -> QIcon:
    """The ExpertDesk icon (window, task bar; the menu entry installs the same SVG)."""
    return QIcon(str(resource_path(f"icons/{APP_ICON}.svg")))


def bind(target: QAction | QAbstractButton, name: str) -> None:
    """Give ``target`` icon ``name`` now and again after every theme change."""
    _bound[target] = name
    target.setIcon(icon(name, _dark))


def retheme(dark: bool) -> None:
    """Redraw every bound icon for the dark or light theme."""
    global _dark
    if dark == _dark:
        return
    _dark = dark
    for target, name in list(_bound.items()):
        try:
            target.setIcon(icon(name, dark))
        except RuntimeError:  # its C++ object is gone (a closed dialog)
            _bound.pop(target, None)
