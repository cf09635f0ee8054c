"""Issue 20's first-hour findings in the window (items 1, 2, 4-7, 10-13 and leftovers), through
the app's own wiring (app.gui's build_window over the tiny engine)."""

from __future__ import annotations

import csv
from typing import Any

from PySide6.QtCore import QPoint, Qt
from PySide6.QtWidgets import QMessageBox, QScrollArea

from engine import TokenEmitted
from tests.support.window_helpers import (
    WAIT_MS,
    banner,
    greedy,
    send_and_wait,
    show_and_wait,
    squeeze_and_restore,
)
from tests.support.window_scenarios import Gate

HUGE_SEED = "99999999999999999999999"


# ----- item 1: the seed field ------------------------------------------------------------------
def test_the_seed_field_takes_only_a_whole_number_in_range(qtbot, make_window) -> None:
    window = make_window()
    seed = window.controls.seed
    qtbot.keyClicks(seed, "abc-1.5")
    assert seed.text() == "15"  # letters, signs and points cannot be typed
    seed.clear()
    qtbot.keyClicks(seed, HUGE_SEED)
    assert int(seed.text()) < 2**63  # the digit that would overflow is not taken
    assert window.controls.params().seed == int(seed.text())
    seed.clear()
    assert window.controls.params().seed is None  # blank is random


def test_a_bad_seed_is_refused_before_regenerate_deletes_the_reply(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, 8)
    send_and_wait(qtbot, window, "Hello")
    before = window.store.messages(window.conversation_id)
    window.controls.seed.setText(HUGE_SEED)  # e.g. from a hand-edited settings file

    window.regenerate(before[-1].id)

    assert window.reply is None
    assert window.store.messages(window.conversation_id) == before  # the reply is kept
    text = banner(window)
    assert text.startswith("Not sent: seed must be from 0 to 2**63 - 1")
    assert "\n" not in text and "Overflow" not in text
    assert not window.send("Another")  # a send is refused the same way, the text kept
    assert window.store.messages(window.conversation_id) == before


# ----- item 2: drafts are kept per chat ------------------------------------------------------
def test_drafts_stay_with_their_chat_across_switches_and_a_restart(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, 8)
    window.controls.temperature.setValue(80)  # sampled: alternatives differ
    window.composer.alternatives.setValue(2)
    with qtbot.waitSignal(window.sig_alternatives_ready, timeout=WAIT_MS):
        assert window.send("Hello")
    chat_a = window.conversation_id
    window.composer.set_text("Thanks")
    assert not window.send(window.composer.text())  # keep an alternative first
    assert window.composer.text() == "Thanks"

    window.menus.new_action.trigger()  # Ctrl+N
    assert window.composer.text() == ""  # A's draft stayed with A
    window.composer.alternatives.setValue(1)
    qtbot.keyClicks(window.composer.editor, "What is the capital of France?")
    send_and_wait(qtbot, window, window.composer.text())
    chat_b = window.conversation_id
    assert window.store.conversation(chat_b).title == "What is the capital of France?"

    window.composer.set_text("half a thought")
    window.open_conversation(chat_a)
    assert window.composer.text() == "Thanks"
    window.open_conversation(chat_b)
    assert window.composer.text() == "half a thought"
    window.close()

    restarted = make_window()
    assert restarted.conversation_id == chat_b
    assert restarted.composer.text() == "half a thought"
    restarted.open_conversation(chat_a)
    assert restarted.composer.text() == "Thanks"


# ----- item 5: banners clear when their cause does -------------------------------------------
def test_model_banners_clear_when_a_model_loads(qtbot, make_window, tiny_model_dir,
                                                tmp_path) -> None:
    window = make_window()
    with qtbot.waitSignal(window.bridge.sig_model_load_failed, timeout=WAIT_MS):
        window.load_model(str(tmp_path / "no-such-model"))
    assert banner(window).startswith("Model not loaded")
    with qtbot.waitSignal(window.bridge.sig_model_loaded, timeout=WAIT_MS):
        window.load_model(str(tiny_model_dir))
    assert banner(window) == ""

    window.session.model_info = None  # as while the first model is still loading
    assert not window.send("Hello")
    assert banner(window).startswith("No model is loaded yet")
    assert not banner(window).endswith("….")  # no stray period after the ellipsis
    with qtbot.waitSignal(window.bridge.sig_model_loaded, timeout=WAIT_MS):
        window.load_model(str(tiny_model_dir))
    assert banner(window) == ""


