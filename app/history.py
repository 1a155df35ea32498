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

Faults: every SQLite error leaves this module as a ``HistoryError`` that says what to do;
``HistoryLocked`` (another program holds the lock: try again later, nothing was written),
``HistoryUnwritable`` (the folder or file cannot be written) and ``HistoryCorrupt`` (the
file is damaged) tell the cases apart. ``HistoryStore(..., busy_timeout_s=0)`` never waits
for a lock (the window retries from a timer instead). ``open_history`` is the window's way
in: a damaged file is moved to a backup and a new history started (the rows that can still
be read are copied over), an unwritable one is shown read-only from an in-memory copy, and
anything else falls back to a history in memory, each with a message for the user. A row
with a malformed stats or settings JSON loses only that field, never its conversation.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

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


# A database file up to this size gets a structural check (PRAGMA quick_check) when it is
# opened, so a damaged page is found at start, not halfway through reading a conversation.
QUICK_CHECK_MAX_BYTES = 256 * 2**20
log = logging.getLogger(__name__)


class HistoryError(RuntimeError):
    """The history database cannot be opened or used; the message says why and what to do.

    ``reason``: the underlying cause alone (SQLite's or the system's words), for short messages.
    """

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class HistoryLocked(HistoryError):
    """Another program (or connection) holds the database lock; nothing was written, try again later."""


class HistoryUnwritable(HistoryError):
    """The history's folder or file cannot be created or written (permissions, read-only disk, a file in the way)."""


class HistoryCorrupt(HistoryError):
    """The history file is damaged (or is not a SQLite database)."""


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
    def from_json(cls, text: str | None) -> ChatSettings:
        """Settings stored by any version: unknown keys are ignored, missing keys and values of the wrong
        type (a hand-edited or damaged row) take the defaults."""
        try:
            data = json.loads(text or "{}")
        except (ValueError, TypeError):
            data = {}
        if not isinstance(data, dict):
            return cls()
        defaults = cls()
        kept: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in data and _fits(data[f.name], getattr(defaults, f.name), optional=f.name == "seed"):
                value = data[f.name]
                kept[f.name] = float(value) if isinstance(getattr(defaults, f.name), float) else value
        return cls(**kept)


def _fits(value: Any, default: Any, *, optional: bool = False) -> bool:
    """Whether a stored setting has the type of its default (bool is not a number here)."""
    if value is None:
        return optional
    if isinstance(value, bool) or isinstance(default, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(default, int) or optional:
        return isinstance(value, int)
    return isinstance(value, type(default))


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
    # Set when `content` / `reasoning` hold only the start of the text (messages(preview_chars=...)):
    # the full length in characters; None when the field is complete.
    content_length: int | None = None
    reasoning_length: int | None = None

    @property
    def complete(self) -> bool:
        """Whether content and reasoning are the whole text (not a preview)."""
        return self.content_length is None and self.reasoning_length is None


def default_history_path() -> Path:
    """Where the desktop app keeps its history: ``$EXPERTDESK_DATA_DIR`` or the platformdirs user data dir."""
    override = os.environ.get("EXPERTDESK_DATA_DIR")
    if override:
        return Path(override) / "history.sqlite3"
    from platformdirs import user_data_dir

    return Path(user_data_dir("ExpertDesk", "ExpertDesk")) / "history.sqlite3"


def title_from_text(text: str) -> str:
    """A conversation title from its first user message: the first line, shortened."""
    line = " ".join(text.lstrip()[: TITLE_LENGTH * 20].split())  # a 10 MB message: look at its start only
    if not line:
        return DEFAULT_TITLE
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1].rstrip() + "…"


