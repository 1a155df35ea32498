"""The chat transcript: one widget per message, Markdown rendered, the active reply streamed.

Each message is a ``MessageWidget``: a header (who, and the actions Copy / Edit /
Regenerate), an optional collapsible reasoning block, the rendered text, and for
replies a stats line. While a reply streams only its own widget is re-rendered, with
``StreamingMarkdown`` re-rendering only the text after the last stable block.

Long messages render lazily: past ``PREVIEW_CHARS`` a message shows its start (a pasted
10 MB log would otherwise take the GUI thread for half a minute to lay out) and a "Show
all" button; the whole text is read from the history only then, rendered as Markdown up
to ``FULL_MARKDOWN_CHARS`` and beyond that shown as plain text, filled into its own
scrolling view a chunk per event-loop turn so the window never stalls.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QSize, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QFontDatabase, QGuiApplication, QTextCursor, QTextOption, QWheelEvent
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QTextBrowser,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.gui.markdown_render import COPY_CODE_SCHEME, MarkdownRenderer, RenderedMarkdown, StreamingMarkdown
from app.gui.theme import ERROR_COLOR, MUTED_COLOR, WARNING_COLOR
from app.history import Message, format_stats

CONTENT_MAX_WIDTH = 860
PREVIEW_CHARS = 24_000  # a longer content or reasoning shows its start; "Show all" shows the rest on demand
FULL_MARKDOWN_CHARS = 100_000  # "Show all" renders Markdown up to this size (~0.1 s), plain text beyond
FULL_VIEW_CHUNK = 128_000  # characters added to the plain-text view per event-loop turn (~15 ms)
DISPLAY_LINE_CHARS = 4_000  # the plain-text view breaks longer lines (Qt lays out one huge line very slowly)
FULL_VIEW_HEIGHT = 520  # pixels: the plain-text view scrolls inside itself

STATUS_NOTES = {
    "stopped": "Stopped: you pressed Stop; the text above is what the model wrote until then.",
    "streaming": "Interrupted: ExpertDesk closed while this reply was being written. Regenerate to get a full reply.",
}


class MarkdownBrowser(QTextBrowser):
    """A read-only rich-text view whose height follows its content (no inner vertical scrolling).

    Links: ``copy-code:N`` copies code block N, web links open in the browser.
    """

    codeCopied = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setOpenLinks(False)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setWordWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        self.viewport().setAutoFillBackground(False)
        self.setStyleSheet("QTextBrowser { background: transparent; }")
        self.document().setDocumentMargin(2)
        mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont).family()
        self.document().setDefaultStyleSheet(f"pre, code {{ font-family: '{mono}', monospace; }}")
        self.code_blocks: list[str] = []
        self.document().documentLayout().documentSizeChanged.connect(self._fit_height)
        self.anchorClicked.connect(self._on_anchor)
        self._fit_height()

    def show_rendered(self, rendered: RenderedMarkdown) -> None:
        """Replace the content, keeping the reader's selection-free scroll position (there is none inside)."""
        self.code_blocks = rendered.code_blocks
        self.setHtml(rendered.html)

    def _fit_height(self, *_: object) -> None:
        height = int(self.document().size().height()) + 2 * self.frameWidth() + 2
        if self.horizontalScrollBar().isVisible():
            height += self.horizontalScrollBar().sizeHint().height()
        if height != self.height():
            self.setFixedHeight(max(height, self.fontMetrics().height() + 4))

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt naming
        super().resizeEvent(event)
        self._fit_height()

    def wheelEvent(self, event: QWheelEvent) -> None:  # noqa: N802 - Qt naming
        # Vertical wheel belongs to the transcript's scroll area; only sideways scrolling stays here.
        if event.angleDelta().y() != 0 and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            event.ignore()
            return
        super().wheelEvent(event)

    def _on_anchor(self, url: QUrl) -> None:
        if url.scheme() == COPY_CODE_SCHEME:
            try:
                index = int(url.path())
            except ValueError:
                return
            if 0 <= index < len(self.code_blocks):
                QGuiApplication.clipboard().setText(self.code_blocks[index])
                self.codeCopied.emit(index)
        elif url.scheme() in ("http", "https", "mailto"):
            QDesktopServices.openUrl(url)


