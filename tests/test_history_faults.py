"""History faults: a reply is never lost, and a broken history never takes the window down.

- a database locked by another program during a reply (the reply stays in memory, is
  saved when the lock goes, the user is told, the GUI thread never waits on the lock);
- an unwritable data dir (the window opens, history in memory, a clear message);
- a damaged database file (moved to a backup, a new one started, readable rows kept);
- a malformed stats JSON in one row (that row without stats, the rest intact);
- a 10 MB message (a capped preview, "Show all" on demand, fast start-up).

The GUI tests run the real window offscreen on the scripted engine (gui_helpers).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QApplication

import app.history as history
from app.history import HistoryStore, default_history_path, format_stats
from gui_helpers import gui_env, open_window, scripted_factory, send_and_wait  # noqa: F401 (fixtures)

REPLY_250 = ("Every piece of this reply has to reach the history database, even while another program "
             "holds its lock: it waits in memory and is written as soon as the lock is gone. ") * 2
REPLY_250 = REPLY_250[:250]
STATS = {"completion_tokens": 40, "ttft_s": 0.25, "decode_tok_s": 12.5, "stop_reason": "eos", "hit_rate": 0.875}


def _lock(path: Path) -> sqlite3.Connection:
    """Another program's connection holding the write lock (BEGIN EXCLUSIVE) until ROLLBACK."""
    locker = sqlite3.connect(path, isolation_level=None, timeout=0)
    locker.execute("BEGIN EXCLUSIVE")
    return locker


@contextlib.contextmanager
def _tick_gaps() -> Iterator[list[float]]:
    """The gaps between the ticks of a 10 ms timer while the event loop runs inside the block."""
    gaps: list[float] = []
    last = [time.perf_counter()]

    def tick() -> None:
        now = time.perf_counter()
        gaps.append(now - last[0])
        last[0] = now

    timer = QTimer()
    timer.setInterval(10)
    timer.timeout.connect(tick)
    timer.start()
    try:
        yield gaps
    finally:
        timer.stop()


def _event_loop_gaps(qtbot, seconds: float) -> list[float]:
    """The gaps between the ticks of a 10 ms timer while the event loop runs for `seconds`."""
    with _tick_gaps() as gaps:
        qtbot.wait(int(seconds * 1000))
    return gaps


def _reply_rows(path: Path) -> list[tuple]:
    raw = sqlite3.connect(path)
    try:
        return raw.execute(
            "SELECT content, status, stats FROM messages WHERE role = 'assistant' ORDER BY id").fetchall()
    finally:
        raw.close()


# A locked database ------------------------------------------------------------------------
def test_a_locked_store_fails_fast_with_a_typed_error(tmp_path):
    path = tmp_path / "h.sqlite3"
    store = HistoryStore(path, busy_timeout_s=0)
    conversation = store.create_conversation()
    reply = store.add_message(conversation.id, "assistant", "", status="streaming")
    locker = _lock(path)
    try:
        start = time.perf_counter()
        with pytest.raises(history.HistoryLocked, match="locked"):
            store.update_message(reply.id, content="text")
        assert time.perf_counter() - start < 0.1  # no busy wait on the caller's thread
        assert not store._db.in_transaction  # nothing left half-open
        assert store.message(reply.id).content == ""  # reads still work (WAL)
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    store.update_message(reply.id, content="text")
    assert store.message(reply.id).content == "text"
    store.close()