def test_the_busy_banner_clears_when_the_reply_ends(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, 200)
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS):
        assert window.send("Hello")
        assert not window.send("Again")
        assert banner(window).startswith("A reply is still being written")
    assert banner(window) == ""

    window.notify("Copied somewhere")  # a notice with no cause stays until dismissed
    window.new_chat()
    assert banner(window) == "Copied somewhere"


# ----- item 6: rename ----------------------------------------------------------------------------
def test_rename_updates_the_header_and_an_empty_title_is_refused(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, 2)
    send_and_wait(qtbot, window, "Hello")
    conv_id = window.conversation_id
    item = window.sidebar.list.currentItem()

    item.setText("  Greetings  ")  # what an inline edit (F2) commits
    assert window.pane.title_label.text() == "Greetings"
    assert window.store.conversation(conv_id).title == "Greetings"

    item.setText("   ")
    assert window.sidebar.list.currentItem().text() == "Greetings"  # no blank row
    assert window.store.conversation(conv_id).title == "Greetings"
    assert window.pane.title_label.text() == "Greetings"

    window.sidebar.rename(conv_id, "")  # the context menu's dialog
    assert window.store.conversation(conv_id).title == "Greetings"
    window.sidebar.rename(conv_id, "Hi there")
    assert window.pane.title_label.text() == "Hi there"


# ----- item 4: destructive actions ask first -----------------------------------------------------
class Answers:
    """QMessageBox.question, answered: records each question and its default button."""

    def __init__(self, answer: QMessageBox.StandardButton) -> None:
        self.answer = answer
        self.asked: list[tuple[str, QMessageBox.StandardButton]] = []

    def __call__(self, _parent, _title, text, _buttons, default) -> QMessageBox.StandardButton:
        self.asked.append((text, default))
        return self.answer


def test_delete_chat_asks_first_and_no_keeps_it(qtbot, make_window, monkeypatch) -> None:
    window = make_window()
    greedy(window, 2)
    send_and_wait(qtbot, window, "Keep me")
    conv_id = window.conversation_id
    answers = Answers(QMessageBox.StandardButton.No)
    monkeypatch.setattr(QMessageBox, "question", answers)

    window.sidebar.sig_delete.emit(conv_id)  # the context menu's Delete
    assert "Keep me" in answers.asked[0][0]
    assert answers.asked[0][1] == QMessageBox.StandardButton.No  # the default keeps the chat
    assert window.store.conversation(conv_id) is not None
    assert window.conversation_id == conv_id

    answers.answer = QMessageBox.StandardButton.Yes
    window.sidebar.sig_delete.emit(conv_id)
    assert window.store.conversation(conv_id) is None


def test_edit_and_resend_says_how_many_turns_it_drops(qtbot, make_window, monkeypatch) -> None:
    """Asked at the resend, once the edit is written; a No keeps the edited text in the
    composer, still editing (issue 31 item 10: it was asked at Edit, and lost the text)."""
    window = make_window()
    greedy(window, 2)
    for text in ("First", "Second", "Third"):
        send_and_wait(qtbot, window, text)
    messages = window.store.messages(window.conversation_id)
    answers = Answers(QMessageBox.StandardButton.No)
    monkeypatch.setattr(QMessageBox, "question", answers)

    window.edit(messages[-2].id)  # the last message: only its own reply is replaced
    assert window.composer.editing and window.composer.text() == "Third"
    window.composer.escape()

    window.edit(messages[0].id)
    assert window.composer.editing and window.composer.text() == "First"
    assert answers.asked == []  # nothing is lost by editing: the question waits for Send
    window.composer.set_text("First, edited")
    window.composer._send()  # Enter
    assert "2 later turns" in answers.asked[0][0]
    assert answers.asked[0][1] == QMessageBox.StandardButton.No
    assert window.composer.editing and window.composer.text() == "First, edited"
    assert len(window.store.messages(window.conversation_id)) == 6  # nothing deleted

    answers.answer = QMessageBox.StandardButton.Yes
    send_and_wait(qtbot, window, "First, again")
    after = window.store.messages(window.conversation_id)
    assert [m.role for m in after] == ["user", "assistant"] and after[0].content == "First, again"
    assert not window.composer.editing and window.composer.text() == ""


