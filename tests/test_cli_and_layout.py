"""The command line, the package layout and the headless rule."""

import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def test_help_works_for_every_subcommand(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit) as top:
        main(["--help"])
    assert top.value.code == 0
    assert "expertdesk" in capsys.readouterr().out
    subparsers = [a for a in parser._actions if a.dest == "command"]
    for name in subparsers[0].choices if subparsers else []:
        with pytest.raises(SystemExit) as exc:
            main([name, "--help"])
        assert exc.value.code == 0, name
        assert name in capsys.readouterr().out


def test_python_dash_m_app_matches_console_script():
    result = subprocess.run(
        [sys.executable, "-m", "app", "--version"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("expertdesk ")


def test_engine_and_packer_never_import_qt():
    """Static contract (import-linter, see pyproject.toml) over every module."""
    result = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "pyproject.toml"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


def test_headless_import_of_every_engine_and_packer_module():
    """Importing all of engine/ and packer/ loads no Qt module at run time either."""
    code = (
        "import importlib, pkgutil, sys\n"
        "for pkg in ('engine', 'packer'):\n"
        "    mod = importlib.import_module(pkg)\n"
        "    for info in pkgutil.walk_packages(mod.__path__, pkg + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('PySide6', 'shiboken6', 'pyqtgraph', 'app'))\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_main_window_opens_offscreen(qtbot):
    from app.gui.main_window import MainWindow

    window = MainWindow()
    qtbot.addWidget(window)
    window.show()
    qtbot.waitExposed(window)
    assert "ExpertDesk" in window.windowTitle()
