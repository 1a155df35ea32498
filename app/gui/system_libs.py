"""Before the first window on Linux/X11: the system libraries Qt's xcb plugin needs.

PySide6's wheels bring Qt but not the X11 helper libraries its `xcb` platform plugin
loads; on a minimal desktop they are missing and Qt aborts with a message that names
the wrong one. `missing_xcb_libraries()` tries each library the plugin links against
and `install_hint()` says which packages provide the missing ones (Debian/Ubuntu and
Fedora names), so the app can say so before creating the window.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Mapping

# soname -> (Debian/Ubuntu package, Fedora package), as Qt 6's xcb plugin needs them.
XCB_LIBRARIES: dict[str, tuple[str, str]] = {
    "libxcb.so.1": ("libxcb1", "libxcb"),
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig"),
}


def uses_xcb(environ: Mapping[str, str] | None = None, platform: str | None = None) -> bool:
    """Whether Qt will pick its xcb plugin here: Linux, no other platform asked for, and
    an X display without a Wayland session (Qt prefers Wayland there)."""
    env = os.environ if environ is None else environ
    if (platform or sys.platform) != "linux":
        return False
    chosen = env.get("QT_QPA_PLATFORM", "").split(";")[0].strip().lower()
    if chosen:
        return chosen == "xcb"
    return bool(env.get("DISPLAY")) and not env.get("WAYLAND_DISPLAY")


def _loads(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def missing_xcb_libraries(loads: Callable[[str], bool] = _loads) -> list[str]:
    """The sonames of XCB_LIBRARIES that this system cannot load."""
    return [soname for soname in XCB_LIBRARIES if not loads(soname)]


def install_hint(missing: list[str]) -> str:
    """What to tell the user: the missing libraries and the commands that install them."""
    debian = sorted({XCB_LIBRARIES[s][0] for s in missing})
    fedora = sorted({XCB_LIBRARIES[s][1] for s in missing})
    return (
        "expertdesk: the desktop window needs system libraries that are not installed: "
        + ", ".join(missing) + ".\n"
        + "  Debian/Ubuntu: sudo apt install " + " ".join(debian) + "\n"
        + "  Fedora:        sudo dnf install " + " ".join(fedora) + "\n"
        + "Every command of `expertdesk --help` works without them (no window needed)."
    )