# ----- item 10: keyboard -------------------------------------------------------------------------
def test_tab_from_the_message_box_never_types_into_the_system_prompt(qtbot, make_window) -> None:
    window = make_window()
    show_and_wait(qtbot, window)
    editor, prompt = window.composer.editor, window.controls.system_prompt
    prompt.setPlainText("Be brief.")
    editor.setFocus()
    qtbot.waitUntil(editor.hasFocus)
    for _ in range(8):  # past the composer's buttons into the settings and beyond
        qtbot.keyClick(window.focusWidget(), Qt.Key.Key_Tab)
    assert prompt.toPlainText() == "Be brief."
    assert "\t" not in editor.toPlainText()
    prompt.setFocus()
    qtbot.keyClick(prompt, Qt.Key.Key_Tab)
    assert prompt.toPlainText() == "Be brief." and not prompt.hasFocus()


def test_shortcuts_search_and_switch_chats_and_are_all_listed(qtbot, make_window,
                                                             monkeypatch) -> None:
    window = make_window()
    show_and_wait(qtbot, window)
    greedy(window, 2)
    chats = []
    for text in ("One", "Two", "Three"):
        window.new_chat()
        send_and_wait(qtbot, window, text)
        chats.append(window.conversation_id)
    listed = window.sidebar.visible_ids()  # newest first
    window.composer.focus()
    qtbot.waitUntil(window.composer.editor.hasFocus)

    qtbot.keyClick(window.composer.editor, Qt.Key.Key_Tab, Qt.KeyboardModifier.ControlModifier)
    assert window.conversation_id == listed[1]
    qtbot.keyClick(window.focusWidget(), Qt.Key.Key_PageDown, Qt.KeyboardModifier.ControlModifier)
    assert window.conversation_id == listed[2]
    qtbot.keyClick(window.focusWidget(), Qt.Key.Key_PageUp, Qt.KeyboardModifier.ControlModifier)
    assert window.conversation_id == listed[1]
    window.menus.previous_chat_action.trigger()
    assert window.conversation_id == listed[0]

    qtbot.keyClick(window.focusWidget(), Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)
    assert window.sidebar.search.hasFocus()

    chat_menu = window.menuBar().actions()[0].menu()
    assert {window.menus.rename_action, window.menus.delete_action} <= set(chat_menu.actions())
    monkeypatch.setattr(QMessageBox, "question", lambda *_a: QMessageBox.StandardButton.Yes)
    window.menus.delete_action.trigger()
    assert window.store.conversation(listed[0]) is None

    dialog = window.menus.show_shortcuts()
    rows = dict((action, keys) for keys, action in dialog.rows())
    for action in ("New chat", "Search chats", "Next chat", "Previous chat", "Rename chat",
                   "Delete chat", "Quit"):
        assert rows[action], action
    assert "Ctrl+Tab" in rows["Next chat"] and "F2" in rows["Rename chat"]
    assert "Enter" in dict(dialog.rows()) and "Esc" in dict(dialog.rows())
    dialog.close()


# ----- item 7 (window side): the HUD's reply picker names replies by chat and turn -------------
def test_the_hud_picker_names_replies_by_chat_and_turn(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, 2)
    send_and_wait(qtbot, window, "Trip ideas")
    send_and_wait(qtbot, window, "More")
    window.controls.temperature.setValue(80)
    window.composer.alternatives.setValue(2)
    with qtbot.waitSignal(window.sig_alternatives_ready, timeout=WAIT_MS):
        assert window.send("And more")
    combo = window.hud.reply_combo
    qtbot.waitUntil(lambda: combo.count() >= 4, timeout=WAIT_MS)

    names = [combo.itemText(i) for i in range(combo.count())]
    assert "Trip ideas · turn 1" in names and "Trip ideas · turn 2" in names
    assert {"Trip ideas · turn 3 · alternative 1",
            "Trip ideas · turn 3 · alternative 2"} <= set(names)
    assert not any("req-" in name for name in names)


# ----- item 11: max tokens has a number box beside its slider -----------------------------------
def test_max_tokens_has_a_number_box_kept_in_step_with_the_slider(qtbot, make_window) -> None:
    window = make_window()
    controls = window.controls
    slider, box = controls.max_tokens, controls.max_tokens_box
    context = window.model_info.context_length
    assert box.maximum() == slider.maximum() == context and box.value() == slider.value()
    changes: list[tuple[str, object]] = []
    controls.sig_setting_changed.connect(lambda name, value: changes.append((name, value)))

    exact = context // 2 + 1
    box.lineEdit().selectAll()
    qtbot.keyClicks(box, str(exact))
    qtbot.keyClick(box, Qt.Key.Key_Return)
    assert slider.value() == exact and controls.params().max_tokens == exact
    assert changes == [("max_tokens", exact)]  # typing the number is one change, not one a digit

    slider.setValue(3)
    assert box.value() == 3
    controls.set_context_length(2)  # a smaller model clamps both
    assert box.maximum() == 2 and box.value() == slider.value() == 2


