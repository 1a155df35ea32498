"""Conversation history: a small SQLite database, and export to Markdown / JSON.

Qt-free, so the CLI, a server and the tests can read and write the same history as the
desktop window.

Durability: the database runs in WAL mode with ``synchronous=NORMAL`` and every call
that changes something commits before it returns. A committed WAL transaction
survives the process being killed at any moment (it is lost only if the whole machine
loses power before the next checkpoint), and NORMAL skips the fsync per commit, so a
commit is a write into the page cache: cheap enough to do for every message the user
sends and for every batch of streamed reply text the window shows. The window calls
these methods *before* it shows the text, so "shown" implies "stored".

The one slow step of WAL, the checkpoint that copies the log into the database file
and fsyncs it, is taken off the writer: ``HistoryStore(..., autocheckpoint=False)``
never checkpoints on commit, and ``checkpoint()`` (safe from any thread, it opens its
own connection) does it where waiting costs nothing, e.g. on a worker thread after a
reply.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

SCHEMA_VERSION = 1

ROLES = ("system", "user", "assistant")
# streaming: a reply still being written (or one whose writer died: the app was killed);
# finished: the model ended it (eos, stop string, max tokens); stopped: the user pressed
# Stop; error: the engine failed, `error` says why.
STATUSES = ("streaming", "finished", "stopped", "error")

DEFAULT_TITLE = "New chat"
TITLE_LENGTH = 48

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    model_ref TEXT,
    settings TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: a deleted reply's id never names a new one
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
    content TEXT NOT NULL DEFAULT '',
    reasoning TEXT NOT NULL DEFAULT '',
    stats TEXT,
    status TEXT NOT NULL CHECK (status IN ('streaming', 'finished', 'stopped', 'error')),
    error TEXT,
    model_ref TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages (conversation_id, id);
CREATE INDEX IF NOT EXISTS conversations_by_update ON conversations (updated_at);
"""


class HistoryError(RuntimeError):
    """The history database cannot be opened or used; the message says why and what to do."""


@dataclass(frozen=True)
class ChatSettings:
    """Per-conversation system prompt and sampling settings.

    The defaults are those of ``engine.text.sampling.SamplingParams`` (a test keeps
    them equal). ``temperature == 0`` is greedy decoding; ``top_k == 0`` and
    ``top_p == 1`` switch those filters off; ``seed`` None draws a fresh seed per reply.
    """

    system_prompt: str = ""
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    max_tokens: int = 1024
    seed: int | None = None
    thinking: bool = True

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | None) -> "ChatSettings":
        """Settings stored by any version: unknown keys are ignored, missing keys take defaults."""
        try:
            data = json.loads(text or "{}")
        except json.JSONDecodeError:
            data = {}
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known}) if isinstance(data, dict) else cls()


@dataclass(frozen=True)
class Conversation:
    """One conversation's header row."""

    id: int
    title: str
    created_at: float
    updated_at: float
    model_ref: str | None = None
    settings: ChatSettings = field(default_factory=ChatSettings)


@dataclass(frozen=True)
class Message:
    """One message of a conversation (a user turn or a reply)."""

    id: int
    conversation_id: int
    role: str
    content: str
    reasoning: str
    status: str
    created_at: float
    stats: dict[str, Any] | None = None
    error: str | None = None
    model_ref: str | None = None


def default_history_path() -> Path:
    """Where the desktop app keeps its history: ``$EXPERTDESK_DATA_DIR`` or the platformdirs user data dir."""
    override = os.environ.get("EXPERTDESK_DATA_DIR")
    if override:
        return Path(override) / "history.sqlite3"
    from platformdirs import user_data_dir

    return Path(user_data_dir("ExpertDesk", "ExpertDesk")) / "history.sqlite3"


def title_from_text(text: str) -> str:
    """A conversation title from its first user message: the first line, shortened."""
    line = " ".join(text.strip().split())
    if not line:
        return DEFAULT_TITLE
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1].rstrip() + "…"


