"""The chat window on the real engine and the built-in demo model (offscreen, CPU).

Each test opens a MainWindow with fresh config/data dirs; the demo pack is built once
per session (see gui_helpers.demo_home).
"""

from __future__ import annotations

import time

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QGuiApplication

from gui_helpers import gui_env, open_window, send_and_wait, set_sampling  # noqa: F401 (fixtures)


def _messages(window):
    return window.history.messages(window.controller.current_id)


def test_send_streams_a_reply_with_stats_and_phases(qtbot, open_window):
    window = open_window()
    assert window.bridge.loaded.is_demo
    assert "demo" in window.model_picker.currentText().lower() and "not a real" in window.model_picker.currentText()
    assert "demo" in window.model_info.text()
    phases, batches = [], []
    window.bridge.phaseChanged.connect(lambda e: phases.append(e.phase))
    window.bridge.textArrived.connect(lambda rid, text, reasoning: batches.append(text + reasoning))
    status_texts = []
    window.bridge.snapshotTaken.connect(lambda _s: status_texts.append(window.engine_status.phase_label.text()))
    set_sampling(window, max_tokens=48)

    message_id = send_and_wait(qtbot, window, "What does json.dumps do?")

    user, reply = _messages(window)
    assert (user.role, user.content, user.status) == ("user", "What does json.dumps do?", "finished")
    assert reply.id == message_id and reply.role == "assistant" and reply.status == "finished"
    assert reply.stats["completion_tokens"] == 48 and reply.stats["stop_reason"] == "max_tokens"
    assert reply.content or reply.reasoning
    assert reply.model_ref == "demo"
    widget = window.chat_view.widgets[-1]
    assert widget.message_id == reply.id and widget.content == reply.content
    stats_line = widget.stats_text
    for part in ("48 tokens", "TTFT", "prefill", "decode", "stop: max_tokens", "hit rate", "GB/token"):
        assert part in stats_line
    assert widget.stats_label.isVisible()
    # Phases were visible: prefill then decoding; tokens came in batches, not one signal per token.
    assert "prefill" in phases and "decoding" in phases
    assert 1 <= len(batches) < 48
    assert any(t.startswith("Writing the reply") for t in status_texts)
    assert window.engine_status.phase_label.text().startswith("Done")
    assert window.conversation_list.titles() == ["What does json.dumps do?"]
    assert window.composer.text() == "" and window.composer.send_button.isVisible()


def test_stop_mid_reply_keeps_the_text_so_far(qtbot, open_window):
    window = open_window()
    set_sampling(window, max_tokens=1500)
    window.composer.set_text("Tell me everything about pathlib.")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    assert window.composer.stop_button.isVisible() and window.stop_action.isEnabled()
    qtbot.waitUntil(lambda: window.controller.active and window.controller.active.flushes >= 3, timeout=30_000)
    with qtbot.waitSignal(window.controller.replyFinished, timeout=30_000):
        qtbot.keyClick(window.chat_view, Qt.Key.Key_Escape)  # Esc stops, wherever the focus is
    reply = _messages(window)[-1]
    assert reply.status == "stopped" and reply.stats["stop_reason"] == "cancelled"
    assert 0 < reply.stats["completion_tokens"] < 1500
    widget = window.chat_view.widgets[-1]
    assert widget.note_label.isVisible() and "Stopped" in widget.note_label.text()
    assert window.composer.send_button.isVisible() and not window.composer.stop_button.isVisible()


def test_regenerate_replaces_the_last_reply(qtbot, open_window):
    window = open_window()
    set_sampling(window, max_tokens=16, seed=None)
    first = send_and_wait(qtbot, window, "Explain the Zen of Python.")
    widget = window.chat_view.widgets[-1]
    assert widget.regenerate_button.isVisible()
    with qtbot.waitSignal(window.controller.replyFinished, timeout=60_000) as blocker:
        qtbot.mouseClick(widget.regenerate_button, Qt.MouseButton.LeftButton)
    second = blocker.args[0]
    messages = _messages(window)
    assert [m.role for m in messages] == ["user", "assistant"] and messages[1].id == second != first
    assert messages[1].status == "finished"
    assert [w.message_id for w in window.chat_view.widgets] == [messages[0].id, second]
    # The shortcut does the same.
    with qtbot.waitSignal(window.controller.replyFinished, timeout=60_000):
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_R,
                       Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier)
    assert [m.role for m in _messages(window)] == ["user", "assistant"]


def test_edit_and_resend_replaces_the_rest_of_the_conversation(qtbot, open_window):
    window = open_window()
    set_sampling(window, max_tokens=8)
    send_and_wait(qtbot, window, "first question")
    send_and_wait(qtbot, window, "second question")
    assert [m.content for m in _messages(window) if m.role == "user"] == ["first question", "second question"]
    first_user = window.chat_view.widgets[0]
    qtbot.mouseClick(first_user.edit_button, Qt.MouseButton.LeftButton)
    assert first_user.editor.isVisible() and first_user.editor.toPlainText() == "first question"
    first_user.editor.setPlainText("edited question")
    with qtbot.waitSignal(window.controller.replyFinished, timeout=60_000):
        qtbot.mouseClick(first_user.edit_send, Qt.MouseButton.LeftButton)
    messages = _messages(window)
    assert [(m.role, m.status) for m in messages] == [("user", "finished"), ("assistant", "finished")]
    assert messages[0].content == "edited question"
    assert [w.message_id for w in window.chat_view.widgets] == [m.id for m in messages]
    assert window.bridge._service is not None  # the engine kept serving after the history was cut


