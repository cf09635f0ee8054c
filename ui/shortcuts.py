"""The window's menus and keyboard shortcuts, and Help → Keyboard shortcuts listing them all.

Every shortcut is a window-wide QAction (its keys work wherever the focus is); the dialog lists
the actions' keys, then the keys the widgets handle themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QKeySequence, QShortcut
from PySide6.QtWidgets import QDialog, QDockWidget, QMenuBar, QWidget

from engine.events import ModelInfo
from engine.protocol import Backend
from ui.about import ShortcutsDialog, show_about
from ui.chat_export import ChatExports
from ui.composer import Composer
from ui.controls import ControlsPanel
from ui.sidebar import Sidebar

# Keys the widgets handle themselves, listed in Help → Keyboard shortcuts with the menus' own.
WIDGET_KEYS = (("Enter", "Send the message"), ("Shift+Enter", "New line in the message"),
               ("Esc", "Stop the reply, cancel an edit, or clear the search"),
               ("Tab", "Next field"))


class MenuHost(Protocol):
    """What the menus act on: the main window (ui/main_window.py), named here so that this
    module does not import the window that imports it."""

    @property
    def engine(self) -> Backend: ...
    @property
    def sidebar(self) -> Sidebar: ...
    @property
    def composer(self) -> Composer: ...
    @property
    def controls(self) -> ControlsPanel: ...
    @property
    def chat_exports(self) -> ChatExports: ...
    @property
    def settings_dock(self) -> QDockWidget: ...
    @property
    def hud_dock(self) -> QDockWidget: ...
    @property
    def conversation_id(self) -> str | None: ...
    @property
    def model_info(self) -> ModelInfo | None: ...

    def window(self) -> QWidget:
        """The top-level widget (QWidget.window(): the main window itself)."""
        ...

    def menuBar(self) -> QMenuBar: ...
    def new_chat(self) -> None: ...
    def switch_chat(self, step: int) -> None: ...
    def delete_current_chat(self) -> None: ...
    def choose_model(self) -> None: ...
    def quit(self) -> None: ...


class WindowMenus:
    """The Chat, View and Help menus of a main window and their shortcuts."""

    def __init__(self, window: MenuHost) -> None:
        self.window = w = window
        self._widget = window.window()  # the QWidget the actions and dialogs belong to
        self.new_action = self._action("New chat", w.new_chat, QKeySequence.StandardKey.New)
        self.search_action = self._action("Search chats", w.sidebar.focus_search,
                                          QKeySequence.StandardKey.Find)
        self.next_chat_action = self._action("Next chat", lambda: w.switch_chat(1),
                                             "Ctrl+Tab", "Ctrl+PgDown")
        self.previous_chat_action = self._action("Previous chat", lambda: w.switch_chat(-1),
                                                 "Ctrl+Shift+Tab", "Ctrl+PgUp")
        self.rename_action = self._action("Rename chat", w.sidebar.start_rename, "F2")
        self.delete_action = self._action("Delete chat…", w.delete_current_chat,
                                          "Ctrl+Shift+Backspace")
        self.quit_action = self._action("Quit", w.quit, "Ctrl+Q")
        chat_menu = w.menuBar().addMenu("&Chat")
        for action in (self.new_action, self.search_action, self.next_chat_action,
                       self.previous_chat_action, self.rename_action, self.delete_action):
            chat_menu.addAction(action)
        chat_menu.addSeparator()
        self.export_csv_action = chat_menu.addAction(
            "Export chat stats as CSV…", lambda: w.chat_exports.ask(w.conversation_id, "csv"))
        self.export_json_action = chat_menu.addAction(
            "Export chat stats as JSON…", lambda: w.chat_exports.ask(w.conversation_id, "json"))
        chat_menu.addSeparator()
        chat_menu.addAction("Choose model…", w.choose_model)
        chat_menu.addAction("Compare backends…", self.compare_backends)
        chat_menu.addSeparator()
        chat_menu.addAction(self.quit_action)
        view_menu = w.menuBar().addMenu("&View")
        view_menu.addAction(w.settings_dock.toggleViewAction())
        view_menu.addAction(w.hud_dock.toggleViewAction())
        help_menu = w.menuBar().addMenu("&Help")
        self.shortcuts_action = self._action("Keyboard shortcuts", self.show_shortcuts)
        help_menu.addAction(self.shortcuts_action)
        help_menu.addAction("About Phasewise", lambda: show_about(self._widget, w.model_info))
        QShortcut(QKeySequence(Qt.Key.Key_Escape), self._widget, w.composer.escape)

    def _action(self, text: str, slot: Callable[[], object],
                *keys: QKeySequence | QKeySequence.StandardKey | str) -> QAction:
        """A window-wide action (its keys work wherever the focus is)."""
        action = QAction(text, self._widget)
        action.setShortcuts([QKeySequence(k) for k in keys])
        action.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
        action.triggered.connect(slot)
        self._widget.addAction(action)
        return action

    def compare_backends(self) -> QDialog:
        """Open Compare mode: the composer's prompt on two backends, overlaid (the chat's
        backend is not disturbed). Returns the dialog."""
        from ui.compare import CompareDialog

        w = self.window
        dialog = CompareDialog.for_engine(w.engine, w.controls.params(), w.composer.text(),
                                          self._widget)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.show()
        return dialog

    def shortcut_rows(self) -> list[tuple[str, str]]:
        """(keys, action) for every shortcut: the window's actions, then the widgets' keys."""
        fmt = QKeySequence.SequenceFormat.NativeText
        rows = [(", ".join(k.toString(fmt) for k in a.shortcuts() if not k.isEmpty()),
                 a.text().rstrip("…")) for a in self._widget.actions()]
        return [row for row in rows if row[0]] + list(WIDGET_KEYS)

    def show_shortcuts(self) -> ShortcutsDialog:
        dialog = ShortcutsDialog(self.shortcut_rows(), self._widget)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.show()
        return dialog
