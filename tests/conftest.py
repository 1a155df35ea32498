"""Test-wide settings: headless Qt and single-threaded torch (2-core CI machines)."""

import os

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import torch  # noqa: E402

from app.gui.qt_compat import protect_none_refcount  # noqa: E402  (imports no Qt)

torch.set_num_threads(1)
# PySide6 6.12 on Python < 3.12 drops references to None/True/False in Qt callbacks;
# the app applies this at start-up, and every Qt test in the suite needs it too.
protect_none_refcount()


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory):
    """One EXPERTDESK_HOME for the whole test session: the demo pack is built once and shared."""
    home = tmp_path_factory.getbasetemp() / "expertdesk-home"
    previous = os.environ.get("EXPERTDESK_HOME")
    os.environ["EXPERTDESK_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("EXPERTDESK_HOME", None)
    else:
        os.environ["EXPERTDESK_HOME"] = previous
