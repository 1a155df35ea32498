"""The chat flow: send, stream, stop, regenerate, edit-and-resend, and saving it all to the history.

Durability rule (see ``app.history``): every user message is committed before it is
shown, and every batch of reply text is committed before it is rendered, so whatever
the window shows as sent or written survives a crash or a kill. A reply's row is
created with status "streaming" when it starts and gets its final status (finished,
stopped, error) and stats when it ends.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from PySide6.QtCore import QObject, QTimer, Signal

from app.gui.chat_view import ChatView, MessageWidget
from app.gui.composer import Composer
from app.gui.conversation_list import ConversationList
from app.gui.conversation_settings import ConversationSettingsPanel
from app.gui.engine_bridge import EngineBridge
from app.gui.status_panel import EngineStatus
from app.history import ChatSettings, HistoryStore, Message
from engine.service_events import DoneEvent, ErrorEvent, GenerateRequest, PhaseEvent
from engine.text.sampling import SamplingParams

SUBMIT_FALLBACK_MS = 150


@dataclass
class ActiveReply:
    """The reply being generated now (at most one at a time)."""

    request_id: str
    conversation_id: int
    message_id: int
    content: str = ""
    reasoning: str = ""
    flushes: int = 0
    submitted: bool = False  # handed to the engine (see _start_reply)


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
        # WAL checkpoints (an fsync) run here, never on the GUI thread.
        self._checkpointer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="history-checkpoint")
        composer.sendRequested.connect(self.send)
        composer.stopRequested.connect(self.stop)
        view.editSubmitted.connect(self.edit_and_resend)
        view.regenerateRequested.connect(lambda _mid: self.regenerate())
        view.copied.connect(lambda what: self.notice.emit(f"Copied {what}"))
        settings_panel.settingsChanged.connect(self._store_settings)
        conversations.conversationSelected.connect(self.open_conversation)
        conversations.newRequested.connect(self.new_chat)
        conversations.conversationDeleted.connect(self._on_deleted)
        conversations.conversationRenamed.connect(lambda cid: self.conversationChanged.emit(self.current_id))
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

    def can_send(self) -> tuple[bool, str]:
        """Whether a message can be sent now, and if not, why (for the Send button's tooltip)."""
        if self.bridge is None:
            return False, f"Cannot send: {self.unavailable_reason}."
        if self.bridge.loaded is None:
            if self.bridge.loading_ref:
                return False, "The model is still loading; Send works as soon as it is ready."
            return False, "No model is loaded: pick one in the model list at the top."
        return True, ""

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
        conversation = self.history.conversation(conversation_id)
        if conversation is None:
            self.new_chat()
            return
        self.settings_panel.flush()
        self.current_id = conversation_id
        self.settings_panel.set_settings(conversation.settings)
        self._rebuild_view()
        self.conversationChanged.emit(conversation_id)

    def _rebuild_view(self) -> None:
        self.view.clear()
        if self.current_id is None:
            return
        for message in self.history.messages(self.current_id):
            widget = self.view.add_message(message)
            if self.active and message.id == self.active.message_id:
                widget.begin_stream()
                widget.stream_update(self.active.content, self.active.reasoning)
        self._update_actions()
        self.view.scroll_to_bottom()

    def _on_deleted(self, conversation_id: int) -> None:
        if self.active and self.active.conversation_id == conversation_id:
            self.stop()
        if conversation_id == self.current_id:
            self.new_chat()

    def _store_settings(self, settings: ChatSettings) -> None:
        if self.current_id is not None:
            self.history.update_settings(self.current_id, settings)

    # Sending ---------------------------------------------------------------------
    def send(self, text: str) -> bool:
        """Save and show the user's message, then start the reply. False if it cannot be sent now."""
        text = text.strip()
        ok, why = self.can_send()
        if not text or self.busy or not ok:
            if why:
                self.notice.emit(why)
            return False
        self.settings_panel.flush()
        if self.current_id is None:
            conversation = self.history.create_conversation(settings=self.settings_panel.settings(),
                                                            model_ref=self.bridge.model_ref)
            self.current_id = conversation.id
        message = self.history.add_message(self.current_id, "user", text)  # committed before it is shown
        self.view.add_message(message)
        self.composer.set_text("")
        self.conversations.select_quietly(self.current_id)
        self.conversationChanged.emit(self.current_id)
        self._start_reply()
        return True

    def _start_reply(self) -> None:
        conversation_id = self.current_id
        conversation = self.history.conversation(conversation_id)
        settings = conversation.settings
        messages = chat_messages(settings, self.history.messages(conversation_id))
        reply = self.history.add_message(conversation_id, "assistant", "", status="streaming",
                                         model_ref=self.bridge.model_ref)
        self.history.set_model(conversation_id, self.bridge.model_ref)
        widget = self.view.add_message(reply)
        widget.begin_stream()
        self.view.scroll_to_bottom()
        try:
            request = GenerateRequest(messages=messages, sampling=sampling_params(settings), thinking=settings.thinking)
        except ValueError as exc:  # settings the engine refuses: say so on the reply, keep the app usable
            self._refuse(reply.id, exc)
            return
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
        self.history.update_message(message_id, status="error", error=error)
        widget = self.view.widget_for(message_id)
        if widget is not None:
            widget.finish(self.history.message(message_id))
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
        messages = self.history.messages(self.current_id)
        if not messages:
            return False
        last = messages[-1]
        if last.role == "assistant":
            self.history.delete_messages_from(self.current_id, last.id)
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
        self.history.delete_messages_from(self.current_id, message_id)
        self._rebuild_view()
        return self.send(text)

    # Engine events (GUI thread, via the bridge) -------------------------------------
    def _on_phase(self, event: PhaseEvent) -> None:
        if self.active and event.request_id == self.active.request_id:
            self.status.show_phase(event)

    def _on_snapshot(self, snap: dict) -> None:
        # The engine reports decoding progress through snapshots, not one event per token.
        if self.active and snap.get("request_id") == self.active.request_id and snap.get("phase") == "decoding":
            self.status.show_phase(PhaseEvent(self.active.request_id, "decoding",
                                              int(snap.get("completion_tokens", 0) or 0), int(snap.get("total", 0) or 0)))

    def _on_text(self, request_id: str, text: str, reasoning: str) -> None:
        active = self.active
        if active is None or request_id != active.request_id or not (text or reasoning):
            return
        active.content += text
        active.reasoning += reasoning
        active.flushes += 1
        # Saved before it is shown: a kill after this line loses nothing on screen.
        self.history.update_message(active.message_id, content=active.content, reasoning=active.reasoning)
        self.status.note_progress()
        widget = self._active_widget()
        if widget is not None:
            widget.stream_update(active.content, active.reasoning)

    def _on_done(self, event: DoneEvent) -> None:
        active = self.active
        if active is None or event.request_id != active.request_id:
            return
        stats = asdict(event.stats)
        status = "stopped" if event.stats.stop_reason == "cancelled" else "finished"
        content = event.text if event.text or not active.content else active.content
        reasoning = event.reasoning if event.reasoning or not active.reasoning else active.reasoning
        self.history.update_message(active.message_id, content=content, reasoning=reasoning, status=status,
                                    stats=stats)
        self._end_reply(f"Stopped · {event.stats.completion_tokens} tokens" if status == "stopped"
                        else f"Done · {event.stats.completion_tokens} tokens · stop: {event.stats.stop_reason}")

    def _on_failed(self, event: ErrorEvent) -> None:
        active = self.active
        if active is None or event.request_id != active.request_id:
            return
        self.history.update_message(active.message_id, content=active.content, reasoning=active.reasoning,
                                    status="error", error=event.message)
        self._end_reply(f"Reply failed ({event.kind})")

    def _end_reply(self, status_text: str) -> None:
        active, self.active = self.active, None
        widget = self.view.widget_for(active.message_id) if active.conversation_id == self.current_id else None
        if widget is not None:
            widget.finish(self.history.message(active.message_id))
        self.status.stop(status_text)
        self.conversations.refresh()
        self._update_actions()
        self.busyChanged.emit(False)
        self._checkpointer.submit(self.history.checkpoint)
        self.replyFinished.emit(active.message_id)

    def shutdown(self) -> None:
        """Wait for a running checkpoint (the store closes next)."""
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
