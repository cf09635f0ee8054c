"""Issue 20's first hour as one scripted walk through the window (app.gui's build_window over
the tiny engine): send, stop, regenerate, edit & resend, × 2 alternatives and keep one, rename,
switch chats with drafts, export to a missing folder, a huge seed, resize to the minimum and
back. At the end no message is lost or in the wrong chat, no banner outlives its cause, and
nothing raised or logged a traceback."""

from __future__ import annotations

import logging
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFileDialog, QToolButton

from tests.support.window_helpers import (
    WAIT_MS,
    banner,
    greedy,
    settings,
    show_and_wait,
    squeeze_and_restore,
)

HUGE_SEED = "99999999999999999999999"


def type_and_send(qtbot, window: Any, text: str) -> Any:
    """Type into the message box and press Enter; the finished reply's result."""
    window.composer.clear()
    qtbot.keyClicks(window.composer.editor, text)
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS) as finished:
        qtbot.keyClick(window.composer.editor, Qt.Key.Key_Return)
    return finished.args[0]


def transcript(window: Any, conv_id: str) -> list[tuple[str, str]]:
    """(role, text) per saved message; a reply's text is '*' (the model's words vary)."""
    return [(m.role, m.content if m.role == "user" else "*")
            for m in window.store.messages(conv_id)]


def hud_export_button(window: Any) -> QToolButton:
    return next(b for b in window.hud.findChildren(QToolButton) if b.text() == "Export")


def test_the_first_hour(qtbot, make_window, monkeypatch, tmp_path, caplog, capfd) -> None:
    caplog.set_level(logging.WARNING)
    window = make_window()
    show_and_wait(qtbot, window)
    with qtbot.captureExceptions() as exceptions:
        walk(qtbot, window, monkeypatch, tmp_path)
    assert not exceptions
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not logged, [r.getMessage() for r in logged]
    assert "Traceback" not in capfd.readouterr().err


def walk(qtbot, window: Any, monkeypatch, tmp_path) -> None:
    # Send.
    greedy(window, 6)
    type_and_send(qtbot, window, "Hello there")
    chat_a = window.conversation_id

    # Stop (Esc) a long reply: its partial text is kept, marked stopped.
    greedy(window, 200)  # the tiny model writes to max tokens
    window.composer.clear()
    qtbot.keyClicks(window.composer.editor, "Tell me a long story")
    qtbot.keyClick(window.composer.editor, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: bool(window.reply and window.reply.text), timeout=WAIT_MS)
    assert window.sidebar.streaming_ids() == [chat_a]
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS) as stopped:
        qtbot.keyClick(window.composer.editor, Qt.Key.Key_Escape)
    assert stopped.args[0].finish_reason == "cancelled"
    saved = window.store.messages(chat_a)
    assert (saved[-1].status, saved[-1].content) == ("stopped", stopped.args[0].text)
    assert window.sidebar.streaming_ids() == []

    # Regenerate the stopped reply.
    greedy(window, 6)
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS):
        window.chat.sig_action.emit("regenerate", saved[-1].id)
    regenerated = window.store.messages(chat_a)
    assert regenerated[-1].id != saved[-1].id and regenerated[-1].status != "stopped"

    # Edit & resend the last message (only its own reply goes: nothing is asked).
    window.chat.sig_action.emit("edit", regenerated[-2].id)
    assert window.composer.editing and window.composer.text() == "Tell me a long story"
    type_and_send(qtbot, window, "Tell me a short story")
    assert not window.composer.editing
    assert transcript(window, chat_a) == [("user", "Hello there"), ("assistant", "*"),
                                          ("user", "Tell me a short story"), ("assistant", "*")]

    # × 2 alternatives (sampled), keep the second.
    settings(window, temperature=80, max_tokens=6)
    window.composer.alternatives.setValue(2)
    with qtbot.waitSignal(window.sig_alternatives_ready, timeout=WAIT_MS):
        assert window.send("Two takes")
    kept = window.session.alternative_sets[chat_a].results[1].text
    window.chat.sig_action.emit("keep", 1)
    assert window.store.messages(chat_a)[-1].content == kept
    window.composer.alternatives.setValue(1)

    # Rename.
    window.sidebar.rename(chat_a, "  Stories  ")
    assert window.pane.title_label.text() == window.store.conversation(chat_a).title == "Stories"

    # Switch chats with drafts in the box: each draft stays with its chat.
    qtbot.keyClicks(window.composer.editor, "draft for A")
    window.menus.new_action.trigger()
    assert window.composer.text() == ""
    qtbot.keyClicks(window.composer.editor, "draft for B")
    window.open_conversation(chat_a)
    assert window.composer.text() == "draft for A"
    window.menus.new_action.trigger()
    assert window.composer.text() == "draft for B"
    greedy(window, 6)
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS):
        qtbot.keyClick(window.composer.editor, Qt.Key.Key_Return)
    chat_b = window.conversation_id
    assert chat_b != chat_a and window.store.conversation(chat_b).title == "draft for B"
    window.open_conversation(chat_a)
    assert window.composer.text() == "draft for A"

    # Export to a folder that does not exist: each export says why, in one line.
    missing = tmp_path / "no" / "such" / "folder" / "stats.csv"
    monkeypatch.setattr(QFileDialog, "getSaveFileName",
                        lambda *_a, **_k: (str(missing), "CSV (*.csv)"))
    hud_export_button(window).menu().actions()[0].trigger()  # Session metrics as CSV…
    assert window.hud.export_label.text().startswith("Export failed:")
    window.sidebar.sig_export.emit(chat_a, "csv")  # the chat's own stats
    assert banner(window).startswith("Export failed:") and "\n" not in banner(window)
    assert not missing.parent.exists()

    # A huge seed is refused before Regenerate deletes anything.
    before = window.store.messages(chat_a)
    window.controls.seed.setText(HUGE_SEED)
    window.regenerate(before[-1].id)
    assert banner(window).startswith("Not sent: seed must be from 0 to 2**63 - 1")
    assert window.store.messages(chat_a) == before and window.reply is None
    window.controls.seed.clear()

    # Resize to the minimum and back: the docks get their width back.
    full, width = window.size(), window.settings_dock.width()
    squeeze_and_restore(qtbot, window, full, width)

    # The draft goes out as A's next message; the refusal's banner goes with the send.
    window.composer.set_text(window.composer.text() + ", thanks")
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS):
        qtbot.keyClick(window.composer.editor, Qt.Key.Key_Return)
    assert banner(window) == ""
    assert transcript(window, chat_a) == [
        ("user", "Hello there"), ("assistant", "*"), ("user", "Tell me a short story"),
        ("assistant", "*"), ("user", "Two takes"), ("assistant", "*"),
        ("user", "draft for A, thanks"), ("assistant", "*")]
    assert transcript(window, chat_b) == [("user", "draft for B"), ("assistant", "*")]
    assert all(m.status != "streaming" for c in (chat_a, chat_b)
               for m in window.store.messages(c))
    assert sorted(window.sidebar.visible_ids()) == sorted([chat_a, chat_b])
    assert window.sidebar.streaming_ids() == [] and window.session.replies == {}
