"""The Linux installer, run for real into a fresh virtual environment.

It installs torch (the pinned CPU wheel, so nothing large is downloaded), the app from
this source tree as a regular (non-editable) install, and the desktop entry; then the
installed command must start headless.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALLER = ROOT / "installer" / "linux" / "install.sh"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux installer")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    base = tmp_path_factory.mktemp("install")
    env = {
        **os.environ,
        "EXPERTDESK_VENV": str(base / "venv"),
        "EXPERTDESK_TORCH": "torch==2.13.0",
        "XDG_DATA_HOME": str(base / "xdg"),
        "PYTHON": sys.executable,
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    result = subprocess.run(["bash", str(INSTALLER)], env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return base, env, result


def test_installer_reports_its_torch_choice_and_finishes(installed):
    _, _, result = installed
    assert "creating the environment" in result.stdout
    assert "done. Start ExpertDesk" in result.stdout


def test_installed_command_starts(installed):
    base, env, _ = installed
    exe = base / "venv" / "bin" / "expertdesk"
    help_out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert help_out.returncode == 0 and "expertdesk" in help_out.stdout
    smoke = subprocess.run(
        [str(exe), "--quit-after", "1"],
        env={**env, "QT_QPA_PLATFORM": "offscreen"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert smoke.returncode == 0, smoke.stderr[-3000:]


def test_desktop_entry_points_at_the_installed_command(installed):
    base, _, _ = installed
    entry = base / "xdg" / "applications" / "expertdesk.desktop"
    icon = base / "xdg" / "icons" / "hicolor" / "scalable" / "apps" / "expertdesk.svg"
    text = entry.read_text()
    assert f"Exec={base / 'venv' / 'bin' / 'expertdesk'}" in text
    assert "Icon=expertdesk" in text
    assert icon.read_bytes().startswith(b"<?xml")


def test_bundled_files_are_installed_with_a_regular_install(installed):
    base, _, _ = installed
    share = base / "venv" / "share" / "expertdesk"
    assert (share / "icons" / "expertdesk.svg").is_file()
    assert (share / "expertdesk.desktop").is_file()
    assert (share / "demo" / "expertdesk-demo.npz").is_file()
