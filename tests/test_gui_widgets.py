"""Window details with exact control: a scripted engine (same interface as EngineService).

The chat flow on the real engine and the demo model is in test_gui_chat.py; here a
ScriptedEngineService gives fixed replies, long replies and I/O errors on demand.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QAbstractButton, QComboBox, QLineEdit, QPlainTextEdit

from app.gui.engine_bridge import EngineBridge
from app.gui.settings import load_settings
from engine.service_events import GenerateRequest
from engine.text.sampling import SamplingParams
from gui_helpers import (  # noqa: F401 (fixtures)
    SCRIPTED_REASONING,
    SCRIPTED_REPLY,
    gui_env,
    open_window,
    scripted_factory,
    send_and_wait,
    set_sampling,
)


def test_bridge_batches_tokens_and_keeps_order(qtbot):
    long_reply = "word " * 2000
    bridge = EngineBridge(service_factory=scripted_factory(reply=long_reply, reasoning="", token_delay_s=0.0))
    batches, order = [], []
    bridge.textArrived.connect(lambda rid, text, reasoning: (batches.append(text), order.append("text")))
    bridge.replyDone.connect(lambda event: order.append("done"))
    bridge.load("demo")
    qtbot.waitUntil(lambda: bridge.loaded is not None, timeout=5000)
    request = GenerateRequest([{"role": "user", "content": "hi"}], sampling=SamplingParams(max_tokens=5000),
                              thinking=False)
    with qtbot.waitSignal(bridge.replyDone, timeout=20_000) as done:
        bridge.submit(request)
    tokens = len(long_reply) // 4
    assert "".join(batches) == long_reply == done.args[0].text
    assert len(batches) < tokens / 10  # batched on the flush timer, not one signal per token
    assert order[-1] == "done" and "done" not in order[:-1]
    assert bridge.tokens_generated == tokens
    assert not bridge.busy
    bridge.shutdown()


def test_io_error_shows_on_the_reply_and_in_telemetry(qtbot, open_window):
    window = open_window(service_factory=scripted_factory(io_error_after=6, token_delay_s=0.005))
    window.composer.set_text("read something")
    with qtbot.waitSignal(window.controller.replyFinished, timeout=10_000):
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    reply = window.history.messages(window.controller.current_id)[-1]
    assert reply.status == "error" and "EIO" in reply.error
    widget = window.chat_view.widgets[-1]
    assert widget.note_label.isVisible() and "Error" in widget.note_label.text()
    assert "Check the drive" in widget.note_label.text()
    window.bridge.poll_snapshot()
    panel = window.telemetry
    assert panel.error_label.isVisible() and "failed" in panel.error_label.text()
    assert panel.counter_labels["io_errors"].text() == "1"
    assert "color" in panel.counter_labels["io_errors"].styleSheet()  # shown as an error, not a plain number
    assert window.engine_status.phase_label.text().startswith("Reply failed")


def test_composer_keys_and_per_conversation_settings(qtbot, open_window):
    window = open_window(service_factory=scripted_factory())
    service = window.bridge._service
    edit = window.composer.edit
    qtbot.keyClicks(edit, "line one")
    qtbot.keyClick(edit, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(edit, "line two")
    assert window.composer.text() == "line one\nline two" and not window.controller.busy
    panel = window.settings_panel
    panel.system_prompt.setPlainText("Answer in one line.")
    panel.temperature.setValue(0.0)
    panel.top_k.setValue(0)
    panel.seed.setValue(42)
    panel.thinking.setChecked(False)
    with qtbot.waitSignal(window.controller.replyFinished, timeout=10_000):
        qtbot.keyClick(edit, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)  # Ctrl+Enter sends too
    request = service.requests[-1]
    assert request.messages == [{"role": "system", "content": "Answer in one line."},
                                {"role": "user", "content": "line one\nline two"}]
    assert request.sampling.temperature == 0 and request.sampling.greedy and request.sampling.seed == 42
    assert request.sampling.top_k == 0 and request.thinking is False
    stored = window.history.conversation(window.controller.current_id).settings
    assert (stored.system_prompt, stored.temperature, stored.seed, stored.thinking) == ("Answer in one line.", 0.0,
                                                                                       42, False)
    # A new chat starts from the defaults; the old one keeps its own settings.
    first = window.controller.current_id
    qtbot.keyClick(window.chat_view, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    assert window.controller.current_id is None and window.chat_view.widgets == []
    assert panel.settings().temperature == 0.7 and panel.settings().system_prompt == ""
    window.conversation_list.select(first)
    assert panel.settings().seed == 42 and len(window.chat_view.widgets) == 2


def test_reply_renders_markdown_reasoning_and_stop(qtbot, open_window):
    window = open_window(service_factory=scripted_factory(token_delay_s=0.01))
    set_sampling(window, max_tokens=1000)
    send_and_wait(qtbot, window, "show me code")
    widget = window.chat_view.widgets[-1]
    assert widget.content == SCRIPTED_REPLY and widget.reasoning == SCRIPTED_REASONING
    assert widget.body.code_blocks == ['def add(a: int, b: int) -> int:\n    """Return the sum."""\n    return a + b\n']
    html = widget.body.toHtml()
    assert "Copy code" in html and "input" in html
    assert widget.reasoning_toggle.isVisible() and not widget.reasoning_toggle.isChecked()  # folded when done
    qtbot.mouseClick(widget.reasoning_toggle, Qt.MouseButton.LeftButton)
    assert widget.reasoning_view.isVisible()
    widget.body.anchorClicked.emit(__import__("PySide6.QtCore", fromlist=["QUrl"]).QUrl("copy-code:0"))
    assert QGuiApplication.clipboard().text() == widget.body.code_blocks[0]
    # Stop: the reply ends as "stopped" with what was written.
    window.composer.set_text("again")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: window.controller.active is not None and window.controller.active.flushes >= 2)
    with qtbot.waitSignal(window.controller.replyFinished, timeout=10_000):
        qtbot.mouseClick(window.composer.stop_button, Qt.MouseButton.LeftButton)
    reply = window.history.messages(window.controller.current_id)[-1]
    assert reply.status == "stopped" and 0 < len(reply.content + reply.reasoning) < len(SCRIPTED_REPLY)


def test_long_reply_streams_in_few_renders(qtbot, open_window):
    paragraph = "Some *markdown* text with `code` in it, long enough to wrap across the line. " * 3
    long_reply = "\n\n".join(f"## Part {i}\n\n{paragraph}\n\n```python\nprint({i})\n```" for i in range(60))
    window = open_window(service_factory=scripted_factory(reply=long_reply, reasoning="", token_delay_s=0.0005))
    set_sampling(window, max_tokens=100_000)
    flushes = []
    window.bridge.textArrived.connect(lambda *_: flushes.append(1))
    send_and_wait(qtbot, window, "write a lot")
    widget = window.chat_view.widgets[-1]
    assert widget.content == long_reply and len(widget.body.code_blocks) == 60
    assert len(flushes) < len(long_reply) / 4 / 10  # one render per flush, not per token
    reply = window.history.messages(window.controller.current_id)[-1]
    assert reply.content == long_reply and reply.status == "finished"


def test_switching_conversations_while_a_reply_streams(qtbot, open_window):
    window = open_window(service_factory=scripted_factory(token_delay_s=0.02))
    set_sampling(window, max_tokens=1000)
    send_and_wait(qtbot, window, "first chat")
    first = window.controller.current_id
    window.controller.new_chat()
    window.composer.set_text("second chat")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    second = window.controller.current_id
    qtbot.waitUntil(lambda: window.controller.active is not None and window.controller.active.flushes >= 2)
    window.conversation_list.select(first)  # away while it streams: the reply keeps being saved
    assert [w.content for w in window.chat_view.widgets][0] == "first chat"
    qtbot.waitUntil(lambda: window.controller.active.flushes >= 5)
    window.conversation_list.select(second)  # back: the streaming reply is on screen again
    widget = window.chat_view.widgets[-1]
    assert widget.message_id == window.controller.active.message_id and (widget.content or widget.reasoning)
    with qtbot.waitSignal(window.controller.replyFinished, timeout=20_000):
        pass
    reply = window.history.messages(second)[-1]
    assert reply.status == "finished" and reply.content == SCRIPTED_REPLY
    assert window.chat_view.widgets[-1].content == SCRIPTED_REPLY


def test_conversation_list_rename_delete_search(qtbot, open_window):
    window = open_window(service_factory=scripted_factory(token_delay_s=0.0))
    for text in ("alpha question", "beta question", "gamma question"):
        window.controller.new_chat()
        send_and_wait(qtbot, window, text)
    sidebar = window.conversation_list
    assert sidebar.titles() == ["gamma question", "beta question", "alpha question"]
    sidebar.rename(window.controller.current_id, "Renamed gamma")
    assert sidebar.titles()[0] == "Renamed gamma"
    assert window.windowTitle().startswith("Renamed gamma")
    qtbot.keyClick(window.chat_view, Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)
    assert sidebar.search.hasFocus()
    qtbot.keyClicks(sidebar.search, "beta")
    qtbot.waitUntil(lambda: sidebar.titles() == ["beta question"], timeout=3000)
    sidebar.search.clear()
    qtbot.waitUntil(lambda: len(sidebar.titles()) == 3, timeout=3000)
    sidebar.delete(window.controller.current_id, confirm=False)
    assert sidebar.titles() == ["beta question", "alpha question"]
    assert window.controller.current_id is None and window.chat_view.widgets == []


def test_theme_follows_the_system_unless_overridden(qtbot, open_window, monkeypatch):
    import app.gui.theme as theme

    window = open_window(service_factory=scripted_factory())
    monkeypatch.setattr(theme, "system_prefers_dark", lambda: True)
    window.set_theme("system")
    assert window.dark
    monkeypatch.setattr(theme, "system_prefers_dark", lambda: False)
    window._on_color_scheme_changed(Qt.ColorScheme.Light)  # what QStyleHints.colorSchemeChanged calls
    assert not window.dark
    window.set_theme("dark")
    window._on_color_scheme_changed(Qt.ColorScheme.Light)  # an explicit choice wins over the system
    assert window.dark
    window.set_theme("system")


def test_font_size_theme_and_accessibility(qtbot, open_window):
    window = open_window(service_factory=scripted_factory())
    before = window.composer.edit.font().pointSize()
    qtbot.keyClick(window.chat_view, Qt.Key.Key_Plus, Qt.KeyboardModifier.ControlModifier)
    qtbot.keyClick(window.chat_view, Qt.Key.Key_Plus, Qt.KeyboardModifier.ControlModifier)
    assert window.composer.edit.font().pointSize() == before + 2
    assert load_settings().font_points == before + 2
    qtbot.keyClick(window.chat_view, Qt.Key.Key_Minus, Qt.KeyboardModifier.ControlModifier)
    assert window.composer.edit.font().pointSize() == before + 1
    window.set_theme("dark")
    assert window.dark and window.palette().window().color().lightness() < 80
    assert window.composer.edit.font().pointSize() == before + 1  # a theme switch keeps the font size
    window.set_theme("light")
    assert not window.dark and window.palette().window().color().lightness() > 200
    window.set_theme("system")
    # Every control a keyboard or screen-reader user reaches has a name.
    unnamed = []
    for widget in window.findChildren(QAbstractButton) + window.findChildren(QLineEdit) + \
            window.findChildren(QPlainTextEdit) + window.findChildren(QComboBox):
        if widget.isVisible() and not (widget.accessibleName() or getattr(widget, "text", lambda: "")()):
            unnamed.append(widget)
    assert unnamed == []
    qtbot.keyClick(window.chat_view, Qt.Key.Key_T, Qt.KeyboardModifier.ControlModifier)
    assert not window.telemetry.isVisible() and load_settings().show_telemetry is False


def test_model_load_failure_is_explained(qtbot, open_window, tmp_path):
    window = open_window()
    with qtbot.waitSignal(window.bridge.loadFailed, timeout=30_000):
        window.load_model(str(tmp_path / "missing.expertpack"))
    assert window.banner.isVisible() and "could not be loaded" in window.banner.text()
    assert "does not exist" in window.banner.text()
    assert not window.composer.send_button.isEnabled()
    assert "pick one" in window.composer.send_button.toolTip()
    with qtbot.waitSignal(window.bridge.modelLoaded, timeout=30_000):
        window.load_model("demo")
    assert window.composer.send_button.isEnabled() and not window.banner.isVisible()


def test_telemetry_rates_between_two_snapshots():
    from app.gui.telemetry_panel import rates_between

    before = {"time": 10.0, "cache_hits": 10, "cache_misses": 10, "pack_read_bytes": 0, "drive_busy_seconds": 1.0}
    after = {"time": 12.0, "cache_hits": 40, "cache_misses": 20, "pack_read_bytes": 2_000_000_000,
             "drive_busy_seconds": 2.5}
    rates = rates_between(before, after, tokens=4)
    assert rates == {"hit_rate": 75.0, "ssd_gb_per_token": 0.5, "decode_tok_s": 2.0, "read_mb_s": 1000.0,
                     "drive_busy": 75.0}
    assert rates_between(after, after, tokens=0) == {}  # no time passed: nothing to chart
    idle = rates_between(before, {**before, "time": 11.0}, tokens=0)
    assert idle == {}  # nothing happened: no misleading zeros


def test_verify_reads_setting_round_trips_and_reaches_the_runtime_options(qtbot, tmp_path):
    from app.gui.preferences_dialog import PreferencesDialog
    from app.gui.settings import AppSettings, save_settings

    dialog = PreferencesDialog(AppSettings())
    qtbot.addWidget(dialog)
    assert not dialog.verify_reads.isChecked()
    dialog.verify_reads.setChecked(True)
    edited = dialog.result_settings()
    assert edited.verify_reads is True and edited.runtime_options().verify_reads is True
    path = tmp_path / "settings.json"
    save_settings(edited, path)
    assert load_settings(path).verify_reads is True
    assert AppSettings().runtime_options().verify_reads is False


def test_float32_replies_setting_reloads_the_model_with_float32_decode(qtbot, open_window, monkeypatch):
    """Preferences' "Compute replies in float32" survives a restart and reaches the engine:
    accepting the dialog reloads the loaded model with decode_dtype float32 (and unticking
    it reloads it without)."""
    import app.gui.main_window
    from app.gui.preferences_dialog import PreferencesDialog
    from app.gui.settings import AppSettings

    dialog = PreferencesDialog(AppSettings())
    qtbot.addWidget(dialog)
    assert not dialog.float32_replies.isChecked()
    assert AppSettings().runtime_options().decode_dtype is None  # the engine's default: as the dtype

    ticked = {"value": True}

    class Accepting(PreferencesDialog):
        def exec(self) -> int:
            self.float32_replies.setChecked(ticked["value"])
            return 1

    monkeypatch.setattr(app.gui.main_window, "PreferencesDialog", Accepting)
    window = open_window(service_factory=scripted_factory())
    service = window.bridge._service
    assert service.options.decode_dtype is None
    for value in (True, False):
        ticked["value"] = value
        window.open_preferences()
        assert window.bridge.loaded is None  # a reload started
        qtbot.waitUntil(lambda: window.bridge.loaded is not None, timeout=5000)
        assert service.options.decode_dtype == ("float32" if value else None)
        assert load_settings().float32_replies is value  # saved (the test's own config dir)


def test_float32_replies_round_trips_and_a_hand_edited_value_is_clamped(tmp_path):
    import json

    from app.gui.settings import AppSettings, save_settings

    path = tmp_path / "settings.json"
    save_settings(AppSettings(float32_replies=True), path)
    assert load_settings(path).float32_replies is True
    data = json.loads(path.read_text())
    data["float32_replies"] = "yes"  # not a boolean: off, as for verify_reads
    path.write_text(json.dumps(data))
    assert load_settings(path).float32_replies is False