class HistoryStore:
    """Conversations and messages in one SQLite file (see the module docstring for durability).

    One store belongs to one thread (SQLite's own rule for a connection); the window
    uses it from the GUI thread only.
    """

    def __init__(self, path: str | os.PathLike, *, autocheckpoint: bool = True) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None, timeout=5.0)
            self._db.row_factory = sqlite3.Row
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            if not autocheckpoint:
                self._db.execute("PRAGMA wal_autocheckpoint=0")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise HistoryError(
                    f"the chat history at {self.path} was written by a newer ExpertDesk (schema {version}, "
                    f"this one reads up to {SCHEMA_VERSION}); update ExpertDesk, or move that file away to "
                    "start a fresh history"
                )
            if version < SCHEMA_VERSION:
                self._db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
        except sqlite3.Error as exc:
            raise HistoryError(
                f"cannot open the chat history at {self.path}: {exc}. Check that the folder is writable and "
                "the disk is not full; if the file is damaged, move it away and ExpertDesk starts a new one"
            ) from exc
        # Without WAL (some network filesystems refuse it) a kill can still not lose a
        # commit, but readers block writers; worth knowing, not worth refusing to start.
        self.journal_mode = str(mode).lower()

    # Plumbing -----------------------------------------------------------------
    def _transaction(self) -> "_Transaction":
        return _Transaction(self._db)

    def close(self) -> None:
        """Close the database (a WAL checkpoint folds the log into the main file)."""
        self._db.close()

    def checkpoint(self) -> None:
        """Copy the WAL into the database file (PASSIVE: never waits for, nor blocks, a writer).

        Opens its own connection, so any thread may call it while the owner keeps writing.
        """
        if self.journal_mode != "wal" or str(self.path) == ":memory:":
            return
        try:
            db = sqlite3.connect(self.path, timeout=5.0)
            try:
                db.execute("PRAGMA wal_checkpoint(PASSIVE)")
            finally:
                db.close()
        except sqlite3.Error:
            # Nothing is lost: the WAL still holds every commit, and the next checkpoint
            # (or closing the store) copies it.
            pass

    # Conversations ------------------------------------------------------------
    def create_conversation(
        self, title: str = DEFAULT_TITLE, *, settings: ChatSettings | None = None, model_ref: str | None = None
    ) -> Conversation:
        """A new, empty conversation (committed)."""
        now = time.time()
        settings = settings or ChatSettings()
        with self._transaction():
            cur = self._db.execute(
                "INSERT INTO conversations (title, created_at, updated_at, model_ref, settings) VALUES (?, ?, ?, ?, ?)",
                (title, now, now, model_ref, settings.to_json()),
            )
        return Conversation(cur.lastrowid, title, now, now, model_ref, settings)

    def conversation(self, conversation_id: int) -> Conversation | None:
        """One conversation, or None if it does not exist (deleted meanwhile)."""
        row = self._db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        return _conversation(row) if row else None

    def conversations(self, search: str = "") -> list[Conversation]:
        """All conversations, most recently active first; ``search`` matches titles and message text."""
        if not search.strip():
            rows = self._db.execute("SELECT * FROM conversations ORDER BY updated_at DESC, id DESC").fetchall()
        else:
            pattern = "%" + search.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            rows = self._db.execute(
                """SELECT * FROM conversations c
                   WHERE c.title LIKE ?1 ESCAPE '\\'
                      OR EXISTS (SELECT 1 FROM messages m WHERE m.conversation_id = c.id
                                 AND m.content LIKE ?1 ESCAPE '\\')
                   ORDER BY updated_at DESC, id DESC""",
                (pattern,),
            ).fetchall()
        return [_conversation(r) for r in rows]

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        """Give a conversation a new title (blank titles become "New chat")."""
        with self._transaction():
            self._db.execute(
                "UPDATE conversations SET title = ? WHERE id = ?", (title.strip() or DEFAULT_TITLE, conversation_id)
            )

    def delete_conversation(self, conversation_id: int) -> None:
        """Delete a conversation and all its messages."""
        with self._transaction():
            self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def update_settings(self, conversation_id: int, settings: ChatSettings) -> None:
        """Store a conversation's system prompt and sampling settings."""
        with self._transaction():
            self._db.execute("UPDATE conversations SET settings = ? WHERE id = ?", (settings.to_json(), conversation_id))

    def set_model(self, conversation_id: int, model_ref: str | None) -> None:
        """Remember which model the conversation last talked to."""
        with self._transaction():
            self._db.execute("UPDATE conversations SET model_ref = ? WHERE id = ?", (model_ref, conversation_id))

    # Messages -----------------------------------------------------------------
    def add_message(
        self,
        conversation_id: int,
        role: str,
        content: str = "",
        *,
        reasoning: str = "",
        status: str = "finished",
        model_ref: str | None = None,
    ) -> Message:
        """Append a message (committed before this returns). A first user message titles a new conversation."""
        _check(role, status)
        now = time.time()
        with self._transaction():
            cur = self._db.execute(
                """INSERT INTO messages (conversation_id, role, content, reasoning, status, model_ref,
                                         created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)""",
                (conversation_id, role, content, reasoning, status, model_ref, now, now),
            )
            self._db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
            if role == "user":
                self._db.execute(
                    "UPDATE conversations SET title = ? WHERE id = ? AND title = ?",
                    (title_from_text(content), conversation_id, DEFAULT_TITLE),
                )
        return Message(cur.lastrowid, conversation_id, role, content, reasoning, status, now, model_ref=model_ref)

    def update_message(
        self,
        message_id: int,
        *,
        content: str | None = None,
        reasoning: str | None = None,
        status: str | None = None,
        stats: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        """Change a message in place (a streaming reply's text so far, its end state and stats)."""
        if status is not None:
            _check("assistant", status)
        sets: list[str] = ["updated_at = ?"]
        values: list[Any] = [time.time()]
        for column, value in (("content", content), ("reasoning", reasoning), ("status", status), ("error", error)):
            if value is not None:
                sets.append(f"{column} = ?")
                values.append(value)
        if stats is not None:
            sets.append("stats = ?")
            values.append(json.dumps(stats, sort_keys=True))
        with self._transaction():
            self._db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*values, message_id))

    def message(self, message_id: int) -> Message | None:
        """One message, or None."""
        row = self._db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        return _message(row) if row else None

    def messages(self, conversation_id: int) -> list[Message]:
        """A conversation's messages in the order they were written."""
        rows = self._db.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        return [_message(r) for r in rows]

    def delete_messages_from(self, conversation_id: int, message_id: int) -> None:
        """Delete a message and everything after it (regenerate, edit-and-resend)."""
        with self._transaction():
            self._db.execute("DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (conversation_id, message_id))


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error): one write lock per change, no surprises."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self._db.execute("ROLLBACK" if exc_type else "COMMIT")


