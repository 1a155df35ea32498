"""kill -9 in the middle of a reply loses nothing the window already showed.

A child process opens the real window on the demo model, sends a message and reports
every reply flush after it was saved and rendered; the test SIGKILLs it mid-reply and
opens the history database it left behind.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.history import HistoryStore

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL (POSIX)")
def test_sigkill_mid_reply_keeps_everything_shown(tmp_path, demo_home):
    data_dir = tmp_path / "data"
    env = dict(os.environ, EXPERTDESK_CONFIG_DIR=str(tmp_path / "config"), EXPERTDESK_HOME=str(demo_home),
               QT_QPA_PLATFORM="offscreen", PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
    child = subprocess.Popen([sys.executable, str(HERE / "gui_helpers.py"), str(data_dir), "1500"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    reports = []
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            reports.append(json.loads(line))
            shown = [r for r in reports if "shown" in r]
            if len(shown) >= 4 and (shown[-1]["shown"] or shown[-1]["reasoning"]):
                os.kill(child.pid, signal.SIGKILL)  # mid-reply: 1500 tokens take far longer than 4 flushes
                break
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(30)
        stderr = child.stderr.read()
    assert child.returncode == -signal.SIGKILL, f"the child ended on its own (rc {child.returncode}):\n{stderr}"
    sent = next(r["sent"] for r in reports if "sent" in r)
    last = [r for r in reports if "shown" in r][-1]

    db_path = data_dir / "history.sqlite3"
    raw = sqlite3.connect(db_path)
    assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    raw.close()
    history = HistoryStore(db_path)  # opens (and recovers the WAL) like the app's next start would
    try:
        (conversation,) = history.conversations()
        user, reply = history.messages(conversation.id)
        assert (user.role, user.content, user.status) == ("user", sent, "finished")
        assert reply.role == "assistant" and reply.status == "streaming"  # never marked finished
        # Everything on screen at the kill is stored (a flush saved after the report may add more).
        assert reply.content.startswith(last["shown"]) and reply.reasoning.startswith(last["reasoning"])
        assert len(reply.content) + len(reply.reasoning) > 0
    finally:
        history.close()
