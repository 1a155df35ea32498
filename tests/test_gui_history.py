"""The desktop app's Qt-free parts: history store, export, settings file, Markdown rendering."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict, fields

import pytest

from app.gui.markdown_render import MarkdownRenderer, StreamingMarkdown, stable_prefix_length
from app.gui.settings import DEMO_REF, AppSettings, load_settings, save_settings, settings_path
from app.history import (
    ChatSettings,
    HistoryError,
    HistoryStore,
    default_history_path,
    export_json,
    export_markdown,
    format_stats,
)
from engine.text.sampling import SamplingParams

STATS = {"prompt_tokens": 12, "completion_tokens": 40, "ttft_s": 0.25, "prefill_tok_s": 300.0, "decode_tok_s": 12.5,
         "hit_rate": 0.875, "ssd_gb_per_token": 0.0421, "stop_reason": "eos"}


@pytest.fixture
def store(tmp_path):
    history = HistoryStore(tmp_path / "history.sqlite3")
    yield history
    history.close()


def test_store_uses_wal_and_normal_sync(store):
    assert store.journal_mode == "wal"
    db = sqlite3.connect(store.path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()


def test_checkpoint_runs_off_the_writer(tmp_path):
    import threading

    store = HistoryStore(tmp_path / "h.sqlite3", autocheckpoint=False)
    assert store._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    conversation = store.create_conversation()
    for i in range(50):
        store.add_message(conversation.id, "user", f"message {i} " * 100)
    worker = threading.Thread(target=store.checkpoint)
    worker.start()
    worker.join()
    store.add_message(conversation.id, "user", "after the checkpoint")
    store.close()
    reopened = HistoryStore(tmp_path / "h.sqlite3")
    assert len(reopened.messages(conversation.id)) == 51
    reopened.close()


def test_conversations_messages_and_search(store):
    first = store.create_conversation()
    store.add_message(first.id, "user", "How do I parse JSON in Python?")
    reply = store.add_message(first.id, "assistant", "", status="streaming")
    store.update_message(reply.id, content="Use `json.loads`.", reasoning="easy", status="finished", stats=STATS)
    second = store.create_conversation("Notes")
    store.add_message(second.id, "user", "100% sure_thing")

    assert store.conversation(first.id).title == "How do I parse JSON in Python?"  # titled by the first message
    assert [c.id for c in store.conversations()] == [second.id, first.id]  # most recent first
    messages = store.messages(first.id)
    assert [(m.role, m.status) for m in messages] == [("user", "finished"), ("assistant", "finished")]
    assert messages[1].stats == STATS and messages[1].reasoning == "easy"
    assert [c.id for c in store.conversations("json.loads")] == [first.id]  # message text is searched
    assert [c.id for c in store.conversations("notes")] == [second.id]  # titles too, any case
    assert [c.id for c in store.conversations("100%")] == [second.id]  # LIKE wildcards are literal
    assert store.conversations("1_0") == []  # "_" is not "any character"

    store.rename_conversation(second.id, "  ")
    assert store.conversation(second.id).title == "New chat"
    store.delete_messages_from(first.id, reply.id)
    assert [m.role for m in store.messages(first.id)] == ["user"]
    store.delete_conversation(first.id)
    assert store.conversation(first.id) is None and store.messages(first.id) == []


def test_previews_pages_and_titles_of_long_messages(store):
    conversation = store.create_conversation()
    long_text = "word " * 50_000  # 250,000 characters
    store.add_message(conversation.id, "user", long_text)
    for i in range(5):
        store.add_message(conversation.id, "assistant" if i % 2 == 0 else "user", f"short {i}")
    assert store.conversation(conversation.id).title == ("word " * 10)[:47].rstrip() + "…"  # from its start only
    first, *rest = store.messages(conversation.id, preview_chars=100)
    assert first.content == long_text[:100] and first.content_length == len(long_text) and not first.complete
    assert all(m.complete and m.content_length is None for m in rest)
    assert store.message(first.id).content == long_text  # the whole text when asked for
    assert [m.content for m in store.messages(conversation.id, last=2)] == ["short 3", "short 4"]
    assert store.message_count(conversation.id) == 6
    for i in range(3):
        store.create_conversation(f"c{i}")
    assert [c.title for c in store.conversations(limit=2)] == ["c2", "c1"]


def test_settings_per_conversation_round_trip(store):
    settings = ChatSettings(system_prompt="Be brief.", temperature=0.0, top_p=0.9, top_k=0, max_tokens=64, seed=3,
                            thinking=False)
    conversation = store.create_conversation(settings=settings)
    assert store.conversation(conversation.id).settings == settings
    store.update_settings(conversation.id, ChatSettings())
    assert store.conversation(conversation.id).settings == ChatSettings()
    assert ChatSettings.from_json('{"temperature": 0.2, "unknown": 1}').temperature == 0.2
    assert ChatSettings.from_json("not json") == ChatSettings()


def test_chat_settings_defaults_match_the_engine():
    engine = SamplingParams()
    ours = ChatSettings()
    for name in ("temperature", "top_p", "top_k", "max_tokens", "seed"):
        assert getattr(ours, name) == getattr(engine, name), name


def test_bad_values_are_refused(store):
    conversation = store.create_conversation()
    with pytest.raises(ValueError):
        store.add_message(conversation.id, "robot", "x")
    with pytest.raises(ValueError):
        store.add_message(conversation.id, "user", "x", status="done")


def test_newer_schema_is_refused_with_advice(tmp_path):
    path = tmp_path / "h.sqlite3"
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version=99")
    db.close()
    with pytest.raises(HistoryError, match="newer ExpertDesk"):
        HistoryStore(path)


def test_default_path_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("EXPERTDESK_DATA_DIR", str(tmp_path))
    assert default_history_path() == tmp_path / "history.sqlite3"


def test_export_markdown_and_json(store):
    conversation = store.create_conversation(settings=ChatSettings(system_prompt="You are terse."), model_ref="demo")
    store.add_message(conversation.id, "user", "Show code")
    reply = store.add_message(conversation.id, "assistant", "", status="streaming")
    store.update_message(reply.id, content="```python\nprint(1)\n```", reasoning="think", status="stopped",
                         stats=STATS)
    conversation = store.conversation(conversation.id)
    messages = store.messages(conversation.id)

    md = export_markdown(conversation, messages)
    assert md.startswith("# Show code\n")
    assert "> You are terse." in md and "## User\n\nShow code" in md
    assert "```python\nprint(1)\n```" in md and "<summary>Reasoning</summary>" in md
    assert "stopped by the user" in md and "hit rate 88%" in md

    data = json.loads(export_json(conversation, messages))
    assert data["format"] == "expertdesk-conversation" and data["model"] == "demo"
    assert data["settings"]["system_prompt"] == "You are terse."
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["messages"][1]["stats"] == STATS and data["messages"][1]["status"] == "stopped"


def test_format_stats_line():
    line = format_stats(STATS)
    assert line == ("40 tokens · TTFT 0.25 s · prefill 300.0 tok/s · decode 12.5 tok/s · stop: eos · "
                    "hit rate 88% · SSD 0.0421 GB/token")


def test_app_settings_round_trip_and_bad_files(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPERTDESK_CONFIG_DIR", str(tmp_path))
    assert settings_path() == tmp_path / "settings.json"
    assert load_settings() == AppSettings()  # no file yet
    settings = AppSettings().with_model("/packs/v4.expertpack")
    settings = AppSettings(**{**asdict(settings), "models": settings.models, "theme": "dark", "font_points": 14})
    save_settings(settings)
    assert load_settings() == settings
    assert load_settings().last_model == "/packs/v4.expertpack"
    assert [m.ref for m in settings.without_model(DEMO_REF).models][0] == DEMO_REF  # the demo stays
    settings_path().write_text('{"theme": "purple", "font_points": 400, "models": []}')
    loaded = load_settings()
    assert loaded.theme == "system" and loaded.font_points == 28 and loaded.models[0].is_demo
    settings_path().write_text("{broken")
    assert load_settings() == AppSettings()
    assert {f.name for f in fields(AppSettings)} >= {"models", "cache_vram_mib", "cache_host_mib", "theme"}


def test_markdown_renders_code_tables_and_escapes_html():
    rendered = MarkdownRenderer().render(
        "# Title\n\n<script>alert(1)</script>\n\n```python\ndef f():\n    return 1\n```\n\n"
        "| a | b |\n|---|---|\n| 1 | 2 |\n"
        "\n`x` and \x07bell")
    assert "<script>" not in rendered.html and "&lt;script&gt;" in rendered.html
    assert rendered.code_blocks == ["def f():\n    return 1\n"]
    assert 'href="copy-code:0"' in rendered.html
    assert "<table" in rendered.html and "<td>1</td>" in rendered.html
    assert "\x07" not in rendered.html and "\ufffd" in rendered.html
    assert "style=\"color:" in rendered.html  # Pygments wrote inline colours (no CSS classes in Qt)


def test_streaming_markdown_matches_a_full_render_and_renders_only_the_tail():
    text = ("Intro paragraph.\n\n```python\nx = 1\n\ny = 2\n```\n\nA list:\n\n- one\n- two\n\n"
            "```\nplain\n```\n\nEnd with `code` and **bold**.\n")
    renderer = MarkdownRenderer()
    stream = StreamingMarkdown(renderer)
    for end in range(1, len(text) + 1):
        partial = stream.render(text[:end])
    full = renderer.render(text)
    assert partial.html == full.html and partial.code_blocks == full.code_blocks
    # A blank line inside a fence is not a split point; the blank line after the fence is.
    assert stable_prefix_length("```\na\n\nb\n") == 0
    assert stable_prefix_length("```\na\n```\n\nnext\n") == len("```\na\n```\n\n")
    # A replaced (not extended) text starts over instead of keeping stale HTML.
    assert "other" in stream.render("other text\n").html and "Intro" not in stream.render("other text\n").html


def test_immortal_singletons_are_protected_on_old_pythons():
    import sys

    from app.gui.qt_compat import protect_none_refcount

    protect_none_refcount()
    if sys.version_info < (3, 12):
        # PySide6 6.12 drops references to None/True/False; with this they can never reach 0.
        assert sys.getrefcount(None) > 2**39 and sys.getrefcount(True) > 2**39
    assert protect_none_refcount() is False  # idempotent