class MessageWidget(QFrame):
    """One message of the transcript, with its actions."""

    editSubmitted = Signal(int, str)  # message id, new text
    regenerateRequested = Signal(int)  # message id of the reply to replace
    copied = Signal(str)  # what was copied, for the status bar
    problem = Signal(str)  # something the user asked for did not work, for the status bar
    firstPainted = Signal()  # the message is on screen for the first time

    def __init__(self, message: Message, renderer: MarkdownRenderer, *, dark: bool, model_label: str = "",
                 loader: Callable[[int], Message | None] | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.message = message
        self.message_id = message.id
        self.role = message.role
        self._renderer = renderer
        self._dark = dark
        self.content = message.content  # the whole text, or its start when the message came as a preview
        self.reasoning = message.reasoning
        self.content_length = message.content_length or len(message.content)
        self.reasoning_length = message.reasoning_length or len(message.reasoning)
        self._loader = loader  # reads the whole message (id -> Message) when a preview is not enough
        self._complete = message.complete
        self.expanded = False  # "Show all" pressed: the whole content is shown
        self.expanding = False  # the plain-text view is still being filled
        self.preview_row: QWidget | None = None  # "Showing the start ..." + Show all, built when needed
        self.preview_label: QLabel | None = None
        self.show_all_button: QPushButton | None = None
        self.full_view: QPlainTextEdit | None = None
        self._fill: tuple[str, int] | None = None  # (text, position) while the plain-text view fills
        self._fill_timer: QTimer | None = None
        self._frozen_content = self._frozen_reasoning = False  # a streaming text past the preview size
        self._stream: StreamingMarkdown | None = None
        self._reasoning_stream: StreamingMarkdown | None = None
        self._reasoning_toggled_by_user = False
        self._painted = False
        self.setObjectName("userMessage" if self.role == "user" else "assistantMessage")
        self.setFrameShape(QFrame.Shape.NoFrame)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 8)
        layout.setSpacing(4)

        header = QHBoxLayout()
        who = "You" if self.role == "user" else ("Assistant" + (f" · {model_label}" if model_label else ""))
        self.who_label = QLabel(f"<b>{who}</b>", self)
        header.addWidget(self.who_label)
        header.addStretch(1)
        self.copy_button = self._action("Copy", "Copy this message's text (Markdown) to the clipboard")
        self.copy_button.clicked.connect(self.copy_text)
        self.edit_button = self._action("Edit",
                                        "Edit this message and send it again (the replies after it are replaced)")
        self.edit_button.clicked.connect(self.begin_edit)
        self.edit_button.setVisible(self.role == "user")
        self.regenerate_button = self._action("Regenerate", "Write this reply again (Ctrl+Shift+R)")
        self.regenerate_button.clicked.connect(lambda: self.regenerateRequested.emit(self.message_id))
        self.regenerate_button.setVisible(False)
        for button in (self.copy_button, self.edit_button, self.regenerate_button):
            header.addWidget(button)
        layout.addLayout(header)

        self.reasoning_toggle = QToolButton(self)
        self.reasoning_toggle.setCheckable(True)
        self.reasoning_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.reasoning_toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.reasoning_toggle.setAutoRaise(True)
        self.reasoning_toggle.setAccessibleName("Show or hide the model's reasoning")
        self.reasoning_toggle.toggled.connect(self._on_reasoning_toggled)
        self.reasoning_toggle.clicked.connect(lambda: setattr(self, "_reasoning_toggled_by_user", True))
        layout.addWidget(self.reasoning_toggle)
        # The reasoning view and the editor are built on first use: most messages never need
        # them, and every widget built while the engine runs competes with it for the GIL.
        self.reasoning_view: MarkdownBrowser | None = None
        self.reasoning_toggle.setVisible(False)

        self.body = MarkdownBrowser(self)
        self.body.setAccessibleName("Your message" if self.role == "user" else "Reply")
        self.body.codeCopied.connect(lambda i: self.copied.emit(f"code block {i + 1}"))
        layout.addWidget(self.body)

        self.editor: QPlainTextEdit | None = None
        self.edit_buttons: QWidget | None = None

        self.note_label = QLabel(self)
        self.note_label.setWordWrap(True)
        self.note_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.note_label.setVisible(False)
        layout.addWidget(self.note_label)
        self.stats_label = QLabel(self)
        self.stats_label.setObjectName("stats")
        self.stats_label.setAccessibleName("Reply statistics")
        self.stats_label.setWordWrap(True)
        self.stats_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.stats_label.setVisible(False)
        layout.addWidget(self.stats_label)

        self._render_all()
        self.show_outcome(message.status, message.stats, message.error)

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt naming
        super().paintEvent(event)
        if not self._painted:
            self._painted = True
            self.firstPainted.emit()

    def _build_reasoning_view(self) -> MarkdownBrowser:
        view = MarkdownBrowser(self)
        view.setAccessibleName("Reasoning")
        view.setObjectName("reasoning")
        view.setVisible(self.reasoning_toggle.isChecked())
        view.codeCopied.connect(lambda i: self.copied.emit(f"code block {i + 1}"))
        layout = self.layout()
        layout.insertWidget(layout.indexOf(self.reasoning_toggle) + 1, view)
        self.reasoning_view = view
        return view

    def _build_editor(self) -> QPlainTextEdit:
        self.editor = QPlainTextEdit(self)
        self.editor.setAccessibleName("Edit message")
        self.edit_buttons = QWidget(self)
        edit_row = QHBoxLayout(self.edit_buttons)
        edit_row.setContentsMargins(0, 0, 0, 0)
        edit_row.addStretch(1)
        self.edit_cancel = QPushButton("Cancel", self.edit_buttons)
        self.edit_cancel.clicked.connect(self.end_edit)
        self.edit_send = QPushButton("Save && send", self.edit_buttons)
        self.edit_send.setDefault(True)
        self.edit_send.setAccessibleName("Save the edited message and send it")
        self.edit_send.clicked.connect(self._submit_edit)
        edit_row.addWidget(self.edit_cancel)
        edit_row.addWidget(self.edit_send)
        layout = self.layout()
        at = layout.indexOf(self.body) + 1
        layout.insertWidget(at, self.editor)
        layout.insertWidget(at + 1, self.edit_buttons)
        return self.editor

    def _action(self, text: str, tip: str) -> QToolButton:
        button = QToolButton(self)
        button.setText(text)
        button.setToolTip(tip)
        button.setAccessibleName(tip.split(" (")[0])
        button.setAutoRaise(True)
        button.setCursor(Qt.CursorShape.PointingHandCursor)
        return button

    # Rendering ---------------------------------------------------------------
    def _render_all(self) -> None:
        """Render the whole message (a finished one, or after a theme change)."""
        if self.role == "assistant" and not self.content.strip() and self.reasoning and self._stream is None:
            # A reply that ended while still thinking (max tokens, Stop): say where its text is.
            self.body.setHtml(f'<p style="color:{MUTED_COLOR[self._dark]};"><i>No answer text: the reply ended '
                              "inside the model's reasoning. Open “Reasoning” above to read it.</i></p>")
        elif self.expanded and self.full_view is None:
            self.body.show_rendered(self._renderer.render(self.content))
        elif not self.expanded:
            self.body.show_rendered(self._renderer.render(preview_text(self.content or "", self.content_length)))
        self._update_preview_row()
        self._show_reasoning(self._renderer.render(self._reasoning_text()) if self.reasoning else None)

    def _reasoning_text(self) -> str:
        """The reasoning to render: all of it, or its start and a note when it is long."""
        if self.reasoning_length <= PREVIEW_CHARS:
            return self.reasoning
        return (preview_text(self.reasoning, self.reasoning_length)
                + f"\n\n*… the reasoning goes on: {_amount(self.reasoning_length)} in all. File > Export saves "
                "all of it.*")

    @property
    def truncated(self) -> bool:
        """Whether the content on screen is only the start of the message."""
        return not self.expanded and self.content_length > PREVIEW_CHARS

    def _update_preview_row(self) -> None:
        """The line under a long message: how much is shown, and Show all / Show less."""
        long = self.content_length > PREVIEW_CHARS
        if self.preview_row is None:
            if not long:
                return
            self._build_preview_row()
        self.preview_row.setVisible(long)
        if not long:
            return
        total = _amount(self.content_length)
        if self._stream is not None:
            self.preview_label.setText(f"<i>Writing… {total} so far; the start is shown, Show all works once the "
                                       "reply has ended.</i>")
            self.show_all_button.setVisible(False)
            return
        self.show_all_button.setVisible(True)
        if self.expanded:
            self.preview_label.setText(f"<i>Showing all {total}" + (" as plain text" if self.full_view is not None
                                                                       else "") + ".</i>")
            self.show_all_button.setText("Show less")
        else:
            shown = _amount(len(preview_text(self.content, self.content_length)))
            self.preview_label.setText(f"<i>Showing the start ({shown} of {total}).</i>")
            self.show_all_button.setText(f"Show all ({total})")

    def _build_preview_row(self) -> None:
        row = QWidget(self)
        line = QHBoxLayout(row)
        line.setContentsMargins(0, 0, 0, 0)
        self.preview_label = QLabel(row)
        self.preview_label.setWordWrap(True)
        self.preview_label.setStyleSheet(f"color: {MUTED_COLOR[self._dark]};")
        self.show_all_button = QPushButton("Show all", row)
        self.show_all_button.setAccessibleName("Show the whole message")
        self.show_all_button.setToolTip("Show the whole message (long texts as plain text)")
        self.show_all_button.clicked.connect(self.toggle_all)
        line.addWidget(self.preview_label, 1)
        line.addWidget(self.show_all_button)
        layout = self.layout()
        layout.insertWidget(layout.indexOf(self.body) + 1, row)
        self.preview_row = row

    def whole_content(self) -> str | None:
        """The message's whole text, read from the history if only its start is here (None: unreadable)."""
        if not self._complete:
            full = self._loader(self.message_id) if self._loader is not None else None
            if full is None or not full.complete:
                return None
            self.content, self.reasoning = full.content, full.reasoning
            self.content_length, self.reasoning_length = len(full.content), len(full.reasoning)
            self._complete = True
        return self.content

    def toggle_all(self) -> None:
        """Show the whole message (Show all), or only its start again (Show less)."""
        if self.expanded:
            self.expanded = False
            self._stop_fill()
            if self.full_view is not None:
                self.full_view.setParent(None)
                self.full_view.deleteLater()
                self.full_view = None
            self.body.setVisible(True)
            self._render_all()
            return
        text = self.whole_content()
        if text is None:
            self.problem.emit("The whole message could not be read from the history (see the message above).")
            return
        self.expanded = True
        if len(text) <= FULL_MARKDOWN_CHARS:
            self._render_all()
            return
        view = QPlainTextEdit(self)
        view.setReadOnly(True)
        view.setUndoRedoEnabled(False)
        view.setAccessibleName("The whole message, as plain text")
        view.setWordWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        view.setFixedHeight(FULL_VIEW_HEIGHT)
        layout = self.layout()
        layout.insertWidget(layout.indexOf(self.body) + 1, view)
        self.full_view = view
        self.body.setVisible(False)
        self._fill = (text, 0)
        self.expanding = True
        self._fill_timer = QTimer(self)
        self._fill_timer.setInterval(0)
        self._fill_timer.timeout.connect(self._fill_step)
        self._fill_timer.start()
        self._update_preview_row()

    def _fill_step(self) -> None:
        """Add the next chunk of the whole text to the plain-text view (one per event-loop turn)."""
        if self._fill is None or self.full_view is None:
            self._stop_fill()
            return
        text, pos = self._fill
        end = min(len(text), pos + FULL_VIEW_CHUNK)
        chunk_end = end
        if end < len(text):
            newline = text.find("\n", end, end + DISPLAY_LINE_CHARS)
            chunk_end = newline + 1 if newline >= 0 else end
        chunk = _break_long_lines(text[pos:chunk_end])
        if chunk_end < len(text) and not chunk.endswith("\n"):
            chunk += "\n"  # a line longer than DISPLAY_LINE_CHARS: broken here for display
        cursor = QTextCursor(self.full_view.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(chunk)
        if chunk_end >= len(text):
            self._stop_fill()
        else:
            self._fill = (text, chunk_end)

    def _stop_fill(self) -> None:
        if self._fill_timer is not None:
            self._fill_timer.stop()
            self._fill_timer.deleteLater()
            self._fill_timer = None
        self._fill = None
        self.expanding = False

    def _show_reasoning(self, rendered: RenderedMarkdown | None) -> None:
        has = rendered is not None
        self.reasoning_toggle.setVisible(has)
        if not has:
            if self.reasoning_view is not None:
                self.reasoning_view.setVisible(False)
            return
        (self.reasoning_view or self._build_reasoning_view()).show_rendered(rendered)
        self._update_reasoning_title()

    def _update_reasoning_title(self) -> None:
        words = len(self.reasoning.split())
        state = "Thinking…" if self._stream is not None and not self.content else "Reasoning"
        self.reasoning_toggle.setText(f"{state} ({words} words)")

    def _on_reasoning_toggled(self, shown: bool) -> None:
        self.reasoning_toggle.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)
        if self.reasoning_view is not None:
            self.reasoning_view.setVisible(shown)

    def set_renderer(self, renderer: MarkdownRenderer, dark: bool) -> None:
        """Re-render with another theme's colours."""
        self._renderer = renderer
        self._dark = dark
        if self.preview_label is not None:
            self.preview_label.setStyleSheet(f"color: {MUTED_COLOR[dark]};")
        if self._stream is not None:
            self._stream = StreamingMarkdown(renderer)
            self._reasoning_stream = StreamingMarkdown(renderer)
        self._render_all()
        self.show_outcome(self.message.status, self.message.stats, self.message.error)

    def begin_stream(self) -> None:
        """This reply is being generated: show a placeholder and render incrementally from now on."""
        self._stream = StreamingMarkdown(self._renderer)
        self._reasoning_stream = StreamingMarkdown(self._renderer)
        self._frozen_content = self._frozen_reasoning = False
        self.regenerate_button.setVisible(False)
        self.copy_button.setEnabled(False)
        self.note_label.setVisible(False)
        self.stats_label.setVisible(False)
        if not self.content and not self.reasoning:
            self.body.setHtml("<p><i>…</i></p>")

    def stream_update(self, content: str, reasoning: str) -> None:
        """Show the reply so far (called once per flush, not per token)."""
        if self._stream is None:
            self.begin_stream()
        # Past PREVIEW_CHARS a text is rendered once more (its start) and then left alone: laying
        # out an ever longer document on every flush would stall the window.
        if reasoning != self.reasoning:
            self.reasoning = reasoning
            self.reasoning_length = len(reasoning)
            if len(reasoning) <= PREVIEW_CHARS:
                self._show_reasoning(self._reasoning_stream.render(reasoning))
            elif not self._frozen_reasoning:
                self._frozen_reasoning = True
                self._show_reasoning(self._renderer.render(self._reasoning_text()))
            if not self._reasoning_toggled_by_user and not content:
                self.reasoning_toggle.setChecked(True)  # show the thinking live ...
        if content != self.content:
            self.content = content
            self.content_length = len(content)
            self._complete = True
            if len(content) <= PREVIEW_CHARS:
                self.body.show_rendered(self._stream.render(content))
            elif not self._frozen_content:
                self._frozen_content = True
                self.body.show_rendered(self._renderer.render(preview_text(content, len(content))))
            self._update_preview_row()
            if not self._reasoning_toggled_by_user and self.reasoning_toggle.isChecked():
                self.reasoning_toggle.setChecked(False)  # ... and fold it away once the answer starts
        if self.reasoning:
            self._update_reasoning_title()

    def finish(self, message: Message) -> None:
        """The reply ended: final full render, stats and status."""
        self.message = message
        self.content, self.reasoning = message.content, message.reasoning
        self.content_length = message.content_length or len(message.content)
        self.reasoning_length = message.reasoning_length or len(message.reasoning)
        self._complete = message.complete
        self._stream = self._reasoning_stream = None
        self.copy_button.setEnabled(True)
        if not self._reasoning_toggled_by_user:
            self.reasoning_toggle.setChecked(False)
        self._render_all()
        self.show_outcome(message.status, message.stats, message.error)

    def show_outcome(self, status: str, stats: dict | None, error: str | None, *, live: bool = False) -> None:
        """The note under a reply (stopped, interrupted, error) and its stats line."""
        if self.role != "assistant":
            return
        if status == "error":
            self.note_label.setText(f'<span style="color:{ERROR_COLOR[self._dark]};"><b>Error:</b> '
                                    f"{_escape(error or 'the engine failed without a message')}</span>")
            self.note_label.setVisible(True)
        elif status in STATUS_NOTES and not live and self._stream is None:
            self.note_label.setText(f'<span style="color:{WARNING_COLOR[self._dark]};">{STATUS_NOTES[status]}</span>')
            self.note_label.setVisible(True)
        else:
            self.note_label.setVisible(False)
        self.stats_text = format_stats(stats) if stats else ""
        # Break the line only between items, never inside "SSD 0.18 GB/token".
        line = " · ".join(_escape(part).replace(" ", "&nbsp;") for part in self.stats_text.split(" · "))
        self.stats_label.setText(f"<small>{line}</small>" if self.stats_text else "")
        self.stats_label.setVisible(bool(stats))

    # Actions -------------------------------------------------------------------
    def copy_text(self) -> None:
        """Copy the message's Markdown source (all of it, also when only its start is shown)."""
        text = self.whole_content()
        if text is None:
            self.problem.emit("The whole message could not be read from the history (see the message above).")
            return
        QGuiApplication.clipboard().setText(text)
        self.copied.emit("message")

    def begin_edit(self) -> None:
        """Swap the rendered text for an editor holding the message's source."""
        text = self.whole_content()
        if text is None:
            return
        if self.editor is None:
            self._build_editor()
        self.editor.setPlainText(text)
        self.editor.setMinimumHeight(min(300, max(80, int(self.body.height() * 1.2))))
        self.body.setVisible(False)
        self.editor.setVisible(True)
        self.edit_buttons.setVisible(True)
        self.edit_button.setEnabled(False)
        self.editor.setFocus()

    def end_edit(self) -> None:
        if self.editor is not None:
            self.editor.setVisible(False)
            self.edit_buttons.setVisible(False)
        self.body.setVisible(True)
        self.edit_button.setEnabled(True)

    def _submit_edit(self) -> None:
        text = self.editor.toPlainText().strip()
        if text:
            self.end_edit()
            self.editSubmitted.emit(self.message_id, text)