class HistoryStore:
    """Conversations and messages in one SQLite file (see the module docstring for durability).

    One store belongs to one thread (SQLite's own rule for a connection); the window
    uses it from the GUI thread only.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        autocheckpoint: bool = True,
        busy_timeout_s: float = 5.0,
        open_wait_s: float | None = None,
    ) -> None:
        """Open (or create) the history at `path` (":memory:": a history in memory only).

        ``busy_timeout_s``: how long a call waits for a lock another connection holds before it
        raises ``HistoryLocked`` (0: never waits; the window's store). ``open_wait_s``: the same
        while opening and creating the schema (default: ``busy_timeout_s``).
        """
        self.path = Path(path)
        self.in_memory = str(path) == ":memory:"
        # An in-memory copy of a file that cannot be written (open_history): the file it shows.
        self.read_only_source: Path | None = None
        self._busy_timeout_s = busy_timeout_s
        if not self.in_memory:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise HistoryUnwritable(
                    f"cannot create the folder {self.path.parent} for the chat history: {exc.strerror or exc}",
                    reason=str(exc.strerror or exc),
                ) from exc
        try:
            self._db = _connect(path if self.in_memory else self.path,
                                busy_timeout_s if open_wait_s is None else open_wait_s)
        except sqlite3.Error as exc:
            raise _history_error(exc, self.path, "open") from exc
        try:
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
            elif not self.in_memory:
                self._probe_write()
            self.set_busy_timeout(busy_timeout_s)
        except (sqlite3.Error, HistoryError) as exc:
            self._db.close()
            if isinstance(exc, HistoryError):
                raise
            raise _history_error(exc, self.path, "open") from exc
        # Without WAL (some network filesystems refuse it) a kill can still not lose a
        # commit, but readers block writers; worth knowing, not worth refusing to start.
        self.journal_mode = str(mode).lower()

    # Plumbing -----------------------------------------------------------------
    def _transaction(self) -> _Transaction:
        return _Transaction(self)

    def _probe_write(self) -> None:
        """Find a read-only file or folder at open, not at the first reply (the write is rolled back)."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if isinstance(_history_error(exc, self.path, "open"), HistoryLocked):
                return  # another program is writing: so can we, once it is done
            raise
        try:
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        finally:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")

    def _read(self, sql: str, params: Iterable[Any] = ()) -> list[sqlite3.Row]:
        """Rows of a query; a SQLite failure becomes the HistoryError that explains it."""
        try:
            return self._db.execute(sql, tuple(params)).fetchall()
        except sqlite3.Error as exc:
            raise self._noted(_history_error(exc, self.path, "read")) from exc

    def _error(self, exc: sqlite3.Error) -> HistoryError:
        return self._noted(_history_error(exc, self.path, "write"))

    def _noted(self, error: HistoryError) -> HistoryError:
        """Damage found while running: leave a note, so the next open_history repairs the file."""
        if isinstance(error, HistoryCorrupt) and not self.in_memory:
            try:
                damaged_marker(self.path).write_text(error.reason + "\n", encoding="utf-8")
            except OSError:
                pass
        return error

    def set_busy_timeout(self, seconds: float) -> None:
        """How long later calls wait for another connection's lock (0: fail at once with HistoryLocked)."""
        self._busy_timeout_s = seconds
        self._db.execute(f"PRAGMA busy_timeout={max(0, int(seconds * 1000))}")

    @property
    def busy_timeout_s(self) -> float:
        return self._busy_timeout_s

    def quick_check(self) -> None:
        """Raise HistoryCorrupt if the file's structure is damaged (reads every page: call it at start)."""
        try:
            rows = self._db.execute("PRAGMA quick_check(1)").fetchall()
        except sqlite3.Error as exc:
            raise _history_error(exc, self.path, "check") from exc
        result = str(rows[0][0]) if rows else "ok"
        if result != "ok":
            reason = result.strip().splitlines()[-1].strip()[:200]
            raise HistoryCorrupt(f"the chat history at {self.path} is damaged ({reason})", reason=reason)

    def close(self) -> None:
        """Close the database (a WAL checkpoint folds the log into the main file)."""
        try:
            self._db.close()
        except sqlite3.Error as exc:  # closing never loses a commit; the WAL keeps it
            log.warning("closing the chat history at %s: %s", self.path, exc)

    def checkpoint(self) -> None:
        """Copy the WAL into the database file (PASSIVE: never waits for, nor blocks, a writer).

        Opens its own connection, so any thread may call it while the owner keeps writing.
        """
        if self.journal_mode != "wal" or self.in_memory:
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
        rows = self._read(f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE id = ?", (conversation_id,))
        return _conversation(rows[0]) if rows else None

    def conversations(self, search: str = "", *, limit: int | None = None) -> list[Conversation]:
        """Conversations (titles and settings, never message text), most recently active first.

        ``search`` matches titles and message text; ``limit`` caps how many come back (the newest).
        """
        cap = "" if limit is None else f" LIMIT {max(0, int(limit))}"
        if not search.strip():
            rows = self._read(f"SELECT {_CONVERSATION_COLUMNS} FROM conversations ORDER BY updated_at DESC, id DESC"
                              + cap)
        else:
            pattern = "%" + search.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            rows = self._read(
                f"""SELECT {_CONVERSATION_COLUMNS} FROM conversations c
                   WHERE c.title LIKE ?1 ESCAPE '\\'
                      OR EXISTS (SELECT 1 FROM messages m WHERE m.conversation_id = c.id
                                 AND m.content LIKE ?1 ESCAPE '\\')
                   ORDER BY updated_at DESC, id DESC""" + cap,
                (pattern,),
            )
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
            self._db.execute("UPDATE conversations SET settings = ? WHERE id = ?",
                             (settings.to_json(), conversation_id))

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
        """One message (its whole text), or None."""
        rows = self._read("SELECT * FROM messages WHERE id = ?", (message_id,))
        return _message(rows[0]) if rows else None

    def messages(
        self, conversation_id: int, *, preview_chars: int | None = None, last: int | None = None
    ) -> list[Message]:
        """A conversation's messages in the order they were written.

        ``preview_chars``: read only that many characters of each content and reasoning (what
        a window shows first); a message cut short has ``content_length`` / ``reasoning_length``
        set to its full length and ``message(id)`` reads all of it. ``last``: only the newest N.
        """
        if preview_chars is None:
            columns, params = "*", [conversation_id]
        else:
            columns = ("id, conversation_id, role, status, stats, error, model_ref, created_at, "
                       "substr(content, 1, ?) AS content, length(content) AS full_content, "
                       "substr(reasoning, 1, ?) AS reasoning, length(reasoning) AS full_reasoning")
            params = [int(preview_chars), int(preview_chars), conversation_id]
        if last is None:
            rows = self._read(f"SELECT {columns} FROM messages WHERE conversation_id = ? ORDER BY id", params)
        else:
            rows = self._read(f"SELECT {columns} FROM messages WHERE conversation_id = ? ORDER BY id DESC LIMIT ?",
                              [*params, int(last)])[::-1]
        return [_message(r) for r in rows]

    def message_count(self, conversation_id: int) -> int:
        """How many messages a conversation has."""
        return int(self._read("SELECT count(*) FROM messages WHERE conversation_id = ?", (conversation_id,))[0][0])

    def delete_messages_from(self, conversation_id: int, message_id: int) -> None:
        """Delete a message and everything after it (regenerate, edit-and-resend)."""
        with self._transaction():
            self._db.execute("DELETE FROM messages WHERE conversation_id = ? AND id >= ?",
                             (conversation_id, message_id))


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error): one write lock per change, no surprises.

    A SQLite failure (at BEGIN, in the body or at COMMIT) leaves no transaction open and is
    raised as the HistoryError that explains it (HistoryLocked: nothing was written).
    """

    def __init__(self, store: HistoryStore) -> None:
        self._store = store
        self._db = store._db

    def __enter__(self) -> None:
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise self._store._error(exc) from exc

    def __exit__(self, exc_type: object, exc: BaseException | None, _tb: object) -> None:
        if exc is None:
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error as error:
                self._rollback()
                raise self._store._error(error) from error
            return
        self._rollback()
        if isinstance(exc, sqlite3.Error):
            raise self._store._error(exc) from exc

    def _rollback(self) -> None:
        if self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:  # SQLite rolled back by itself (e.g. after an I/O error)
                pass


def _connect(target: str | os.PathLike, timeout: float, **kwargs: Any) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit); tests replace this to simulate faults."""
    return sqlite3.connect(target, isolation_level=None, timeout=timeout, **kwargs)


def _history_error(exc: sqlite3.Error, path: Path, doing: str) -> HistoryError:
    """The HistoryError for a SQLite failure: locked, unwritable, damaged, or anything else."""
    name = str(getattr(exc, "sqlite_errorname", "") or "")
    text = str(exc)
    lowered = text.lower()
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "database is locked" in lowered \
            or "database table is locked" in lowered:
        return HistoryLocked(f"the chat history at {path} is locked by another program ({text})", reason=text)
    if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")) or "malformed" in lowered \
            or "not a database" in lowered:
        return HistoryCorrupt(f"the chat history at {path} is damaged ({text})", reason=text)
    if name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")) or "readonly" in lowered \
            or "unable to open" in lowered:
        return HistoryUnwritable(f"the chat history at {path} cannot be written ({text})", reason=text)
    if doing == "open":
        return HistoryError(
            f"cannot open the chat history at {path}: {text}. Check that the folder is writable and "
            "the disk is not full; if the file is damaged, move it away and ExpertDesk starts a new one",
            reason=text,
        )
    verb = {"read": "read", "check": "checked"}.get(doing, "written")
    return HistoryError(f"the chat history at {path} cannot be {verb} ({text})", reason=text)


def _check(role: str, status: str) -> None:
    if role not in ROLES:
        raise ValueError(f"message role must be one of {ROLES}, got {role!r}")
    if status not in STATUSES:
        raise ValueError(f"message status must be one of {STATUSES}, got {status!r}")


_CONVERSATION_COLUMNS = "id, title, created_at, updated_at, model_ref, settings"


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(
        row["id"], row["title"], row["created_at"], row["updated_at"], row["model_ref"],
        ChatSettings.from_json(row["settings"]),
    )


def _message(row: sqlite3.Row) -> Message:
    content, reasoning = row["content"] or "", row["reasoning"] or ""
    keys = row.keys()
    full_content = row["full_content"] if "full_content" in keys else None
    full_reasoning = row["full_reasoning"] if "full_reasoning" in keys else None
    return Message(
        row["id"], row["conversation_id"], row["role"], content, reasoning, row["status"],
        row["created_at"], _stats(row["stats"], row["id"]), row["error"], row["model_ref"],
        content_length=full_content if full_content is not None and full_content > len(content) else None,
        reasoning_length=full_reasoning if full_reasoning is not None and full_reasoning > len(reasoning) else None,
    )


def _stats(text: str | None, message_id: int) -> dict[str, Any] | None:
    """A reply's stats, or None if there are none or they cannot be read (the message itself still shows)."""
    if not text:
        return None
    try:
        stats = json.loads(text)
    except (ValueError, TypeError):
        log.warning("message %s: its stats are not valid JSON; shown without stats", message_id)
        return None
    return stats if isinstance(stats, dict) else None


# Opening for the window: damaged, unwritable and other failures -------------------------------
@dataclass
class OpenedHistory:
    """What ``open_history`` opened, and what to tell the user about it.

    ``state``: "ok"; "recovered" (the file was damaged: moved to ``backup``, a new history
    started with whatever could be read); "read-only" (the file cannot be written: an
    in-memory copy shows it, this session's chats stay in memory); "memory" (nothing could
    be opened: a history in memory only). ``message`` is empty for "ok".
    """

    store: HistoryStore
    state: str = "ok"
    message: str = ""
    backup: Path | None = None


def open_history(
    path: str | os.PathLike, *, busy_timeout_s: float = 0.0, open_wait_s: float = 0.0, autocheckpoint: bool = False
) -> OpenedHistory:
    """Open the window's history, never raising: every failure ends in a usable store and a message.

    The store fails fast on a lock (``busy_timeout_s``, 0 by default; the window retries from a
    timer). Opening an existing history needs no lock (WAL readers never wait for a writer);
    ``open_wait_s`` is how long creating a new one may wait for another program's lock.
    """
    path = Path(path)
    options: dict[str, Any] = {"busy_timeout_s": busy_timeout_s, "open_wait_s": open_wait_s,
                               "autocheckpoint": autocheckpoint}
    try:
        store = HistoryStore(path, **options)
    except HistoryCorrupt as exc:
        return _start_over(path, exc, options)
    except HistoryUnwritable as exc:
        return _unwritable(path, exc)
    except HistoryError as exc:
        return OpenedHistory(HistoryStore(":memory:"), "memory",
                             f"{_sentence(exc)} This session's chats are kept in memory only (File > Export saves "
                             "one); they are lost when ExpertDesk closes.")
    marker = damaged_marker(path)
    try:
        if marker.exists():  # a run before found damage (a file too large to check at every start)
            reason = marker.read_text(encoding="utf-8", errors="replace").strip() or "damage found while running"
            raise HistoryCorrupt(f"the chat history at {path} is damaged ({reason})", reason=reason)
        if path.stat().st_size <= QUICK_CHECK_MAX_BYTES:
            store.quick_check()
    except HistoryCorrupt as exc:
        store.close()
        opened = _start_over(path, exc, options)
        if opened.state == "recovered":
            try:
                marker.unlink()
            except OSError:
                pass
        return opened
    except (HistoryError, OSError) as exc:  # a check that could not run proves nothing
        log.warning("could not check the chat history at %s: %s", path, exc)
    return OpenedHistory(store)


def damaged_marker(path: Path) -> Path:
    """The note a store leaves next to a history file it found damaged (the next open repairs it)."""
    return Path(str(path) + ".damaged")


def _sentence(exc: BaseException) -> str:
    text = str(exc).strip()
    text = text[:1].upper() + text[1:]
    return text if text.endswith(".") else text + "."


def _unwritable(path: Path, exc: HistoryError) -> OpenedHistory:
    advice = (f"Make {path.parent} writable, or set EXPERTDESK_DATA_DIR to a writable folder, and restart "
              "ExpertDesk.")
    copy = _read_only_copy(path) if path.is_file() else None
    if copy is not None:
        return OpenedHistory(copy, "read-only",
                             f"The chat history at {path} is read-only: {exc}. Your earlier chats are shown, but "
                             "new chats and replies are kept in memory only this session (File > Export saves "
                             f"one). {advice}")
    return OpenedHistory(HistoryStore(":memory:"), "memory",
                         f"{_sentence(exc)} This session's chats are kept in memory only and are lost when "
                         f"ExpertDesk closes (File > Export saves one). {advice}")


def _read_only_copy(path: Path) -> HistoryStore | None:
    """An in-memory copy of a history file that cannot be written (the file is only read)."""
    quoted = urllib.parse.quote(str(path.resolve()))
    for options in ("mode=ro", "immutable=1"):  # immutable: a WAL file that cannot be opened is ignored
        try:
            source = sqlite3.connect(f"file:{quoted}?{options}", uri=True, timeout=0)
        except sqlite3.Error:
            continue
        try:
            version = source.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                return None
            store = HistoryStore(":memory:")
            source.backup(store._db)
            if version < SCHEMA_VERSION:
                store._db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
            store.read_only_source = path
            return store
        except (sqlite3.Error, HistoryError) as exc:
            log.warning("reading the chat history at %s (%s): %s", path, options, exc)
        finally:
            source.close()
    return None


def _start_over(path: Path, exc: HistoryError, options: dict[str, Any]) -> OpenedHistory:
    """A damaged history: move it (and its WAL) to a backup, start a new one, copy over what can be read."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    backup = path.with_name(f"{path.stem}.damaged-{stamp}{path.suffix}")
    n = 1
    while backup.exists():
        backup = path.with_name(f"{path.stem}.damaged-{stamp}-{n}{path.suffix}")
        n += 1
    try:
        os.replace(path, backup)
        for side in ("-wal", "-shm"):
            if Path(str(path) + side).exists():
                os.replace(str(path) + side, str(backup) + side)
    except OSError as move_error:
        return OpenedHistory(HistoryStore(":memory:"), "memory",
                             f"{_sentence(exc)} It could not be moved aside to start a new one "
                             f"({move_error.strerror or move_error}), so this session's chats are kept in memory "
                             f"only. Move {path} away by hand and restart ExpertDesk.")
    try:
        store = HistoryStore(path, **options)
    except HistoryError as new_error:
        return OpenedHistory(HistoryStore(":memory:"), "memory",
                             f"{_sentence(exc)} It was moved to {backup}, but a new history could not be started "
                             f"({new_error}); this session's chats are kept in memory only.", backup)
    conversations, messages = _salvage(backup, store)
    kept = (f"{conversations} conversation{'s' * (conversations != 1)} and {messages} "
            f"message{'s' * (messages != 1)} could still be read and were copied into the new history"
            if conversations else "nothing in it could still be read")
    log.warning("damaged chat history moved to %s (%s); %s", backup, exc, kept)
    return OpenedHistory(store, "recovered",
                         f"The chat history file was damaged ({exc.reason}). ExpertDesk moved it to {backup} "
                         f"(kept as a backup) and started a new history; {kept}.", backup)


def _salvage(backup: Path, store: HistoryStore) -> tuple[int, int]:
    """Copy the rows of a damaged file that can still be read into a new store: (conversations, messages)."""
    try:
        source = sqlite3.connect(f"file:{urllib.parse.quote(str(backup.resolve()))}?mode=ro", uri=True, timeout=0)
    except sqlite3.Error:
        return 0, 0
    source.row_factory = sqlite3.Row
    try:
        conversations = _readable_rows(source, "conversations")
        messages = _readable_rows(source, "messages")
    finally:
        source.close()
    copied_conversations = copied_messages = 0
    db = store._db
    db.execute("BEGIN IMMEDIATE")
    try:
        for row in conversations:
            try:
                db.execute("INSERT INTO conversations (id, title, created_at, updated_at, model_ref, settings) "
                           "VALUES (?, ?, ?, ?, ?, ?)",
                           (row["id"], row["title"], row["created_at"], row["updated_at"], row["model_ref"],
                            row["settings"] if isinstance(row["settings"], str) else "{}"))
                copied_conversations += 1
            except (sqlite3.Error, IndexError):
                continue
        for row in messages:
            try:
                db.execute("INSERT INTO messages (id, conversation_id, role, content, reasoning, stats, status, error, "
                           "model_ref, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                           tuple(row[k] for k in ("id", "conversation_id", "role", "content", "reasoning", "stats",
                                                  "status", "error", "model_ref", "created_at", "updated_at")))
                copied_messages += 1
            except (sqlite3.Error, IndexError):
                continue
        db.execute("COMMIT")
    except sqlite3.Error:
        if db.in_transaction:
            db.execute("ROLLBACK")
        return 0, 0
    return copied_conversations, copied_messages


def _readable_rows(db: sqlite3.Connection, table: str, *, attempts: int = 64) -> list[sqlite3.Row]:
    """The rows of `table` in rowid order that can be read, stepping over damaged pages."""
    rows: list[sqlite3.Row] = []
    after, step = 0, 1
    while attempts > 0:
        try:
            for row in db.execute(f"SELECT rowid AS _rowid, * FROM {table} WHERE rowid > ? ORDER BY rowid", (after,)):
                rows.append(row)
                after, step = row["_rowid"], 1
            return rows
        except sqlite3.Error:
            attempts -= 1
            after += step  # skip past the damaged page, further each time it is still there
            step *= 2
    return rows


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
    """One line of reply statistics: tokens, TTFT, prefill and decode speed, stop reason, hit rate, SSD GB/token.

    A value of the wrong type (a damaged or hand-edited row) is left out, never an error.
    """
    def number(key: str) -> float | None:
        value = stats.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return value

    parts = []
    if (tokens := number("completion_tokens")) is not None:
        parts.append(f"{tokens} tokens")
    if (ttft := number("ttft_s")) is not None:
        parts.append(f"TTFT {ttft:.2f} s")
    if (prefill := number("prefill_tok_s")) is not None:
        parts.append(f"prefill {prefill:.1f} tok/s")
    if (decode := number("decode_tok_s")) is not None:
        parts.append(f"decode {decode:.1f} tok/s")
    if isinstance(stats.get("stop_reason"), str) and stats["stop_reason"]:
        parts.append(f"stop: {stats['stop_reason']}")
    if (hit_rate := number("hit_rate")) is not None:
        parts.append(f"hit rate {hit_rate * 100:.0f}%")
    if (ssd := number("ssd_gb_per_token")) is not None:
        parts.append(f"SSD {ssd:.3g} GB/token")
    return " · ".join(parts)


def _quote(text: str) -> str:
    return "\n".join("> " + line for line in text.splitlines())


def _iso(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(timestamp))


__all__ = [
    "ChatSettings", "Conversation", "HistoryCorrupt", "HistoryError", "HistoryLocked", "HistoryStore",
    "HistoryUnwritable", "Message", "OpenedHistory", "default_history_path", "open_history",
    "export_json", "export_markdown", "format_stats", "title_from_text",
]
