"""Helpers for tests that drive the chat window (conftest's make_window and remote_window) or a
bare HUD widget: set the sampling controls, send and wait for a reply, read the banner, resize."""

from __future__ import annotations

from PySide6.QtCore import QPoint, QSize, Qt
from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import QWidget
from pytestqt.qtbot import QtBot

from engine import GenerationResult
from ui.chat_view import ACTION_SCHEME
from ui.hud.widget import HudWidget
from ui.main_window import MainWindow

WAIT_MS = 30_000  # a wait that fails the test only when something hangs, never a timing check
LONG = 240  # the tiny model (context 256) greedily runs to max tokens without an EOS


def settings(window: MainWindow, *, temperature: int, max_tokens: int) -> None:
    """Set the temperature slider (in hundredths: 100 is 1.0) and then max tokens, as the
    user would."""
    window.controls.temperature.setValue(temperature)
    window.controls.max_tokens.setValue(max_tokens)


def greedy(window: MainWindow, max_tokens: int) -> None:
    """Greedy replies (temperature 0) of at most max_tokens tokens."""
    settings(window, temperature=0, max_tokens=max_tokens)


def send_and_wait(qtbot: QtBot, window: MainWindow, text: str) -> GenerationResult:
    """Send text (asserting the window took it) and return the reply's result when it ends."""
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS) as blocker:
        assert window.send(text)
    return blocker.args[0]


def banner(window: MainWindow) -> str:
    """The notice banner's text while it shows, else ''."""
    return window.notice_label.text() if window.notice.isVisibleTo(window) else ""


def new_hud(qtbot: QtBot) -> HudWidget:
    """A HUD widget owned by qtbot, uncalibrated, at a dock's size (420 x 900), with no events."""
    widget = HudWidget(calibrate=False)
    qtbot.addWidget(widget)
    widget.resize(420, 900)
    return widget


def show_and_wait(qtbot: QtBot, widget: QWidget) -> None:
    """Show a window or HUD and wait until it is exposed (focus, sizes, scroll bars are real)."""
    widget.show()
    qtbot.waitExposed(widget)


def squeeze_and_restore(qtbot: QtBot, window: MainWindow, full: QSize, width: int) -> None:
    """Resize to the minimum (the settings dock gets narrower than width, as Qt does) and back
    to full; return once the dock is back at width."""
    dock = window.settings_dock
    window.resize(window.minimumSizeHint())
    qtbot.waitUntil(lambda: dock.width() < width, timeout=WAIT_MS)
    window.resize(full)
    qtbot.waitUntil(lambda: dock.width() == width, timeout=WAIT_MS)


def click_chat(qtbot: QtBot, window: MainWindow, conv_id: str) -> None:
    """Click a chat in the sidebar, as the user opens it."""
    chats = window.sidebar.list
    rect = chats.visualItemRect(chats.item(window.sidebar.visible_ids().index(conv_id)))
    qtbot.mouseClick(chats.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    assert window.conversation_id == conv_id


def link_position(window: MainWindow, href: str) -> QPoint:
    """Where the chat view draws the link to href, in its viewport (scrolled into view)."""
    chat = window.chat
    doc = chat.document()
    cursor = QTextCursor(doc)
    inside = []  # positions after each of the link's characters
    for position in range(1, doc.characterCount()):
        cursor.setPosition(position)  # its format is the character's before it
        if cursor.charFormat().anchorHref() == href:
            inside.append(position)
    assert inside, f"no link to {href}"
    cursor.setPosition(inside[len(inside) // 2])  # the middle of the link
    bar = chat.verticalScrollBar()
    rect = chat.cursorRect(cursor)
    if not chat.viewport().rect().contains(rect):
        bar.setValue(bar.value() + rect.top() - chat.viewport().height() // 2)
        rect = chat.cursorRect(cursor)
    return rect.center()


def click_stats_line(qtbot: QtBot, window: MainWindow, message_id: int) -> None:
    """Click the quiet stats line under a saved reply, as the user does."""
    qtbot.mouseClick(window.chat.viewport(), Qt.MouseButton.LeftButton,
                     pos=link_position(window, f"{ACTION_SCHEME}:stats/{message_id}"))