def _escape(text: str) -> str:
    return html.escape(text).replace("\n", "<br>")


_FENCE = re.compile(r"^ {0,3}(```|~~~)", re.MULTILINE)
_LONG_LINE = re.compile(rf"[^\n]{{{DISPLAY_LINE_CHARS}}}(?=[^\n])")


def preview_text(text: str, full_length: int, limit: int = PREVIEW_CHARS) -> str:
    """What a long text shows first: its start, cut at a line end when one is near, a code fence closed.

    ``full_length`` is the whole text's length (``text`` may already be only its start).
    """
    if full_length <= limit:
        return text
    cut = text[:limit]
    newline = cut.rfind("\n", limit // 2)
    if newline > 0:
        cut = cut[: newline + 1]
    if len(_FENCE.findall(cut)) % 2:
        cut += "\n```\n"  # the cut fell inside a code block: close it, so the preview renders as it should
    return cut


def _break_long_lines(text: str) -> str:
    return _LONG_LINE.sub(lambda m: m.group(0) + "\n", text)


def _amount(chars: int) -> str:
    return f"{chars:,} characters" if chars < 1_000_000 else f"{chars / 1e6:.1f} million characters"


class ChatView(QScrollArea):
    """The transcript of one conversation, newest message at the bottom."""

    editSubmitted = Signal(int, str)
    regenerateRequested = Signal(int)
    copied = Signal(str)
    problem = Signal(str)
    earlierRequested = Signal()  # "Show earlier messages" at the top of a long conversation

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        # Reads a whole message (id -> Message) for a widget that holds only a preview (set by the controller).
        self.message_loader: Callable[[int], Message | None] | None = None
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setAccessibleName("Conversation")
        self._renderer = MarkdownRenderer()
        self._dark = False
        self._model_label = ""
        holder = QWidget(self)
        holder.setObjectName("chatHolder")
        outer = QHBoxLayout(holder)
        outer.setContentsMargins(16, 12, 16, 12)
        self._column = QWidget(holder)
        self._column.setMaximumWidth(CONTENT_MAX_WIDTH)
        self._layout = QVBoxLayout(self._column)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._layout.setSpacing(10)
        self.earlier_button = QPushButton(self._column)
        self.earlier_button.setAccessibleName("Show earlier messages")
        self.earlier_button.clicked.connect(self.earlierRequested)
        self.earlier_button.setVisible(False)
        self._layout.addWidget(self.earlier_button, 0, Qt.AlignmentFlag.AlignHCenter)
        self.placeholder = QLabel(self._column)
        self.placeholder.setObjectName("placeholder")
        self.placeholder.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.placeholder.setWordWrap(True)
        self._layout.addWidget(self.placeholder)
        self._layout.addStretch(1)
        outer.addStretch(0)
        outer.addWidget(self._column, 1)
        outer.addStretch(0)
        self.setWidget(holder)
        self.widgets: list[MessageWidget] = []
        self._stick_to_bottom = True
        self.verticalScrollBar().rangeChanged.connect(self._on_range_changed)
        self.verticalScrollBar().valueChanged.connect(self._on_scrolled)
        self.set_placeholder("")

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt naming
        return QSize(640, 480)

    def set_placeholder(self, html: str) -> None:
        """What an empty conversation shows (a hint about the model and the shortcuts)."""
        self.placeholder.setText(html or "<h2>Start a conversation</h2>"
                                         "<p>Type below; Enter sends, Shift+Enter adds a line.</p>")
        self.placeholder.setVisible(not self.widgets)

    def set_theme(self, renderer: MarkdownRenderer, dark: bool) -> None:
        self._renderer, self._dark = renderer, dark
        for widget in self.widgets:
            widget.set_renderer(renderer, dark)

    def set_model_label(self, label: str) -> None:
        self._model_label = label

    def clear(self) -> None:
        for widget in self.widgets:
            widget.setParent(None)
            widget.deleteLater()
        self.widgets = []
        self.placeholder.setVisible(True)
        self.earlier_button.setVisible(False)
        self._stick_to_bottom = True

    def set_earlier(self, count: int) -> None:
        """Offer the `count` older messages that are not shown (0: none)."""
        self.earlier_button.setText(f"Show earlier messages ({count:,} more)")
        self.earlier_button.setVisible(count > 0)

    def add_message(self, message: Message) -> MessageWidget:
        """Append a message at the bottom."""
        widget = MessageWidget(message, self._renderer, dark=self._dark,
                               model_label=_short_model(message.model_ref) if message.model_ref else "",
                               loader=self._load_message, parent=self._column)
        widget.editSubmitted.connect(self.editSubmitted)
        widget.regenerateRequested.connect(self.regenerateRequested)
        widget.copied.connect(self.copied)
        widget.problem.connect(self.problem)
        self._layout.insertWidget(self._layout.count() - 1, widget)
        self.widgets.append(widget)
        self.placeholder.setVisible(False)
        self._stick_to_bottom = True
        return widget

    def widget_for(self, message_id: int) -> MessageWidget | None:
        return next((w for w in self.widgets if w.message_id == message_id), None)

    def _load_message(self, message_id: int) -> Message | None:
        return self.message_loader(message_id) if self.message_loader is not None else None

    def set_regenerate_target(self, message_id: int | None) -> None:
        """Show Regenerate on this reply only (the last one), and nowhere while generating."""
        for widget in self.widgets:
            widget.regenerate_button.setVisible(widget.message_id == message_id)

    def set_editing_enabled(self, enabled: bool) -> None:
        """Edit buttons work only while no reply is being generated."""
        for widget in self.widgets:
            widget.edit_button.setEnabled(enabled)

    # Keep the newest text in view while streaming, unless the reader scrolled up.
    def _on_scrolled(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._stick_to_bottom = value >= bar.maximum() - 24

    def _on_range_changed(self, _minimum: int, maximum: int) -> None:
        if self._stick_to_bottom:
            self.verticalScrollBar().setValue(maximum)

    def scroll_to_top(self) -> None:
        """Show the oldest message shown (after "Show earlier messages"); stop following new text."""
        self._stick_to_bottom = False
        self.verticalScrollBar().setValue(0)

    def scroll_to_bottom(self) -> None:
        """Show the newest message; the view then follows the growing range (see _on_range_changed)."""
        self._stick_to_bottom = True
        self.verticalScrollBar().setValue(self.verticalScrollBar().maximum())


def _short_model(ref: str) -> str:
    return "demo" if ref == "demo" else (Path(ref).name or ref)