def test_locked_database_mid_reply_keeps_the_reply_and_saves_it_when_the_lock_goes(qtbot, open_window):
    window = open_window(service_factory=scripted_factory(reply=REPLY_250, reasoning="", token_delay_s=0.01))
    path = window.history.path
    lockers: list[sqlite3.Connection] = []

    def lock_after_the_first_flush(*_args) -> None:
        if not lockers:
            lockers.append(_lock(path))

    window.bridge.textArrived.connect(lock_after_the_first_flush)  # runs after the controller saved flush 1
    window.composer.set_text("write 250 characters")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    try:
        # The engine finishes while the database is locked: the controller is not stuck.
        qtbot.waitUntil(lambda: bool(lockers) and not window.controller.busy, timeout=15_000)
        # Retrying never blocks the GUI thread.
        gaps = _event_loop_gaps(qtbot, 0.8)
        assert len(gaps) > 20 and max(gaps) < 0.100, f"longest stall {max(gaps) * 1000:.0f} ms"
        banner = window.history_banner
        assert banner.isVisible()
        assert "locked" in banner.text() and "kept in memory" in banner.text()
        assert window.controller.unsaved_count() >= 1
        (content, status, _stats), = lockers[0].execute(
            "SELECT content, status, stats FROM messages WHERE role = 'assistant'").fetchall()
        assert status == "streaming" and len(content) < len(REPLY_250)
        widget = window.chat_view.widgets[-1]
        assert widget.content == content  # the screen shows only what is saved
        with qtbot.waitSignal(window.controller.replyFinished, timeout=10_000):
            lockers[0].execute("ROLLBACK")  # the other program lets go
    finally:
        for locker in lockers:
            if locker.in_transaction:
                locker.execute("ROLLBACK")
            locker.close()
    (content, status, stats), = _reply_rows(path)
    assert content == REPLY_250 and status == "finished" and json.loads(stats)["stop_reason"] == "eos"
    assert widget.content == REPLY_250 and "tokens" in widget.stats_text
    assert window.controller.unsaved_count() == 0
    qtbot.waitUntil(lambda: not window.history_banner.isVisible(), timeout=5000)
    # The window carries on as usual.
    send_and_wait(qtbot, window, "and once more", timeout_ms=10_000)
    assert [r[1] for r in _reply_rows(path)] == ["finished", "finished"]


def test_sending_while_the_database_is_locked_keeps_the_text_and_says_why(qtbot, open_window):
    window = open_window(service_factory=scripted_factory(token_delay_s=0.0))
    send_and_wait(qtbot, window, "first", timeout_ms=10_000)
    locker = _lock(window.history.path)
    try:
        window.composer.set_text("second")
        start = time.perf_counter()
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
        assert time.perf_counter() - start < 0.5
        assert window.composer.text() == "second" and not window.controller.busy
        assert "locked" in window.notice_label.text() + window.history_banner.text()
        assert "second" not in [w.content for w in window.chat_view.widgets]  # not shown: not saved
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    send_and_wait(qtbot, window, "second", timeout_ms=10_000)
    assert [m.content for m in window.history.messages(window.controller.current_id) if m.role == "user"] == [
        "first", "second"]


def test_closing_while_locked_writes_the_unsaved_reply_to_a_recovery_file(qtbot, open_window, monkeypatch):
    import app.gui.chat_controller as chat_controller

    monkeypatch.setattr(chat_controller, "SHUTDOWN_SAVE_WAIT_S", 0.2)
    window = open_window(service_factory=scripted_factory(reply=REPLY_250, reasoning="", token_delay_s=0.005))
    path = window.history.path
    window.composer.set_text("hello")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: window.controller.active is not None and window.controller.active.flushes >= 1)
    locker = _lock(path)
    try:
        qtbot.waitUntil(lambda: not window.controller.busy, timeout=10_000)
        window.close()
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    (recovery,) = path.parent.glob("unsaved-replies-*.json")
    data = json.loads(recovery.read_text(encoding="utf-8"))
    assert any(item.get("content") == REPLY_250 for item in data["messages"])


# An unwritable data dir -------------------------------------------------------------------
def test_unwritable_data_dir_opens_the_window_with_history_in_memory(qtbot, open_window, gui_env, monkeypatch):
    blocker = gui_env / "a-file"
    blocker.write_text("a regular file where a folder should be")
    data_dir = blocker / "data"  # no one, not even root, can create a folder under a file
    monkeypatch.setenv("EXPERTDESK_DATA_DIR", str(data_dir))
    window = open_window(service_factory=scripted_factory(token_delay_s=0.0))  # waits for the autoload too
    assert window.history.in_memory
    banner = window.history_banner
    assert banner.isVisible() and str(data_dir) in banner.text()
    assert "memory" in banner.text() and "EXPERTDESK_DATA_DIR" in banner.text()
    send_and_wait(qtbot, window, "kept for this session", timeout_ms=10_000)
    assert [m.role for m in window.history.messages(window.controller.current_id)] == ["user", "assistant"]
    assert banner.isVisible()  # still said after a reply


