"""The chat transcript: one widget per message, Markdown rendered, the active reply streamed.

Each message is a ``MessageWidget``: a header (who, and the actions Copy / Edit /
Regenerate), an optional collapsible reasoning block, the rendered text, and for
replies a stats line. While a reply streams only its own widget is re-rendered, with
``StreamingMarkdown`` re-rendering only the text after the last stable block.
"""

from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtCore import QSize, Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QFontDatabase, QGuiApplication, QTextOption, QWheelEvent
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
    firstPainted = Signal()  # the message is on screen for the first time

    def __init__(self, message: Message, renderer: MarkdownRenderer, *, dark: bool, model_label: str = "",
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.message = message
        self.message_id = message.id
        self.role = message.role
        self._renderer = renderer
        self._dark = dark
        self.content = message.content
        self.reasoning = message.reasoning
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
        self.edit_button = self._action("Edit", "Edit this message and send it again (the replies after it are replaced)")
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
        else:
            self.body.show_rendered(self._renderer.render(self.content or ""))
        self._show_reasoning(self._renderer.render(self.reasoning) if self.reasoning else None)

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
        if self._stream is not None:
            self._stream = StreamingMarkdown(renderer)
            self._reasoning_stream = StreamingMarkdown(renderer)
        self._render_all()
        self.show_outcome(self.message.status, self.message.stats, self.message.error)

    def begin_stream(self) -> None:
        """This reply is being generated: show a placeholder and render incrementally from now on."""
        self._stream = StreamingMarkdown(self._renderer)
        self._reasoning_stream = StreamingMarkdown(self._renderer)
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
        if reasoning != self.reasoning:
            self.reasoning = reasoning
            self._show_reasoning(self._reasoning_stream.render(reasoning))
            if not self._reasoning_toggled_by_user and not content:
                self.reasoning_toggle.setChecked(True)  # show the thinking live ...
        if content != self.content:
            self.content = content
            self.body.show_rendered(self._stream.render(content))
            if not self._reasoning_toggled_by_user and self.reasoning_toggle.isChecked():
                self.reasoning_toggle.setChecked(False)  # ... and fold it away once the answer starts
        if self.reasoning:
            self._update_reasoning_title()

    def finish(self, message: Message) -> None:
        """The reply ended: final full render, stats and status."""
        self.message = message
        self.content, self.reasoning = message.content, message.reasoning
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
        """Copy the message's Markdown source."""
        QGuiApplication.clipboard().setText(self.content)
        self.copied.emit("message")

    def begin_edit(self) -> None:
        """Swap the rendered text for an editor holding the message's source."""
        if self.editor is None:
            self._build_editor()
        self.editor.setPlainText(self.content)
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


class ChatView(QScrollArea):
    """The transcript of one conversation, newest message at the bottom."""

    editSubmitted = Signal(int, str)
    regenerateRequested = Signal(int)
    copied = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
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
        self.placeholder.setText(html or "<h2>Start a conversation</h2><p>Type below; Enter sends, Shift+Enter adds a line.</p>")
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
        self._stick_to_bottom = True

    def add_message(self, message: Message) -> MessageWidget:
        """Append a message at the bottom."""
        widget = MessageWidget(message, self._renderer, dark=self._dark,
                               model_label=_short_model(message.model_ref) if message.model_ref else "",
                               parent=self._column)
        widget.editSubmitted.connect(self.editSubmitted)
        widget.regenerateRequested.connect(self.regenerateRequested)
        widget.copied.connect(self.copied)
        self._layout.insertWidget(self._layout.count() - 1, widget)
        self.widgets.append(widget)
        self.placeholder.setVisible(False)
        self._stick_to_bottom = True
        return widget

    def widget_for(self, message_id: int) -> MessageWidget | None:
        return next((w for w in self.widgets if w.message_id == message_id), None)

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

    def scroll_to_bottom(self) -> None:
        """Show the newest message; the view then follows the growing range (see _on_range_changed)."""
        self._stick_to_bottom = True
        self.verticalScrollBar().setValue(self.verticalScrollBar().maximum())


def _short_model(ref: str) -> str:
    return "demo" if ref == "demo" else (Path(ref).name or ref)
