"""Test-wide settings: headless Qt and single-threaded torch (2-core CI machines)."""

import contextlib
import os

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import torch  # noqa: E402

from app.gui.qt_compat import protect_none_refcount  # noqa: E402  (imports no Qt)

torch.set_num_threads(1)
# PySide6 6.12 on Python < 3.12 drops references to None/True/False in Qt callbacks;
# the app applies this at start-up, and every Qt test in the suite needs it too.
protect_none_refcount()


@contextlib.contextmanager
def _session_env(name: str, value: str):
    """Environment variable `name` set to `value` inside `with`, then put back as it was."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


@pytest.fixture(scope="session", autouse=True)
def log_dir(tmp_path_factory):
    """EXPERTDESK_LOG_DIR for the session: the log files of in-process and subprocess
    `expertdesk` runs go to a temporary folder, never the user's log directory."""
    path = tmp_path_factory.getbasetemp() / "expertdesk-logs"
    with _session_env("EXPERTDESK_LOG_DIR", str(path)):
        yield path


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory):
    """One EXPERTDESK_HOME for the whole test session: the demo pack is built once and shared."""
    home = tmp_path_factory.getbasetemp() / "expertdesk-home"
    with _session_env("EXPERTDESK_HOME", str(home)):
        yield home