def test_conversations_survive_a_restart(qtbot, open_window):
    window = open_window()
    set_sampling(window, max_tokens=8)
    send_and_wait(qtbot, window, "remember me")
    window.conversation_list.rename(window.controller.current_id, "Kept chat")
    before = _messages(window)
    window.close()

    again = open_window()
    assert again.conversation_list.titles() == ["Kept chat"]
    after = again.history.messages(again.controller.current_id)
    assert [(m.role, m.content, m.status, m.stats) for m in after] == [
        (m.role, m.content, m.status, m.stats) for m in before]
    assert [w.content for w in again.chat_view.widgets] == [m.content for m in before]
    assert "tokens" in again.chat_view.widgets[-1].stats_text


def test_telemetry_charts_get_points_during_generation(qtbot, open_window):
    window = open_window()
    panel = window.telemetry
    assert panel.isVisible()
    set_sampling(window, max_tokens=64)
    counts_while_busy = []
    window.bridge.snapshotTaken.connect(
        lambda _s: counts_while_busy.append(panel.point_count("hit_rate")) if window.controller.busy else None)
    send_and_wait(qtbot, window, "What is asyncio?")
    assert counts_while_busy and max(counts_while_busy) > 0  # points arrived while the reply was being written
    for key in ("hit_rate", "ssd_gb_per_token", "decode_tok_s", "read_mb_s", "drive_busy"):
        assert panel.point_count(key) > 0, key
    chart = panel.charts["decode_tok_s"]
    qtbot.waitUntil(lambda: len(chart.points()[0]) == panel.point_count("decode_tok_s"))
    qtbot.waitUntil(lambda: chart.renders > 0)  # painted (from its pixmap) once it had points
    assert chart.y_top >= max(panel.series["decode_tok_s"][1])  # the scale holds every point
    assert int(panel.counter_labels["cache_hits"].text().replace(",", "")) > 0
    assert panel.counter_labels["pack_read_bytes"].text().endswith("iB")
    assert panel.counter_labels["io_errors"].text() == "0" and not panel.error_label.isVisible()
    assert "/" in panel.counter_labels["vram"].text()
    assert all(0 <= v <= 100 for v in panel.series["drive_busy"][1])  # a share of the time
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_T, Qt.KeyboardModifier.ControlModifier)
    assert not panel.isVisible()


def test_event_loop_stays_responsive_while_generating(qtbot, open_window):
    window = open_window()
    # A first short reply warms the engine up: its first request in a process imports
    # modules and compiles the chat template on the engine thread, holding the GIL
    # (a one-time hitch that is the engine's, not the window's).
    set_sampling(window, max_tokens=2)
    send_and_wait(qtbot, window, "warm up")
    set_sampling(window, max_tokens=120)
    gaps, last, events = [], [0.0], []

    def tick() -> None:
        now = time.perf_counter()
        gaps.append((now - last[0], last[0]))
        last[0] = now

    for name in ("textArrived", "phaseChanged", "snapshotTaken", "replyDone"):
        getattr(window.bridge, name).connect(lambda *_a, n=name: events.append((time.perf_counter(), n)))
    timer = QTimer()
    timer.setInterval(10)
    timer.timeout.connect(tick)
    window.composer.set_text("Describe the threading module in detail.")
    with qtbot.waitSignal(window.controller.replyFinished, timeout=60_000):
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
        # From the moment Enter was handled to the end of the reply: layout of the new
        # messages, prefill, streaming, telemetry, the final render.
        start = last[0] = time.perf_counter()
        timer.start()
    timer.stop()
    assert len(gaps) > 50
    worst, at = max(gaps)
    during = [n for t, n in events if at <= t <= at + worst]
    assert worst < 0.100, (f"longest stall {worst * 1000:.0f} ms at {(at - start) * 1000:.0f} ms (handled in it: "
                           f"{during}); the 5 longest: {[round(g * 1000) for g, _ in sorted(gaps)[-5:]]}")


def test_copy_message_and_code_block(qtbot, open_window):
    window = open_window()
    set_sampling(window, max_tokens=4)
    send_and_wait(qtbot, window, "Show me:\n\n```python\nprint('hi')\n```")
    user = window.chat_view.widgets[0]
    qtbot.mouseClick(user.copy_button, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == "Show me:\n\n```python\nprint('hi')\n```"
    assert user.body.code_blocks == ["print('hi')\n"]
    user.body.anchorClicked.emit(__import__("PySide6.QtCore", fromlist=["QUrl"]).QUrl("copy-code:0"))
    assert QGuiApplication.clipboard().text() == "print('hi')\n"
    assert "Copied" in window.notice_label.text()


def test_export_writes_markdown_and_json(qtbot, open_window, tmp_path):
    window = open_window()
    set_sampling(window, max_tokens=4)
    send_and_wait(qtbot, window, "export me")
    md = window.export_conversation(tmp_path / "chat.md", "md").read_text()
    js = window.export_conversation(tmp_path / "chat.json", "json").read_text()
    assert md.startswith("# export me") and "## Assistant" in md
    assert '"role": "assistant"' in js and '"stop_reason": "max_tokens"' in js
