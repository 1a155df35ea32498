"""The sidebar: search box, New chat button and the list of conversations (rename, delete).

The list holds titles only (never message text), and at most ``LIST_PAGE`` of them at a
time: a last entry "Show older chats…" loads the next page. A history that cannot be read
or written (locked, damaged) leaves the list as it was and reports ``historyFailed``.
"""

from __future__ import annotations

import time

from PySide6.QtCore import QPoint, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QInputDialog,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.gui import icons
from app.gui.theme import SPACE
from app.history import Conversation, HistoryError, HistoryStore

LIST_PAGE = 500  # conversations listed at first; "Show older chats…" adds as many


class ConversationList(QWidget):
    """Lists the conversations of a ``HistoryStore``; emits the one the user picks."""

    conversationSelected = Signal(int)
    newRequested = Signal()
    conversationDeleted = Signal(int)
    conversationRenamed = Signal(int)
    historyFailed = Signal(object, str)  # HistoryError, what did not happen ("Not renamed")

    def __init__(self, history: HistoryStore, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.history = history
        self.setMinimumWidth(200)
        self.new_button = QPushButton("New chat", self)
        self.new_button.setAccessibleName("New chat")
        self.new_button.setToolTip("Start a new conversation (Ctrl+N)")
        self.new_button.clicked.connect(self.newRequested)
        icons.bind(self.new_button, "new-chat")
        self.search = QLineEdit(self)
        self.search.setAccessibleName("Search conversations")
        self.search.setPlaceholderText("Search chats (Ctrl+F)")
        self.search.setClearButtonEnabled(True)
        self.search_icon = self.search.addAction(icons.icon("search"), QLineEdit.ActionPosition.LeadingPosition)
        icons.bind(self.search_icon, "search")
        for button in self.search.findChildren(QToolButton):  # the icon's button, for screen readers
            if button.defaultAction() is self.search_icon:
                button.setAccessibleName("Search chats")
        # Searching message text hits the database: wait until typing pauses.
        self._search_timer = QTimer(self)
        self._search_timer.setSingleShot(True)
        self._search_timer.setInterval(200)
        self._search_timer.timeout.connect(self.refresh)
        self.search.textChanged.connect(lambda _text: self._search_timer.start())
        self.list = QListWidget(self)
        self.list.setAccessibleName("Conversations")
        self.list.setObjectName("conversationList")
        # Long titles end in "…" (the tooltip has the whole title); never a horizontal scroll bar.
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setWordWrap(False)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._context_menu)
        self.list.currentItemChanged.connect(self._on_current_changed)
        self.list.itemActivated.connect(self._on_item_activated)
        self.list.itemClicked.connect(self._on_item_activated)
        self.list.setUniformItemSizes(True)
        self.rename_action = QAction("Rename…", self.list)
        self.rename_action.setShortcut(QKeySequence(Qt.Key.Key_F2))
        self.rename_action.setShortcutContext(Qt.ShortcutContext.WidgetShortcut)
        self.rename_action.triggered.connect(lambda: self.rename(self.current_id()))
        self.delete_action = QAction("Delete…", self.list)
        self.delete_action.setShortcut(QKeySequence(QKeySequence.StandardKey.Delete))
        self.delete_action.setShortcutContext(Qt.ShortcutContext.WidgetShortcut)
        self.delete_action.triggered.connect(lambda: self.delete(self.current_id()))
        self.list.addActions([self.rename_action, self.delete_action])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(SPACE["s"], SPACE["s"], SPACE["xs"], SPACE["s"])
        layout.setSpacing(SPACE["s"])
        layout.addWidget(self.new_button)
        layout.addWidget(self.search)
        layout.addWidget(self.list, 1)
        self._suppress_selection = False
        self._limit = LIST_PAGE
        self.more_item: QListWidgetItem | None = None  # "Show older chats…" when there are more
        self.refresh()

    def current_id(self) -> int | None:
        item = self.list.currentItem()
        return item.data(Qt.ItemDataRole.UserRole) if item else None

    def refresh(self, select_id: int | None = None) -> None:
        """Reload the list from the database (search applied), keeping or setting the selection."""
        keep = select_id if select_id is not None else self.current_id()
        try:
            conversations = self.history.conversations(self.search.text(), limit=self._limit + 1)
        except HistoryError as exc:
            self.historyFailed.emit(exc, "The chat list was not updated")
            return
        self._suppress_selection = True
        try:
            self.list.clear()
            self.more_item = None
            for conversation in conversations[: self._limit]:
                item = QListWidgetItem(conversation.title)
                item.setData(Qt.ItemDataRole.UserRole, conversation.id)
                item.setToolTip(f"{conversation.title}\nlast active {_when(conversation.updated_at)}")
                self.list.addItem(item)
                if conversation.id == keep:
                    self.list.setCurrentItem(item)
            if len(conversations) > self._limit:
                self.more_item = QListWidgetItem("Show older chats…")
                self.more_item.setToolTip(f"List the next {LIST_PAGE} conversations")
                self.more_item.setFlags(Qt.ItemFlag.ItemIsEnabled)
                self.list.addItem(self.more_item)
        finally:
            self._suppress_selection = False

    def show_more(self) -> None:
        """List the next page of older conversations."""
        self._limit += LIST_PAGE
        self.refresh()

    def _on_item_activated(self, item: QListWidgetItem) -> None:
        if item is self.more_item:
            self.show_more()

    def select(self, conversation_id: int) -> None:
        """Select a conversation (refreshing first so a new one is in the list)."""
        self.refresh(select_id=conversation_id)
        self.conversationSelected.emit(conversation_id)

    def select_quietly(self, conversation_id: int) -> None:
        """Refresh and select a conversation without announcing it (it is already on screen)."""
        self.refresh(select_id=conversation_id)

    def titles(self) -> list[str]:
        """The conversation titles listed (without "Show older chats…")."""
        return [self.list.item(i).text() for i in range(self.list.count()) if self.list.item(i) is not self.more_item]

    def rename(self, conversation_id: int | None, title: str | None = None) -> None:
        """Rename (asks for the title unless given)."""
        if conversation_id is None:
            return
        try:
            conversation = self.history.conversation(conversation_id)
        except HistoryError as exc:
            self.historyFailed.emit(exc, "Not renamed")
            return
        if conversation is None:
            return
        if title is None:
            title, ok = QInputDialog.getText(self, "Rename conversation", "Title:", text=conversation.title)
            if not ok:
                return
        try:
            self.history.rename_conversation(conversation_id, title)
        except HistoryError as exc:
            self.historyFailed.emit(exc, "Not renamed")
            return
        self.refresh()
        self.conversationRenamed.emit(conversation_id)

    def delete(self, conversation_id: int | None, *, confirm: bool = True) -> None:
        """Delete a conversation and its messages (asks first unless ``confirm`` is False)."""
        if conversation_id is None:
            return
        try:
            conversation = self.history.conversation(conversation_id)
        except HistoryError as exc:
            self.historyFailed.emit(exc, "Not deleted")
            return
        if conversation is None:
            return
        if confirm:
            answer = QMessageBox.question(
                self, "Delete conversation",
                f"Delete “{conversation.title}” and all its messages? This cannot be undone.",
                QMessageBox.StandardButton.Delete | QMessageBox.StandardButton.Cancel,
                QMessageBox.StandardButton.Cancel,
            )
            if answer != QMessageBox.StandardButton.Delete:
                return
        try:
            self.history.delete_conversation(conversation_id)
        except HistoryError as exc:
            self.historyFailed.emit(exc, "Not deleted")
            return
        self.refresh()
        self.conversationDeleted.emit(conversation_id)

    def _on_current_changed(self, current: QListWidgetItem | None, _previous: object) -> None:
        if current is not None and current is not self.more_item and not self._suppress_selection:
            self.conversationSelected.emit(current.data(Qt.ItemDataRole.UserRole))

    def _context_menu(self, pos: QPoint) -> None:
        item = self.list.itemAt(pos)
        if item is None or item is self.more_item:
            return
        self.list.setCurrentItem(item)
        menu = QMenu(self)
        menu.addAction(self.rename_action)
        menu.addAction(self.delete_action)
        menu.exec(self.list.mapToGlobal(pos))


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))


__all__ = ["ConversationList", "Conversation"]