# ----- item 11: the docks get their width back after the window was squeezed -------------------
def hud_scrolls_sideways(window: Any) -> bool:
    scroll = window.hud.findChild(QScrollArea)
    return scroll.horizontalScrollBar().isVisible()


def test_docks_recover_their_width_after_a_trip_to_the_minimum_size(qtbot, make_window) -> None:
    window = make_window()
    show_and_wait(qtbot, window)
    dock, full = window.settings_dock, window.size()
    width = dock.width()
    assert not hud_scrolls_sideways(window)

    squeeze_and_restore(qtbot, window, full, width)
    assert window.hud_dock.width() == width and not hud_scrolls_sideways(window)

    window.resize(full.width() - 300, full.height())  # a smaller window: the chat gives way
    qtbot.waitUntil(lambda: window.width() == full.width() - 300, timeout=WAIT_MS)
    assert dock.width() == width
    window.close()
    restarted = make_window()  # the chosen width is kept across a restart
    assert restarted.dock_widths.wanted == width


def test_a_dragged_dock_width_is_the_one_given_back(qtbot, make_window) -> None:
    window = make_window()
    show_and_wait(qtbot, window)
    dock, full = window.settings_dock, window.size()
    width = dock.width()
    gap = (window.centralWidget().geometry().right() + dock.geometry().left()) // 2
    grip = QPoint(gap, dock.geometry().center().y())  # the separator between chat and docks
    qtbot.mousePress(window, Qt.MouseButton.LeftButton, pos=grip)
    qtbot.mouseMove(window, grip + QPoint(60, 0))
    qtbot.waitUntil(lambda: dock.width() < width, timeout=WAIT_MS)  # Qt moves it on a timer
    qtbot.mouseRelease(window, Qt.MouseButton.LeftButton, pos=grip + QPoint(60, 0))
    dragged = dock.width()
    assert window.dock_widths.wanted == dragged

    squeeze_and_restore(qtbot, window, full, dragged)


# ----- item 12: settings that would do nothing say so ------------------------------------------
def test_prompt_lookup_says_when_it_cannot_run_and_the_export_records_it(qtbot, make_window,
                                                                         tmp_path) -> None:
    window = make_window()
    controls = window.controls
    controls.max_tokens.setValue(8)
    controls.temperature.setValue(80)
    note = controls.speculative_note
    assert not note.isVisibleTo(controls)
    controls.speculative.setCurrentIndex(controls.speculative.findData("ngram"))
    assert note.isVisibleTo(controls) and "greedy replies only" in note.text()
    assert send_and_wait(qtbot, window, "Hello hello hello").speculative is None  # plain

    controls.temperature.setValue(0)
    assert not note.isVisibleTo(controls)
    assert send_and_wait(qtbot, window, "Hello hello hello").speculative == "ngram"
    controls.temperature.setValue(30)
    assert note.isVisibleTo(controls)
    controls.speculative.setCurrentIndex(0)  # Off: nothing to warn about
    assert not note.isVisibleTo(controls)

    path = window.hud.export_csv(tmp_path / "session.csv")[0]  # the HUD's session export
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["speculative"] for row in rows] == ["", "ngram"]  # which replies drafted


def test_greedy_offers_one_reply_instead_of_identical_alternatives(qtbot, make_window) -> None:
    window = make_window()
    spin = window.composer.alternatives
    window.controls.temperature.setValue(80)
    spin.setValue(3)
    greedy(window, 4)
    assert not spin.isEnabled() and spin.value() == 1 and "temperature" in spin.toolTip()
    assert window.composer.alternative_count() == 1
    reply = send_and_wait(qtbot, window, "Hello")  # one reply, not three identical ones
    assert window.conversation_id not in window.session.alternative_sets
    before = window.store.messages(window.conversation_id)

    window.generate_alternatives(before[-1].id)  # the Alternatives link under the reply
    assert banner(window).startswith("Alternatives need a temperature above 0")
    assert window.store.messages(window.conversation_id) == before  # the reply is kept
    assert window.reply is None and reply.text == before[-1].content

    window.controls.temperature.setValue(80)  # sampling again: the count comes back
    assert spin.isEnabled() and spin.value() == 3


