"""`expertdesk --install-desktop-entry`: menu entry and icon for the current user (Linux)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from engine.resources import resource_path


def _data_home() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")


def _this_installations_command() -> str:
    """The `expertdesk` script of the environment this Python runs in (not whatever PATH finds)."""
    beside_python = Path(sys.executable).with_name("expertdesk")
    if beside_python.is_file():
        return str(beside_python)
    return shutil.which("expertdesk") or str(Path(sys.argv[0]).resolve())


def install_desktop_entry(executable: str | None = None, data_home: Path | None = None) -> list[Path]:
    """Write `expertdesk.desktop` and the icon under the XDG data dir; returns the files written.

    The entry's Exec line points at this installation's `expertdesk` so the menu starts
    the same environment the user installed, whatever PATH the desktop session has.
    """
    data_home = data_home or _data_home()
    executable = executable or _this_installations_command()
    template = resource_path("expertdesk.desktop").read_text(encoding="utf-8")
    lines = [f"Exec={executable}" if line.startswith("Exec=") else line for line in template.splitlines()]
    applications = data_home / "applications"
    icons = data_home / "icons" / "hicolor" / "scalable" / "apps"
    applications.mkdir(parents=True, exist_ok=True)
    icons.mkdir(parents=True, exist_ok=True)
    entry = applications / "expertdesk.desktop"
    entry.write_text("\n".join(lines) + "\n", encoding="utf-8")
    icon = icons / "expertdesk.svg"
    shutil.copyfile(resource_path("icons/expertdesk.svg"), icon)
    return [entry, icon]