def test_unwritable_history_file_is_shown_read_only(tmp_path, monkeypatch):
    path = tmp_path / "history.sqlite3"
    store = HistoryStore(path)
    conversation = store.create_conversation("Earlier chat")
    store.add_message(conversation.id, "user", "kept on disk")
    store.close()
    before = path.read_bytes()
    real_connect = history._connect

    def refuse_writes(target, timeout, **kwargs):
        if str(target) == str(path):  # what a read-only file or folder gives a non-root user
            raise sqlite3.OperationalError("attempt to write a readonly database")
        return real_connect(target, timeout, **kwargs)

    monkeypatch.setattr(history, "_connect", refuse_writes)
    opened = history.open_history(path)
    assert opened.state == "read-only" and "read-only" in opened.message and str(path) in opened.message
    assert opened.store.in_memory
    assert [c.title for c in opened.store.conversations()] == ["Earlier chat"]
    new = opened.store.create_conversation()  # this session's chats live in memory
    opened.store.add_message(new.id, "user", "only in memory")
    opened.store.close()
    assert path.read_bytes() == before  # the file itself is never touched


# A damaged database -----------------------------------------------------------------------
def _seed_many(path: Path, conversations: int = 4, messages: int = 40) -> None:
    store = HistoryStore(path)
    for c in range(conversations):
        conversation = store.create_conversation(f"Chat {c}")
        for m in range(messages):
            store.add_message(conversation.id, "user" if m % 2 == 0 else "assistant", f"chat {c} message {m} " * 40)
    store.close()


