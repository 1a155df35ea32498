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


# Where ExpertDesk keeps things for a user, and the variables that move each of them.
_USER_DIRS = {
    "EXPERTDESK_HOME": "expertdesk-home",  # the demo build (else the user cache dir)
    "EXPERTDESK_DATA_DIR": "expertdesk-data",  # history.sqlite3
    "EXPERTDESK_CONFIG_DIR": "expertdesk-config",  # settings.json, models.json
    "EXPERTDESK_LOG_DIR": "expertdesk-logs",  # expertdesk.log
    # platformdirs' own defaults too, for anything that asks it directly.
    "XDG_CACHE_HOME": "xdg-cache", "XDG_DATA_HOME": "xdg-data", "XDG_CONFIG_HOME": "xdg-config",
    "XDG_STATE_HOME": "xdg-state",
}


def _real_user_folders() -> list[str]:
    """The folders the app would write for this user outside the tests (platformdirs)."""
    import platformdirs

    return [platformdirs.user_cache_dir("ExpertDesk", appauthor=False),
            platformdirs.user_data_dir("ExpertDesk", "ExpertDesk"),
            platformdirs.user_config_dir("ExpertDesk", "ExpertDesk"),
            platformdirs.user_log_dir("ExpertDesk", "ExpertDesk")]


@pytest.fixture(scope="session", autouse=True)
def user_folders(tmp_path_factory):
    """Every test, and every `expertdesk` subprocess a test starts, uses temporary folders
    for the demo build, history, settings and logs; the session fails if it created any of
    the user's real ones."""
    real = [path for path in _real_user_folders() if not os.path.exists(path)]
    base = tmp_path_factory.getbasetemp()
    with contextlib.ExitStack() as stack:
        for name, folder in _USER_DIRS.items():
            stack.enter_context(_session_env(name, str(base / folder)))
        yield base
    created = [path for path in real if os.path.exists(path)]
    assert not created, f"the test session wrote into the user's real folders: {created}"


@pytest.fixture(scope="session")
def log_dir(user_folders):
    """The session's EXPERTDESK_LOG_DIR."""
    return user_folders / _USER_DIRS["EXPERTDESK_LOG_DIR"]


@pytest.fixture(scope="session")
def demo_home(user_folders):
    """The session's EXPERTDESK_HOME: the demo pack is built once and shared."""
    return user_folders / _USER_DIRS["EXPERTDESK_HOME"]