# ----- item 13: the sidebar, and a chat reopened after a restart ------------------------------
def test_the_sidebar_marks_chats_writing_in_the_background(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, 2)
    send_and_wait(qtbot, window, "Short one")
    chat_b = window.conversation_id
    window.new_chat()
    greedy(window, 200)  # the tiny model writes to max tokens
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS):
        assert window.send("Long one")
        chat_a = window.conversation_id
        assert window.sidebar.streaming_ids() == [chat_a]
        window.open_conversation(chat_b)  # A keeps writing in the background
        assert window.sidebar.streaming_ids() == [chat_a]
        row = window.sidebar.list.item(window.sidebar.visible_ids().index(chat_a))
        assert not row.icon().isNull() and "Writing a reply" in row.toolTip()
        assert row.text() == "Long one"  # the mark is not part of the title
    assert window.sidebar.streaming_ids() == []
    assert row_icon_cleared(window, chat_a)
    assert window.store.conversation(chat_a).title == "Long one"


def row_icon_cleared(window: Any, conv_id: str) -> bool:
    row = window.sidebar.list.item(window.sidebar.visible_ids().index(conv_id))
    return row.icon().isNull() and "Writing" not in row.toolTip()


def test_a_search_with_no_match_says_so(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, 2)
    send_and_wait(qtbot, window, "Paris trip")
    sidebar = window.sidebar
    qtbot.keyClicks(sidebar.search, "zebra")
    assert sidebar.list.count() == 0
    assert sidebar.empty_label.isVisibleTo(sidebar)
    assert sidebar.empty_label.text() == "No chats match “zebra”."
    sidebar.search.clear()
    assert sidebar.list.count() == 1 and not sidebar.empty_label.isVisibleTo(sidebar)


def test_after_a_restart_a_chat_opens_at_its_end_and_counts_its_stopped_turn(
        qtbot, make_window) -> None:
    window = make_window()
    greedy(window, 12)
    for text in ("One", "Two", "Three"):
        send_and_wait(qtbot, window, text)
    greedy(window, 200)  # the tiny model (context 256) writes until the context is full
    # The engine is held at the reply's sixth token: the reply cannot reach its end (a few
    # dozen tokens away) before the window closes, however the tokens' delivery is batched.
    gate = Gate(window.session.backend, lambda e: isinstance(e, TokenEmitted) and e.index == 5)
    assert window.send("Four")
    reply = window.reply
    gate.wait(qtbot, WAIT_MS)
    qtbot.waitUntil(lambda: reply.prompt_tokens is not None and reply.output_tokens >= 3,
                    timeout=WAIT_MS)
    window.close()  # the reply is cut short (Ctrl+Q while it writes)
    gate.release()
    used = reply.prompt_tokens + reply.output_tokens

    restarted = make_window()
    restarted.resize(900, 360)  # short enough that the chat scrolls
    show_and_wait(qtbot, restarted)
    bar = restarted.chat.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0, timeout=WAIT_MS)
    assert bar.value() == bar.maximum()  # at its end, where the last turn is
    last = restarted.store.messages(restarted.conversation_id)[-1]
    assert last.status == "stopped" and last.content == reply.text
    assert restarted.status.context_label.text().startswith(f"context {used:,} / ")


# ----- leftover of item 5: the draft model's notices clear when their cause does ----------------
def test_draft_notices_clear_when_a_draft_loads_or_the_mode_changes(qtbot, make_window,
                                                                    tiny_model_dir,
                                                                    tmp_path) -> None:
    window = make_window()
    bridge, combo = window.bridge, window.controls.speculative

    def fail_a_draft_load() -> None:
        with qtbot.waitSignal(bridge.sig_draft_load_failed, timeout=WAIT_MS):
            window.engine.load_draft(str(tmp_path / "no-such-draft"))
        assert banner(window).startswith("Draft model not loaded")

    fail_a_draft_load()
    with qtbot.waitSignal(bridge.sig_draft_changed, timeout=WAIT_MS):
        window.engine.load_draft(str(tiny_model_dir), kernel="fp32-eager")
    assert banner(window) == ""  # a later load worked

    combo.setCurrentIndex(combo.findData("draft"))  # drafting with the loaded one
    fail_a_draft_load()
    assert "Still drafting with" in banner(window)
    combo.setFocus()
    qtbot.keyClick(combo, Qt.Key.Key_Up)  # the user picks prompt lookup instead
    assert window.controls.speculative_mode() == "ngram"
    assert banner(window) == ""

    window.notify("Something else")  # other notices stay
    qtbot.keyClick(combo, Qt.Key.Key_Up)
    assert window.controls.speculative_mode() is None and banner(window) == "Something else"
