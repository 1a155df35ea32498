"""The chat flow: send, stream, stop, regenerate, edit-and-resend, and saving it all to the history.

Durability rule (see ``app.history``): every user message is committed before it is
shown, and every batch of reply text is committed before it is rendered, so whatever
the window shows as sent or written survives a crash or a kill. A reply's row is
created with status "streaming" when it starts and gets its final status (finished,
stopped, error) and stats when it ends.

When the history refuses a write (another program holds the database lock, the disk is
full) nothing is lost and nothing waits: the reply goes on in memory, its writes queue in
a ``SaveQueue`` that retries from a GUI-thread timer (never a sleep, never SQLite's busy
wait), the banner says that saving is delayed, and the text appears on screen as soon as
it is saved. A new message cannot be sent while earlier writes wait (it stays in the box).
Closing the window tries once more (waiting up to ``SHUTDOWN_SAVE_WAIT_S``) and writes
whatever is still unsaved to ``unsaved-replies-*.json`` next to the database.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

from app.gui.chat_view import PREVIEW_CHARS, ChatView, MessageWidget
from app.gui.composer import Composer
from app.gui.conversation_list import ConversationList
from app.gui.conversation_settings import ConversationSettingsPanel
from app.gui.engine_bridge import EngineBridge
from app.gui.status_panel import EngineStatus
from app.history import ChatSettings, HistoryCorrupt, HistoryError, HistoryLocked, HistoryStore, Message
from engine.service_events import DoneEvent, ErrorEvent, GenerateRequest, PhaseEvent
from engine.text.sampling import SamplingParams

SUBMIT_FALLBACK_MS = 150
RETRY_FIRST_MS = 100  # a refused write is tried again after this, then twice as late each time ...
RETRY_MAX_MS = 2000  # ... up to this
LONG_WAIT_S = 30.0  # saving delayed this long: the banner says what to close
SHUTDOWN_SAVE_WAIT_S = 2.0  # closing the window: how long the last try may wait for the lock
TRANSCRIPT_PAGE = 200  # messages shown when a conversation opens; "Show earlier messages" adds as many

log = logging.getLogger(__name__)


@dataclass
class ActiveReply:
    """The reply being generated now (at most one at a time)."""

    request_id: str
    conversation_id: int
    message_id: int
    content: str = ""  # everything received so far (in memory, saved or not)
    reasoning: str = ""
    flushes: int = 0
    submitted: bool = False  # handed to the engine (see _start_reply)
    shown_content: str = ""  # what is saved, and so what the window shows
    shown_reasoning: str = ""


@dataclass
class _Write:
    apply: Callable[[], None]
    done: Callable[[], None] | None
    fields: dict[str, Any]  # a message row's columns, merged over queued updates
    record: dict[str, Any]  # what the recovery file keeps if it is never saved


class SaveQueue(QObject):
    """History writes the database refused for now (locked, disk full), retried from a GUI-thread timer.

    A write goes through at once when nothing waits; otherwise it queues behind the earlier
    ones (order kept; a newer state of the same row replaces the queued one in its place).
    ``done`` runs once the write is committed, and is where the caller shows what was
    written: what is on screen is always what is saved. A retry never sleeps or waits on
    the lock (the store's busy timeout is 0): a single-shot QTimer with backoff calls ``retry``.
    """

    stateChanged = Signal(str)  # why saving waits, for the banner; "" once everything is saved

    def __init__(self, history: HistoryStore, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.history = history
        self._pending: dict[tuple, _Write] = {}
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self.retry)
        self._delay_ms = RETRY_FIRST_MS
        self._since: float | None = None
        self.last_error: HistoryError | None = None

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def has(self, key: tuple) -> bool:
        return key in self._pending

    def update_message(self, message_id: int, *, done: Callable[[], None] | None = None, **fields: Any) -> bool:
        """``HistoryStore.update_message`` now or later; True if it is committed already (``done`` has run)."""
        key = ("message", message_id)
        queued = self._pending.get(key)
        merged = {**(queued.fields if queued else {}), **fields}

        def apply() -> None:
            self.history.update_message(message_id, **merged)

        return self._submit(key, _Write(apply, done, merged, {"message_id": message_id, **merged}))

    def call(self, key: tuple, apply: Callable[[], None], *, record: dict[str, Any] | None = None,
             done: Callable[[], None] | None = None) -> bool:
        """Any other idempotent write (settings, model), keyed so a newer one replaces a queued one."""
        return self._submit(key, _Write(apply, done, {}, record or {"write": key[0]}))

    def _submit(self, key: tuple, write: _Write) -> bool:
        if self._pending:  # earlier writes wait: this one goes after them
            self._pending[key] = write
            return False
        try:
            write.apply()
        except HistoryError as exc:
            self._pending[key] = write
            self._failed(exc)
            return False
        _run(write.done)
        return True

    def retry(self) -> None:
        """Write what waits, in order, until the history refuses again (then the timer tries later)."""
        while self._pending:
            key, write = next(iter(self._pending.items()))
            try:
                write.apply()
            except HistoryError as exc:
                self._failed(exc)
                return
            del self._pending[key]
            _run(write.done)
        self._timer.stop()
        self._delay_ms = RETRY_FIRST_MS
        if self._since is not None:
            self._since = None
            self.last_error = None
            self.stateChanged.emit("")

    def _failed(self, exc: HistoryError) -> None:
        if self._since is None:
            self._since = time.monotonic()
            log.warning("saving to the chat history is delayed: %s", exc)
        self.last_error = exc
        self.stateChanged.emit(self.describe())
        self._timer.start(self._delay_ms)
        self._delay_ms = min(RETRY_MAX_MS, self._delay_ms * 2)

    def describe(self) -> str:
        """Why saving waits and what the user can do (empty when nothing waits)."""
        exc = self.last_error
        if not self._pending or exc is None:
            return ""
        waited = time.monotonic() - (self._since or time.monotonic())
        if isinstance(exc, HistoryLocked):
            text = (f"Saving is delayed: the chat history ({self.history.path}) is locked by another program. "
                    "Replies are kept in memory and appear here as soon as they are saved; ExpertDesk keeps "
                    "trying every few seconds.")
            if waited >= LONG_WAIT_S:
                text += (f" Still locked after {waited:.0f} s: close the program that has the file open (a "
                         "database browser, a backup or sync tool, another ExpertDesk).")
            return text
        if isinstance(exc, HistoryCorrupt):
            return (f"Saving failed: {exc}. Replies are kept in memory until ExpertDesk closes; restart it to move "
                    "the damaged file to a backup and start a new history (the chats that can still be read are "
                    "copied over).")
        return (f"Saving is delayed: {exc}. Replies are kept in memory and saved as soon as the history can be "
                "written again (free some disk space, or check the folder's permissions).")

    def flush_at_exit(self, wait_s: float) -> Path | None:
        """The window closes: one last try (waiting up to ``wait_s`` for a lock), then a recovery file.

        Returns the recovery file written for what still could not be saved (None: all saved).
        """
        if not self._pending:
            return None
        self._timer.stop()
        previous = self.history.busy_timeout_s
        try:
            self.history.set_busy_timeout(wait_s)
            self.retry()
        except Exception as exc:  # closing must go on whatever happens here
            log.warning("last try to save the chat history failed: %s", exc)
        finally:
            try:
                self.history.set_busy_timeout(previous)
            except Exception:  # the store may be unusable by now
                pass
        self._timer.stop()
        return self._write_recovery_file() if self._pending else None

    def _write_recovery_file(self) -> Path | None:
        records = [w.record for w in self._pending.values()]
        data = {
            "format": "expertdesk-unsaved",
            "version": 1,
            "database": str(self.history.path),
            "reason": str(self.last_error or ""),
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "messages": [r for r in records if "message_id" in r],
            "other": [r for r in records if "message_id" not in r],
        }
        name = f"unsaved-replies-{time.strftime('%Y%m%d-%H%M%S')}.json"
        folders = ([] if self.history.in_memory else [self.history.path.parent]) + [Path(tempfile.gettempdir())]
        for folder in folders:
            target = folder / name
            try:
                target.write_text(json.dumps(data, ensure_ascii=False, indent=1, default=str), encoding="utf-8")
            except OSError:
                continue
            log.warning("the chat history could not be written (%s); what was not saved is in %s",
                        self.last_error, target)
            return target
        log.error("the chat history could not be written and no recovery file either; unsaved: %s",
                  json.dumps(data, ensure_ascii=False, default=str))
        return None


def _run(callback: Callable[[], None] | None) -> None:
    if callback is None:
        return
    try:
        callback()
    except Exception:  # showing what was saved must never undo the save or stop the queue
        log.exception("updating the window after a history write failed")


def sampling_params(settings: ChatSettings) -> SamplingParams:
    """The engine's sampling parameters for a conversation's settings (temperature 0 = greedy)."""
    return SamplingParams(
        temperature=float(settings.temperature),
        top_p=float(settings.top_p),
        top_k=int(settings.top_k),
        max_tokens=int(settings.max_tokens),
        seed=settings.seed,
    )


def chat_messages(settings: ChatSettings, messages: list[Message]) -> list[dict]:
    """What the model sees: the system prompt, then every user turn and reply that has text.

    Failed replies are left out (they hold no model text); stopped or interrupted
    replies stay, as far as they got. Reasoning is never sent back (the chat templates
    of reasoning models drop it from earlier turns).
    """
    out: list[dict] = []
    if settings.system_prompt.strip():
        out.append({"role": "system", "content": settings.system_prompt})
    for m in messages:
        if m.role == "assistant" and (m.status == "error" or not m.content.strip()):
            continue
        if m.role in ("user", "assistant"):
            out.append({"role": m.role, "content": m.content})
    return out


class ChatController(QObject):
    """Connects the transcript, the composer and the engine bridge through the history store."""

    conversationChanged = Signal(object)  # conversation id or None (a new, unsaved chat)
    busyChanged = Signal(bool)
    notice = Signal(str)  # short status-bar notes ("Copied code block 1")
    replyFinished = Signal(int)  # message id, after it was saved and shown
    historyStateChanged = Signal(str)  # what is wrong with the history now (banner text), "" when nothing

    def __init__(
        self,
        history: HistoryStore,
        bridge: EngineBridge | None,
        view: ChatView,
        composer: Composer,
        status: EngineStatus,
        settings_panel: ConversationSettingsPanel,
        conversations: ConversationList,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.history = history
        self.bridge = bridge
        self.view = view
        self.composer = composer
        self.status = status
        self.settings_panel = settings_panel
        self.conversations = conversations
        self.current_id: int | None = None
        self.active: ActiveReply | None = None
        self.unavailable_reason = "" if bridge else "the engine is not available"
        self.saves = SaveQueue(history, self)
        self.saves.stateChanged.connect(self._on_save_state)
        self._history_problem = ""  # damage found while running (stays until restart)
        self._transcript_limit = TRANSCRIPT_PAGE
        # WAL checkpoints (an fsync) run here, never on the GUI thread.
        self._checkpointer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="history-checkpoint")
        view.message_loader = self._load_message
        composer.sendRequested.connect(self.send)
        composer.stopRequested.connect(self.stop)
        view.editSubmitted.connect(self.edit_and_resend)
        view.regenerateRequested.connect(lambda _mid: self.regenerate())
        view.copied.connect(lambda what: self.notice.emit(f"Copied {what}"))
        view.problem.connect(self.notice)
        view.earlierRequested.connect(self.show_earlier)
        settings_panel.settingsChanged.connect(self._store_settings)
        conversations.conversationSelected.connect(self.open_conversation)
        conversations.newRequested.connect(self.new_chat)
        conversations.conversationDeleted.connect(self._on_deleted)
        conversations.conversationRenamed.connect(lambda cid: self.conversationChanged.emit(self.current_id))
        conversations.historyFailed.connect(self.report_history_error)
        if bridge is not None:
            bridge.textArrived.connect(self._on_text)
            bridge.replyDone.connect(self._on_done)
            bridge.replyFailed.connect(self._on_failed)
            bridge.phaseChanged.connect(self._on_phase)
            bridge.snapshotTaken.connect(self._on_snapshot)

    # State ---------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.active is not None

    def unsaved_count(self) -> int:
        """History writes that wait for the database (0: everything on screen is saved and nothing waits)."""
        return len(self.saves)

    def _saves_waiting(self) -> bool:
        """Whether earlier writes still wait for the history (tries them once more first, without waiting)."""
        if self.saves.pending:
            self.saves.retry()
        return self.saves.pending

    def can_send(self) -> tuple[bool, str]:
        """Whether a message can be sent now, and if not, why (for the Send button's tooltip)."""
        if self.bridge is None:
            return False, f"Cannot send: {self.unavailable_reason}."
        if self.bridge.loaded is None:
            if self.bridge.loading_ref:
                return False, "The model is still loading; Send works as soon as it is ready."
            return False, "No model is loaded: pick one in the model list at the top."
        return True, ""

    # History faults ------------------------------------------------------------------
    def report_history_error(self, exc: HistoryError, doing: str) -> None:
        """`doing` did not happen because of the history: say so (the window stays usable)."""
        if isinstance(exc, HistoryLocked):
            self.notice.emit(f"{doing}: the chat history is locked by another program; try again in a moment.")
        else:
            self.notice.emit(f"{doing}: {exc.reason}")
        log.warning("%s: %s", doing, exc)
        if isinstance(exc, HistoryCorrupt) and not self._history_problem:
            self._history_problem = (
                f"The chat history file is damaged ({exc.reason}). What is on screen stays; restart ExpertDesk "
                "to move the damaged file to a backup and start a new history (the chats that can still be read "
                "are copied over).")
            self._emit_history_state()

    def history_state(self) -> str:
        """What is wrong with the history now, for the banner ("" when nothing)."""
        return " ".join(text for text in (self._history_problem, self.saves.describe()) if text)

    def _emit_history_state(self) -> None:
        self.historyStateChanged.emit(self.history_state())

    def _on_save_state(self, text: str) -> None:
        self._emit_history_state()
        if not text:
            self.notice.emit("Saved: everything on screen is in the chat history again.")

    def _load_message(self, message_id: int) -> Message | None:
        try:
            return self.history.message(message_id)
        except HistoryError as exc:
            self.report_history_error(exc, "The whole message cannot be read")
            return None

    def _stored(self, message_id: int, widget: MessageWidget, fields: dict[str, Any]) -> Message | None:
        """A message as saved (read back; if reading fails, what was just written)."""
        try:
            return self.history.message(message_id)
        except HistoryError:
            return replace(widget.message, **fields, content_length=None, reasoning_length=None)

    # Conversations ---------------------------------------------------------------
    def new_chat(self) -> None:
        """Show an empty chat; it is saved when the first message is sent."""
        self.current_id = None
        self.view.clear()
        self.settings_panel.set_settings(ChatSettings())
        self.conversations.list.clearSelection()
        self.conversations.list.setCurrentItem(None)
        self.composer.edit.setFocus()
        self.conversationChanged.emit(None)

    def open_conversation(self, conversation_id: int) -> None:
        """Show a stored conversation (a reply still streaming into it keeps streaming on screen)."""
        try:
            conversation = self.history.conversation(conversation_id)
        except HistoryError as exc:
            self.report_history_error(exc, "This chat cannot be opened")
            return
        if conversation is None:
            self.new_chat()
            return
        self.settings_panel.flush()
        self.current_id = conversation_id
        self._transcript_limit = TRANSCRIPT_PAGE
        self.settings_panel.set_settings(conversation.settings)
        self._rebuild_view()
        self.conversationChanged.emit(conversation_id)

    def show_earlier(self) -> None:
        """Show another page of older messages above the ones shown."""
        self._transcript_limit += TRANSCRIPT_PAGE
        self._rebuild_view(at_bottom=False)

    def _rebuild_view(self, *, at_bottom: bool = True) -> None:
        self.view.clear()
        if self.current_id is None:
            return
        try:
            # Previews only: a 10 MB message is read (and rendered) in full only when asked for.
            messages = self.history.messages(self.current_id, preview_chars=PREVIEW_CHARS,
                                             last=self._transcript_limit)
            total = (self.history.message_count(self.current_id) if len(messages) >= self._transcript_limit
                     else len(messages))
        except HistoryError as exc:
            self.report_history_error(exc, "This chat cannot be shown")
            return
        self.view.set_earlier(total - len(messages))
        for message in messages:
            widget = self.view.add_message(message)
            if self.active and message.id == self.active.message_id:
                widget.begin_stream()
                widget.stream_update(self.active.shown_content, self.active.shown_reasoning)
            elif self.saves.has(("message", message.id)):
                widget.begin_stream()  # its end is not saved yet: no "interrupted" note meanwhile
        self._update_actions()
        if at_bottom:
            self.view.scroll_to_bottom()
        else:
            self.view.scroll_to_top()

    def _on_deleted(self, conversation_id: int) -> None:
        if self.active and self.active.conversation_id == conversation_id:
            self.stop()
        if conversation_id == self.current_id:
            self.new_chat()

    def _store_settings(self, settings: ChatSettings) -> None:
        if self.current_id is not None:
            conversation_id = self.current_id
            self.saves.call(("settings", conversation_id),
                            lambda: self.history.update_settings(conversation_id, settings),
                            record={"conversation_id": conversation_id, "settings": asdict(settings)})

    # Sending ---------------------------------------------------------------------
    def send(self, text: str) -> bool:
        """Save and show the user's message, then start the reply. False if it cannot be sent now."""
        text = text.strip()
        ok, why = self.can_send()
        if not text or self.busy or not ok:
            if why:
                self.notice.emit(why)
            return False
        if self._saves_waiting():
            self.notice.emit("Not sent yet: the last reply is still waiting to be saved (see the message above). "
                             "Your message stays in the box.")
            return False
        self.settings_panel.flush()
        try:
            if self.current_id is None:
                conversation = self.history.create_conversation(settings=self.settings_panel.settings(),
                                                                model_ref=self.bridge.model_ref)
                self.current_id = conversation.id
            message = self.history.add_message(self.current_id, "user", text)  # committed before it is shown
        except HistoryError as exc:
            self.report_history_error(exc, "Not sent (your message is still in the box)")
            return False
        self.view.add_message(message)
        self.composer.set_text("")
        self.conversations.select_quietly(self.current_id)
        self.conversationChanged.emit(self.current_id)
        self._start_reply()
        return True

    def _start_reply(self) -> bool:
        conversation_id = self.current_id
        model_ref = self.bridge.model_ref
        try:
            conversation = self.history.conversation(conversation_id)
            settings = conversation.settings
            messages = chat_messages(settings, self.history.messages(conversation_id))
            reply = self.history.add_message(conversation_id, "assistant", "", status="streaming",
                                             model_ref=model_ref)
        except HistoryError as exc:
            self.report_history_error(exc, "The reply was not started (Ctrl+Shift+R tries again)")
            self._update_actions()
            return False
        self.saves.call(("model", conversation_id), lambda: self.history.set_model(conversation_id, model_ref),
                        record={"conversation_id": conversation_id, "model_ref": model_ref})
        widget = self.view.add_message(reply)
        widget.begin_stream()
        self.view.scroll_to_bottom()
        try:
            request = GenerateRequest(messages=messages, sampling=sampling_params(settings), thinking=settings.thinking)
        except ValueError as exc:  # settings the engine refuses: say so on the reply, keep the app usable
            self._refuse(reply.id, exc)
            return False
        self.active = ActiveReply(request.request_id, conversation_id, reply.id)
        self.status.start("prefill")
        self._update_actions()
        self.busyChanged.emit(True)
        # Start the engine once the new messages are on screen: from then on it competes
        # with the GUI thread for the GIL, and laying out and painting fresh widgets during
        # prefill stutters (measured 110-150 ms instead of 20). The timer covers a window
        # that is not painted at all (minimised).
        widget.firstPainted.connect(lambda: QTimer.singleShot(0, lambda: self._submit(request)))
        QTimer.singleShot(SUBMIT_FALLBACK_MS, lambda: self._submit(request))
        return True

    def _submit(self, request: GenerateRequest) -> None:
        active = self.active
        if active is None or active.request_id != request.request_id or active.submitted:
            return
        active.submitted = True
        try:
            self.bridge.submit(request)
        except Exception as exc:  # a refused request: show it on the reply, keep the app usable
            self.active = None
            self.status.stop("Reply not started")
            self._refuse(active.message_id, exc)
            self.busyChanged.emit(False)

    def _refuse(self, message_id: int, exc: Exception) -> None:
        error = f"The reply could not be started: {exc}. Check the conversation settings and try again."

        def saved() -> None:
            widget = self.view.widget_for(message_id)
            if widget is not None:
                message = self._stored(message_id, widget, {"status": "error", "error": error})
                if message is not None:
                    widget.finish(message)
            self._update_actions()

        self.saves.update_message(message_id, status="error", error=error, done=saved)
        self._update_actions()

    def stop(self) -> None:
        """Stop the reply being written (it ends as "stopped" with the text so far)."""
        if self.active and self.bridge is not None:
            self.bridge.cancel(self.active.request_id)
            self.notice.emit("Stopping…")

    def regenerate(self) -> bool:
        """Replace the last reply of the current conversation with a new one."""
        if self.busy or self.current_id is None or not self.can_send()[0]:
            return False
        if self._saves_waiting():
            self.notice.emit("Wait until the last reply is saved (see the message above), then regenerate.")
            return False
        try:
            messages = self.history.messages(self.current_id, preview_chars=1, last=1)  # its role and id only
            if not messages:
                return False
            last = messages[-1]
            if last.role == "assistant":
                self.history.delete_messages_from(self.current_id, last.id)
        except HistoryError as exc:
            self.report_history_error(exc, "Not regenerated")
            return False
        if last.role == "assistant":
            widget = self.view.widget_for(last.id)
            if widget is not None:
                self.view.widgets.remove(widget)
                widget.setParent(None)
                widget.deleteLater()
        elif last.role != "user":
            return False
        self._start_reply()
        return True

    def edit_and_resend(self, message_id: int, text: str) -> bool:
        """Replace a user message (and everything after it) with an edited one, and send it."""
        if self.busy or self.current_id is None or not self.can_send()[0]:
            self.notice.emit("Wait for the reply to finish (or press Stop) before editing.")
            return False
        if self._saves_waiting():
            self.composer.set_text(text)
            self.notice.emit("Not sent yet: the last reply is still waiting to be saved. Your edited text is in "
                             "the box.")
            return False
        try:
            self.history.delete_messages_from(self.current_id, message_id)
        except HistoryError as exc:
            self.composer.set_text(text)
            self.report_history_error(exc, "Not sent (your edited text is in the box)")
            return False
        self._rebuild_view()
        if not self.send(text):
            self.composer.set_text(text)  # nothing typed is lost
            return False
        return True

    # Engine events (GUI thread, via the bridge) -------------------------------------
    def _on_phase(self, event: PhaseEvent) -> None:
        if self.active and event.request_id == self.active.request_id:
            self.status.show_phase(event)

    def _on_snapshot(self, snap: dict) -> None:
        # The engine reports decoding progress through snapshots, not one event per token.
        if self.active and snap.get("request_id") == self.active.request_id and snap.get("phase") == "decoding":
            self.status.show_phase(PhaseEvent(self.active.request_id, "decoding",
                                              int(snap.get("completion_tokens", 0) or 0),
                                              int(snap.get("total", 0) or 0)))

    def _on_text(self, request_id: str, text: str, reasoning: str) -> None:
        active = self.active
        if active is None or request_id != active.request_id or not (text or reasoning):
            return
        active.content += text
        active.reasoning += reasoning
        active.flushes += 1
        content, reasoning_so_far = active.content, active.reasoning

        def shown() -> None:
            active.shown_content, active.shown_reasoning = content, reasoning_so_far
            widget = self._active_widget() if self.active is active else None
            if widget is not None:
                widget.stream_update(content, reasoning_so_far)

        # Saved before it is shown: a kill after the commit loses nothing on screen. If the
        # history refuses it now, the text waits in memory and `shown` runs once it is saved.
        self.saves.update_message(active.message_id, content=content, reasoning=reasoning_so_far, done=shown)
        self.status.note_progress()

    def _on_done(self, event: DoneEvent) -> None:
        active = self.active
        if active is None or event.request_id != active.request_id:
            return
        stats = asdict(event.stats)
        status = "stopped" if event.stats.stop_reason == "cancelled" else "finished"
        content = event.text if event.text or not active.content else active.content
        reasoning = event.reasoning if event.reasoning or not active.reasoning else active.reasoning
        self._end_reply(f"Stopped · {event.stats.completion_tokens} tokens" if status == "stopped"
                        else f"Done · {event.stats.completion_tokens} tokens · stop: {event.stats.stop_reason}",
                        content=content, reasoning=reasoning, status=status, stats=stats)

    def _on_failed(self, event: ErrorEvent) -> None:
        active = self.active
        if active is None or event.request_id != active.request_id:
            return
        self._end_reply(f"Reply failed ({event.kind})", content=active.content, reasoning=active.reasoning,
                        status="error", error=event.message)

    def _end_reply(self, status_text: str, **fields: Any) -> None:
        """The engine is done with the reply: free the window now, show the end once it is saved."""
        active, self.active = self.active, None
        message_id = active.message_id

        def saved() -> None:
            widget = self.view.widget_for(message_id) if active.conversation_id == self.current_id else None
            if widget is not None:
                message = self._stored(message_id, widget, fields)
                if message is not None:
                    widget.finish(message)
            self.conversations.refresh()
            self._update_actions()
            self._checkpointer.submit(self.history.checkpoint)
            self.replyFinished.emit(message_id)

        self.status.stop(status_text)
        self._update_actions()
        self.busyChanged.emit(False)
        if not self.saves.update_message(message_id, done=saved, **fields):
            self.status.stop(f"{status_text} · not saved yet")

    def shutdown(self) -> None:
        """Save what waits (or write it to a recovery file), then wait for a running checkpoint."""
        self.saves.flush_at_exit(SHUTDOWN_SAVE_WAIT_S)
        self._checkpointer.shutdown(wait=True)

    def _active_widget(self) -> MessageWidget | None:
        if self.active is None or self.active.conversation_id != self.current_id:
            return None
        return self.view.widget_for(self.active.message_id)

    def _update_actions(self) -> None:
        busy = self.busy
        self.composer.set_generating(busy)
        self.view.set_editing_enabled(not busy)
        target = None
        if not busy and self.view.widgets and self.view.widgets[-1].role == "assistant":
            target = self.view.widgets[-1].message_id
        self.view.set_regenerate_target(target)
