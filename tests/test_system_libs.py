"""The desktop app names the missing X11 libraries, and their packages, before Qt aborts."""

from __future__ import annotations

import pytest

from app.gui import system_libs
from app.gui.launch import run_gui


@pytest.mark.parametrize(("env", "platform", "expected"), [
    ({"DISPLAY": ":0"}, "linux", True),
    ({"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"}, "linux", False),
    ({"DISPLAY": ":0", "QT_QPA_PLATFORM": "offscreen"}, "linux", False),
    ({"QT_QPA_PLATFORM": "xcb"}, "linux", True),
    ({"DISPLAY": ":0"}, "darwin", False),
    ({}, "linux", False),
])
def test_uses_xcb(env, platform, expected):
    assert system_libs.uses_xcb(env, platform) is expected


def test_missing_libraries_and_their_packages():
    absent = {"libxcb-cursor.so.0", "libxcb-icccm.so.4", "libxkbcommon-x11.so.0"}
    missing = system_libs.missing_xcb_libraries(lambda soname: soname not in absent)
    assert set(missing) == absent
    hint = system_libs.install_hint(missing)
    assert "sudo apt install libxcb-cursor0 libxcb-icccm4 libxkbcommon-x11-0" in hint
    assert "sudo dnf install libxkbcommon-x11 xcb-util-cursor xcb-util-wm" in hint
    assert system_libs.missing_xcb_libraries(lambda soname: True) == []


def test_the_app_says_what_to_install_instead_of_crashing(monkeypatch, capsys):
    monkeypatch.setattr(system_libs, "uses_xcb", lambda: True)
    monkeypatch.setattr(system_libs, "missing_xcb_libraries", lambda: ["libxcb-cursor.so.0"])
    assert run_gui(quit_after_s=0.1) == 1
    err = capsys.readouterr().err
    assert "libxcb-cursor.so.0" in err and "apt install libxcb-cursor0" in err and "dnf install xcb-util-cursor" in err
