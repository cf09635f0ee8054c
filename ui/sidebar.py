"""Conversation list: new, rename, delete, and search by title or message text.

A chat with a reply being written shows a dot on its row (until the reply ends), so a chat
streaming in the background is not forgotten; a search with no match says so."""

from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, QPoint, Qt, Signal
from PySide6.QtGui import QColor, QIcon, QKeyEvent, QPainter, QPalette, QPixmap
from PySide6.QtWidgets import (
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from ui.store import ChatStore, StoreError, clean_title

ID_ROLE = Qt.ItemDataRole.UserRole
STREAMING_ROLE = Qt.ItemDataRole.UserRole + 1  # True while the chat's reply is being written
WRITING_TIP = "Writing a reply…"


def streaming_icon(colour: QColor, size: int = 10) -> QIcon:
    """A filled dot in the accent colour: the row's 'writing a reply' mark."""
    pixmap = QPixmap(size, size)
    pixmap.fill(Qt.GlobalColor.transparent)
    painter = QPainter(pixmap)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.setPen(Qt.PenStyle.NoPen)
    painter.setBrush(colour)
    painter.drawEllipse(1, 1, size - 2, size - 2)
    painter.end()
    return QIcon(pixmap)


class Sidebar(QWidget):
    """Lists the store's conversations, newest first, filtered by the search box."""

    sig_selected = Signal(str)
    """The user picked a conversation (its id)."""
    sig_new = Signal()
    """The user asked for a new chat."""
    sig_delete = Signal(str)
    """The user asked to delete a conversation (its id)."""
    sig_store_error = Signal(str)
    """A rename could not be saved; the argument is the one-line reason."""
    sig_renamed = Signal(str, str)
    """A chat's new title was saved: (conversation id, title)."""
    sig_export = Signal(str, str)
    """The user asked to export a chat's reply stats: (conversation id, "csv" or "json")."""

    def __init__(self, store: ChatStore, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("sidebar")
        self.store = store
        self.new_button = QPushButton("+  New chat")
        self.new_button.setObjectName("newChatButton")
        self.new_button.clicked.connect(self.sig_new.emit)
        self.search = QLineEdit()
        self.search.setObjectName("searchBox")
        self.search.setPlaceholderText("Search chats")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(lambda _t: self.refresh())
        self.search.installEventFilter(self)  # Esc clears a search (see eventFilter)
        self.list = QListWidget()
        self.list.setObjectName("conversationList")
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._context_menu)
        self.list.currentItemChanged.connect(self._on_current)
        self.list.itemChanged.connect(self._on_item_edited)
        self._current_id = ""
        self._streaming: set[str] = set()
        self.empty_label = QLabel()  # what an empty list means (a search with no match)
        self.empty_label.setObjectName("sidebarEmpty")
        self.empty_label.setWordWrap(True)
        self.empty_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.empty_label.hide()

        layout = QVBoxLayout(self)
        layout.setContentsMargins(10, 10, 10, 10)
        layout.addWidget(self.new_button)
        layout.addWidget(self.search)
        layout.addWidget(self.empty_label)
        layout.addWidget(self.list, 1)

    def refresh(self, select: str | None = None) -> None:
        """Reload from the store (keeping or changing the selection) without re-emitting it."""
        if select is not None:
            self._current_id = select
        blocked = self.list.blockSignals(True)
        self.list.clear()
        for conv in self.store.conversations(self.search.text()):
            item = QListWidgetItem(conv.title)
            item.setData(ID_ROLE, conv.id)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            self._mark(item)
            self.list.addItem(item)
            if conv.id == self._current_id:
                self.list.setCurrentItem(item)
        self.list.blockSignals(blocked)
        self._show_empty()

    def set_streaming(self, conv_ids: set[str]) -> None:
        """Mark the chats with a reply being written; the others lose their mark."""
        if conv_ids == self._streaming:
            return
        self._streaming = set(conv_ids)
        blocked = self.list.blockSignals(True)  # a mark is not an edit of the title
        for i in range(self.list.count()):
            self._mark(self.list.item(i))
        self.list.blockSignals(blocked)

    def streaming_ids(self) -> list[str]:
        """The chats whose rows show the 'writing a reply' mark."""
        return [self.list.item(i).data(ID_ROLE) for i in range(self.list.count())
                if self.list.item(i).data(STREAMING_ROLE)]

    def _mark(self, item: QListWidgetItem) -> None:
        streaming = item.data(ID_ROLE) in self._streaming
        item.setData(STREAMING_ROLE, streaming)
        colour = self.palette().color(QPalette.ColorRole.Highlight)
        item.setIcon(streaming_icon(colour) if streaming else QIcon())
        title = item.text()
        item.setToolTip(f"{title}\n{WRITING_TIP}" if streaming else title)

    def _show_empty(self) -> None:
        """A search that matches nothing says so instead of showing an empty list."""
        query = self.search.text().strip()
        empty = self.list.count() == 0 and bool(query)
        self.empty_label.setText(f"No chats match “{query}”." if empty else "")
        self.empty_label.setVisible(empty)

    def clear_selection(self) -> None:
        """No chat selected (a new chat is not in the list until its first message)."""
        self._current_id = ""
        self.list.clearSelection()

    def visible_ids(self) -> list[str]:
        return [self.list.item(i).data(ID_ROLE) for i in range(self.list.count())]

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        """Esc in a search box with text clears the search, as in any search field, instead of
        reaching the window's Esc (which stops a reply the user may not be looking at)."""
        if (watched is self.search and self.search.text()
                and event.type() in (QEvent.Type.ShortcutOverride, QEvent.Type.KeyPress)
                and isinstance(event, QKeyEvent) and event.key() == Qt.Key.Key_Escape
                and event.modifiers() == Qt.KeyboardModifier.NoModifier):
            event.accept()  # on ShortcutOverride: the box takes the key, not the shortcut
            if event.type() == QEvent.Type.KeyPress:
                self.search.clear()
            return True
        return super().eventFilter(watched, event)

    def focus_search(self) -> None:
        """Put the cursor in the search box, its text selected (as Ctrl+F does)."""
        self.search.setFocus()
        self.search.selectAll()

    def step(self, current: str | None, step: int) -> None:
        """Select the chat after (step 1) or before (-1) `current` in the list, wrapping;
        sig_selected reports it."""
        ids = self.visible_ids()
        if not ids:
            return
        here = ids.index(current) if current in ids else -1
        row = (here + step) % len(ids) if here >= 0 else (0 if step > 0 else len(ids) - 1)
        self.list.setCurrentRow(row)

    def rename(self, conv_id: str, title: str) -> None:
        """Save a new title; an empty one is refused (the old title stays)."""
        title = clean_title(title)
        if title:
            self._save_title(conv_id, title)
        self.refresh()

    def start_rename(self) -> None:
        """Edit the selected chat's title in place (as F2 does)."""
        item = self.list.currentItem()
        if item is not None and item.data(ID_ROLE) == self._current_id:
            self.list.editItem(item)

    def _on_current(self, item: QListWidgetItem | None, _previous: object) -> None:
        if item is not None:
            self._current_id = item.data(ID_ROLE)
            self.sig_selected.emit(self._current_id)

    def _on_item_edited(self, item: QListWidgetItem) -> None:
        """Inline rename (double-click or F2); the item already shows the new title. An empty
        one is refused: the row shows the saved title again."""
        conv_id, title = item.data(ID_ROLE), clean_title(item.text())
        if title:
            self._save_title(conv_id, title)
        conv = self.store.conversation(conv_id)
        if conv is not None and item.text() != conv.title:
            blocked = self.list.blockSignals(True)
            item.setText(conv.title)
            self.list.blockSignals(blocked)

    def _save_title(self, conv_id: str, title: str) -> None:
        try:
            self.store.rename(conv_id, title)
        except StoreError as exc:
            self.sig_store_error.emit(str(exc))
        else:
            self.sig_renamed.emit(conv_id, title)

    def _context_menu(self, pos: QPoint) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        conv_id = item.data(ID_ROLE)
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self._ask_rename(conv_id, item.text()))
        menu.addAction("Delete", lambda: self.sig_delete.emit(conv_id))
        menu.addSeparator()
        menu.addAction("Export stats as CSV…", lambda: self.sig_export.emit(conv_id, "csv"))
        menu.addAction("Export stats as JSON…", lambda: self.sig_export.emit(conv_id, "json"))
        menu.exec(self.list.mapToGlobal(pos))

    def _ask_rename(self, conv_id: str, current: str) -> None:
        title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=current)
        if ok:
            self.rename(conv_id, title)