def _check(role: str, status: str) -> None:
    if role not in ROLES:
        raise ValueError(f"message role must be one of {ROLES}, got {role!r}")
    if status not in STATUSES:
        raise ValueError(f"message status must be one of {STATUSES}, got {status!r}")


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(
        row["id"], row["title"], row["created_at"], row["updated_at"], row["model_ref"],
        ChatSettings.from_json(row["settings"]),
    )


def _message(row: sqlite3.Row) -> Message:
    stats = json.loads(row["stats"]) if row["stats"] else None
    return Message(
        row["id"], row["conversation_id"], row["role"], row["content"], row["reasoning"], row["status"],
        row["created_at"], stats, row["error"], row["model_ref"],
    )


# Export ---------------------------------------------------------------------
def export_json(conversation: Conversation, messages: Iterable[Message]) -> str:
    """A conversation as JSON: its header, settings and every message with its stats."""
    data = {
        "format": "expertdesk-conversation",
        "version": 1,
        "title": conversation.title,
        "created_at": _iso(conversation.created_at),
        "model": conversation.model_ref,
        "settings": asdict(conversation.settings),
        "messages": [
            {
                "role": m.role,
                "content": m.content,
                **({"reasoning": m.reasoning} if m.reasoning else {}),
                "status": m.status,
                **({"error": m.error} if m.error else {}),
                **({"stats": m.stats} if m.stats else {}),
                **({"model": m.model_ref} if m.model_ref else {}),
                "created_at": _iso(m.created_at),
            }
            for m in messages
        ],
    }
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def export_markdown(conversation: Conversation, messages: Iterable[Message]) -> str:
    """A conversation as a readable Markdown document (reasoning as a collapsible <details>)."""
    out = [f"# {conversation.title}", ""]
    header = [f"Exported from ExpertDesk on {_iso(time.time())}"]
    if conversation.model_ref:
        header.append(f"model: `{conversation.model_ref}`")
    out += [" · ".join(header), ""]
    if conversation.settings.system_prompt:
        out += ["**System prompt**", "", _quote(conversation.settings.system_prompt), ""]
    for m in messages:
        out += [f"## {m.role.capitalize()}", ""]
        if m.reasoning:
            out += ["<details><summary>Reasoning</summary>", "", m.reasoning.strip(), "", "</details>", ""]
        out += [m.content.rstrip() or "*(empty)*", ""]
        if m.status != "finished":
            note = {"streaming": "unfinished: the app closed while this reply was written",
                    "stopped": "stopped by the user", "error": f"failed: {m.error or 'engine error'}"}[m.status]
            out += [f"*({note})*", ""]
        if m.stats:
            out += [f"<sub>{format_stats(m.stats)}</sub>", ""]
    return "\n".join(out).rstrip() + "\n"


def format_stats(stats: dict[str, Any]) -> str:
    """One line of reply statistics: tokens, TTFT, prefill and decode speed, stop reason, hit rate, SSD GB/token."""
    parts = []
    if stats.get("completion_tokens") is not None:
        parts.append(f"{stats['completion_tokens']} tokens")
    if stats.get("ttft_s") is not None:
        parts.append(f"TTFT {stats['ttft_s']:.2f} s")
    if stats.get("prefill_tok_s") is not None:
        parts.append(f"prefill {stats['prefill_tok_s']:.1f} tok/s")
    if stats.get("decode_tok_s") is not None:
        parts.append(f"decode {stats['decode_tok_s']:.1f} tok/s")
    if stats.get("stop_reason"):
        parts.append(f"stop: {stats['stop_reason']}")
    if stats.get("hit_rate") is not None:
        parts.append(f"hit rate {stats['hit_rate'] * 100:.0f}%")
    if stats.get("ssd_gb_per_token") is not None:
        parts.append(f"SSD {stats['ssd_gb_per_token']:.3g} GB/token")
    return " · ".join(parts)


def _quote(text: str) -> str:
    return "\n".join("> " + line for line in text.splitlines())


def _iso(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(timestamp))


__all__ = [
    "ChatSettings", "Conversation", "HistoryError", "HistoryStore", "Message", "default_history_path",
    "export_json", "export_markdown", "format_stats", "title_from_text",
]