def _corrupt_page(path: Path, table: str) -> int:
    """Overwrite the root page of `table` with garbage; returns the page number."""
    raw = sqlite3.connect(path)
    page_size = raw.execute("PRAGMA page_size").fetchone()[0]
    (root,) = raw.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()
    raw.close()
    with open(path, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(b"\xde\xad\xbe\xef" * (page_size // 4))
    return root


def test_damaged_database_is_moved_to_a_backup_and_a_new_one_started(tmp_path):
    path = tmp_path / "history.sqlite3"
    _seed_many(path)
    _corrupt_page(path, "messages")
    opened = history.open_history(path)
    assert opened.state == "recovered"
    assert opened.backup is not None and b"\xde\xad\xbe\xef" * 64 in opened.backup.read_bytes()
    assert "damaged" in opened.message and str(opened.backup) in opened.message
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    raw.close()
    # The conversation headers were readable and were copied over.
    assert sorted(c.title for c in opened.store.conversations()) == ["Chat 0", "Chat 1", "Chat 2", "Chat 3"]
    conversation = opened.store.create_conversation()
    opened.store.add_message(conversation.id, "user", "a new history works")
    opened.store.close()


def test_database_that_is_not_a_database_is_replaced(tmp_path):
    path = tmp_path / "history.sqlite3"
    path.write_bytes(b"this is not SQLite at all" * 400)
    opened = history.open_history(path)
    assert opened.state == "recovered" and opened.backup.read_bytes().startswith(b"this is not SQLite")
    assert opened.store.conversations() == []
    opened.store.close()


def test_damaged_database_opens_the_window_with_a_message(qtbot, open_window, gui_env):
    path = default_history_path()
    _seed_many(path)
    _corrupt_page(path, "messages")
    window = open_window(service_factory=scripted_factory(token_delay_s=0.0))
    banner = window.history_banner
    assert banner.isVisible() and "damaged" in banner.text() and "backup" in banner.text()
    assert not window.history.in_memory and window.history.path == path
    (backup,) = [p for p in path.parent.iterdir() if p.name.startswith("history.damaged-")
                 and p.suffix == ".sqlite3"]
    assert str(backup) in banner.text()
    send_and_wait(qtbot, window, "a fresh start", timeout_ms=10_000)
    assert window.history.messages(window.controller.current_id)[-1].status == "finished"


def test_damage_found_while_running_is_reported_and_repaired_at_the_next_start(qtbot, open_window, gui_env,
                                                                                monkeypatch):
    # A large history is not checked at every start: its damage shows only when a damaged page is read.
    monkeypatch.setattr(history, "QUICK_CHECK_MAX_BYTES", 0)
    path = default_history_path()
    store = HistoryStore(path)
    old = store.create_conversation("Old chat")
    for m in range(60):
        store.add_message(old.id, "user" if m % 2 == 0 else "assistant", f"old message {m} " * 60)
    new = store.create_conversation("New chat")
    store.add_message(new.id, "user", "the newest chat is intact")
    store.close()
    raw = sqlite3.connect(path)
    page_size = raw.execute("PRAGMA page_size").fetchone()[0]
    raw.close()
    with open(path, "r+b") as f:  # a leaf page in the middle of the old chat's messages
        f.seek(9 * page_size)
        f.write(b"\xde\xad\xbe\xef" * (page_size // 4))
    window = open_window(service_factory=scripted_factory(token_delay_s=0.0))
    assert window.controller.current_id == new.id and not window.history_banner.isVisible()
    window.conversation_list.select(old.id)  # reading its messages fails
    banner = window.history_banner
    assert banner.isVisible() and "damaged" in banner.text() and "restart" in banner.text()
    assert "cannot be shown" in window.notice_label.text()
    window.controller.new_chat()
    send_and_wait(qtbot, window, "still works", timeout_ms=10_000)  # a new chat still saves
    window.close()
    # The next start moves the file to a backup and copies over what can be read.
    opened = history.open_history(path)
    assert opened.state == "recovered" and opened.backup is not None
    titles = sorted(c.title for c in opened.store.conversations())
    assert titles == ["Old chat", "still works", "the newest chat is intact"]
    assert 0 < len(opened.store.messages(old.id)) < 60  # the rows on the damaged page are gone, not the rest
    assert not history.damaged_marker(path).exists()
    opened.store.close()


# A malformed stats JSON -----------------------------------------------------------------------
def test_malformed_stats_json_drops_only_that_rows_stats(tmp_path):
    path = tmp_path / "h.sqlite3"
    store = HistoryStore(path)
    conversation = store.create_conversation()
    store.add_message(conversation.id, "user", "q1")
    bad = store.add_message(conversation.id, "assistant", "a1", status="finished")
    store.update_message(bad.id, stats=STATS)
    store.add_message(conversation.id, "user", "q2")
    good = store.add_message(conversation.id, "assistant", "a2", status="finished")
    store.update_message(good.id, stats=STATS)
    odd = store.create_conversation("Odd settings")
    raw = sqlite3.connect(path)
    raw.execute("UPDATE messages SET stats = ? WHERE id = ?", ('{"completion_tokens": 40, "ttft', bad.id))
    raw.execute("UPDATE conversations SET settings = ? WHERE id = ?", ('{"temperature": "hot", "top_k": [1]}', odd.id))
    raw.commit()
    raw.close()
    messages = store.messages(conversation.id)
    assert [m.content for m in messages] == ["q1", "a1", "q2", "a2"]
    assert messages[1].stats is None and messages[3].stats == STATS
    settings = store.conversation(odd.id).settings
    assert settings.temperature == 0.7 and settings.top_k == 40  # wrong types take the defaults
    assert format_stats({"completion_tokens": "many", "ttft_s": "soon", "stop_reason": "eos"}) == "stop: eos"
    store.close()


def test_malformed_stats_json_shows_the_conversation_without_that_rows_stats(qtbot, open_window, gui_env):
    store = HistoryStore(default_history_path())
    conversation = store.create_conversation("Stats")
    ids = []
    for i in range(3):
        store.add_message(conversation.id, "user", f"question {i}")
        reply = store.add_message(conversation.id, "assistant", f"answer {i}", status="finished")
        store.update_message(reply.id, stats=STATS)
        ids.append(reply.id)
    store._db.execute("UPDATE messages SET stats = 'not json {' WHERE id = ?", (ids[1],))
    store.close()
    window = open_window(service_factory=scripted_factory())
    widgets = window.chat_view.widgets
    assert [w.content for w in widgets] == ["question 0", "answer 0", "question 1", "answer 1", "question 2",
                                            "answer 2"]
    assert not window.chat_view.widget_for(ids[1]).stats_label.isVisibleTo(window)
    assert "40 tokens" in window.chat_view.widget_for(ids[0]).stats_text
    assert "40 tokens" in window.chat_view.widget_for(ids[2]).stats_text


# A 10 MB message ------------------------------------------------------------------------------
def _big_text(size: int) -> str:
    lines, total, i = [], 0, 0
    while total < size:
        line = f"{i:07d} a log line with `code`, **bold** text and a [link](https://example.com/{i}).\n"
        lines.append(line)
        total += len(line)
        i += 1
    return "".join(lines)


def test_a_ten_megabyte_message_keeps_start_and_opening_fast(qtbot, open_window, gui_env):
    big = _big_text(10_000_000)
    store = HistoryStore(default_history_path())
    small = store.create_conversation("Small chat")
    store.add_message(small.id, "user", "hello")
    large = store.create_conversation("Big paste")
    store.add_message(large.id, "user", big)
    store.add_message(large.id, "assistant", "That is a long log.", status="finished")
    store.close()

    start = time.perf_counter()
    window = open_window(service_factory=scripted_factory(), wait_loaded=False)
    qtbot.waitExposed(window)
    QApplication.processEvents()
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"start-up took {elapsed:.1f} s"
    assert window.controller.current_id == large.id
    widget = window.chat_view.widgets[0]
    assert widget.truncated and widget.show_all_button.isVisible()
    assert "10.0 million characters" in widget.show_all_button.text()
    assert len(widget.body.toPlainText()) < 50_000

    start = time.perf_counter()
    window.conversation_list.select(small.id)
    window.conversation_list.select(large.id)
    QApplication.processEvents()
    assert time.perf_counter() - start < 2.0
    widget = window.chat_view.widgets[0]

    # "Show all" fills a plain-text view step by step: the event loop keeps ticking.
    qtbot.mouseClick(widget.show_all_button, Qt.MouseButton.LeftButton)
    with _tick_gaps() as gaps:
        qtbot.waitUntil(lambda: widget.full_view is not None and not widget.expanding, timeout=20_000)
    assert gaps and max(gaps) < 0.100, f"longest stall {max(gaps) * 1000:.0f} ms"
    assert widget.full_view.toPlainText() == big.rstrip("\n") or widget.full_view.toPlainText() == big
    qtbot.mouseClick(widget.copy_button, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == big  # Copy takes the whole message


def test_sending_a_huge_message_shows_a_preview_at_once(qtbot, open_window):
    window = open_window(service_factory=scripted_factory(token_delay_s=0.0))
    big = _big_text(2_000_000)
    start = time.perf_counter()
    with qtbot.waitSignal(window.controller.replyFinished, timeout=20_000):
        assert window.controller.send(big)
        sent = time.perf_counter() - start
    assert sent < 1.0, f"sending took {sent:.1f} s"
    user = window.chat_view.widgets[0]
    assert user.truncated and len(user.body.toPlainText()) < 50_000
    stored = window.history.messages(window.controller.current_id)[0]
    assert stored.content == big.strip() and len(window.conversation_list.titles()[0]) <= 48


def test_conversation_list_loads_a_page_of_titles(qtbot, open_window, gui_env, monkeypatch):
    import app.gui.conversation_list as conversation_list

    monkeypatch.setattr(conversation_list, "LIST_PAGE", 10)
    store = HistoryStore(default_history_path())
    for i in range(25):
        store.create_conversation(f"Chat {i:02d}")
    store.close()
    window = open_window(service_factory=scripted_factory())
    sidebar = window.conversation_list
    assert sidebar.titles() == [f"Chat {i:02d}" for i in range(24, 14, -1)]
    assert sidebar.more_item is not None and "older" in sidebar.more_item.text()
    sidebar.show_more()
    assert len(sidebar.titles()) == 20
    sidebar.show_more()
    assert len(sidebar.titles()) == 25 and sidebar.more_item is None


def test_a_long_conversation_opens_with_its_latest_messages(qtbot, open_window, gui_env, monkeypatch):
    import app.gui.chat_controller as chat_controller

    monkeypatch.setattr(chat_controller, "TRANSCRIPT_PAGE", 50)
    store = HistoryStore(default_history_path())
    conversation = store.create_conversation("Long chat")
    for i in range(120):
        store.add_message(conversation.id, "user" if i % 2 == 0 else "assistant", f"message {i}")
    store.close()
    window = open_window(service_factory=scripted_factory())
    view = window.chat_view
    assert [w.content for w in view.widgets] == [f"message {i}" for i in range(70, 120)]
    assert view.earlier_button.isVisible() and "70 more" in view.earlier_button.text()
    qtbot.mouseClick(view.earlier_button, Qt.MouseButton.LeftButton)
    assert len(view.widgets) == 100 and view.widgets[0].content == "message 20"
    qtbot.mouseClick(view.earlier_button, Qt.MouseButton.LeftButton)
    assert len(view.widgets) == 120 and not view.earlier_button.isVisible()
