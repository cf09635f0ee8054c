"""What a user does in the window that the other window tests leave out, through the app's own
factory (conftest's make_window): a system prompt per chat, Compare opened from the menu, the
real key presses for the shortcuts, and a chat that outgrows the model's context.

Where a test checks what the engine did, it reads the engine's own record (a listener on the
engine thread, its prefix cache, a tokenizer of its own), never the object the window shows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtCore import QSettings, Qt
from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import QApplication, QMessageBox, QWidget
from pytestqt.qtbot import QtBot
from transformers import AutoTokenizer

from engine import GenerationResult, PrefillStarted, RequestFinished
from engine.worker import Engine
from tests.support.split_reply import SPLIT_SEEDS, first_split_reply
from tests.support.window_helpers import (
    WAIT_MS,
    banner,
    greedy,
    send_and_wait,
    settings,
    show_and_wait,
)
from ui.compare import LOCAL, TABLE_ROWS, CompareDialog
from ui.main_window import MainWindow

CONTEXT = 256  # the tiny model's context length
Mod = Qt.KeyboardModifier


@pytest.fixture
def engine_events(tiny_engine: Engine) -> Iterator[list[object]]:
    """Every event the engine sends, as its own thread sends it (not what the window kept)."""
    events: list[object] = []
    tiny_engine.add_listener(events.append)
    yield events
    tiny_engine.remove_listener(events.append)


@pytest.fixture
def engine_results(engine_events: list[object]) -> _Results:
    """The results the engine delivered, oldest first."""
    return _Results(engine_events)


class _Results:
    """A live view of the results among the engine's events."""

    def __init__(self, events: list[object]) -> None:
        self.events = events

    def _all(self) -> list[GenerationResult]:
        return [e.result for e in self.events if isinstance(e, RequestFinished)]

    def __getitem__(self, index: int) -> GenerationResult:
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())

    def __iter__(self) -> Iterator[GenerationResult]:
        return iter(self._all())


def ledger(events: list[object], request_id: str) -> PrefillStarted:
    """The engine's prefix-cache record for one request: cached tokens and why it missed."""
    return next(e for e in events if isinstance(e, PrefillStarted) and e.request_id == request_id)


@pytest.fixture
def chat_prompt(tiny_model_dir: Path) -> Callable[[list[tuple[str, str]]], list[int]]:
    """The tokens a chat's prompt should be, from a tokenizer of the test's own."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))

    def encode(messages: list[tuple[str, str]]) -> list[int]:
        encoded = tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages], add_generation_prompt=True,
            tokenize=True, return_dict=True)
        return list(encoded["input_ids"])

    return encode


def type_system_prompt(qtbot: Any, window: MainWindow, text: str) -> None:
    """Replace the system prompt as a user does: select all of it, type the new one."""
    box = window.controls.system_prompt
    box.setFocus()
    qtbot.keyClick(box, Qt.Key.Key_A, Mod.ControlModifier)
    qtbot.keyClick(box, Qt.Key.Key_Delete)
    qtbot.keyClicks(box, text)


def open_chat(window: MainWindow, conv_id: str) -> None:
    """Click a chat in the sidebar."""
    sidebar_list = window.sidebar.list
    row = window.sidebar.visible_ids().index(conv_id)
    rect = sidebar_list.visualItemRect(sidebar_list.item(row))
    QtBot.mouseClick(sidebar_list.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    assert window.conversation_id == conv_id


# ----- the system prompt per chat ------------------------------------------------------------
def test_each_chat_keeps_its_own_system_prompt_and_the_engine_gets_it(
    qtbot, make_window, engine_events, engine_results, chat_prompt
) -> None:
    window = make_window()
    show_and_wait(qtbot, window)
    greedy(window, 3)
    pirate, poet = "You are a pirate.", "You are a poet."
    type_system_prompt(qtbot, window, pirate)
    first = send_and_wait(qtbot, window, "Hello")
    chat_a = window.conversation_id
    assert chat_a is not None and window.store.conversation(chat_a).system_prompt == pirate
    # The engine's prompt is the system prompt, then the message, as the template lays them.
    assert engine_results[-1].prompt_token_ids == chat_prompt([("system", pirate),
                                                               ("user", "Hello")])

    window.menus.new_action.trigger()  # chat B starts with a system prompt of its own: none
    assert window.controls.system_prompt_text() == ""
    type_system_prompt(qtbot, window, poet)
    reply_b = send_and_wait(qtbot, window, "Hi")
    chat_b = window.conversation_id
    assert chat_b not in (None, chat_a)
    assert engine_results[-1].prompt_token_ids == chat_prompt([("system", poet), ("user", "Hi")])

    open_chat(window, chat_a)
    assert window.controls.system_prompt_text() == pirate
    open_chat(window, chat_b)
    assert window.controls.system_prompt_text() == poet
    type_system_prompt(qtbot, window, "You are brief.")  # an edit of an existing chat's prompt
    open_chat(window, chat_a)
    assert window.controls.system_prompt_text() == pirate

    second = send_and_wait(qtbot, window, "And then?")
    history = [("system", pirate), ("user", "Hello"), ("assistant", first.text),
               ("user", "And then?")]
    assert engine_results[-1].prompt_token_ids == chat_prompt(history)
    # The engine's cache ledger: A's own prefix, its system prompt unchanged by B's edit.
    record = ledger(engine_events, second.request_id)
    assert record.cache_miss_reason == "none"
    assert record.cached_tokens >= len(chat_prompt([("system", pirate), ("user", "Hello")])) - 1
    window.close()

    # A restart: a second window on the same chats and settings.
    again = make_window()
    open_chat(again, chat_b)
    assert again.controls.system_prompt_text() == "You are brief."
    open_chat(again, chat_a)
    assert again.controls.system_prompt_text() == pirate
    greedy(again, 3)
    third = send_and_wait(qtbot, again, "Last one")
    history += [("assistant", second.text), ("user", "Last one")]
    assert engine_results[-1].prompt_token_ids == chat_prompt(history)
    assert ledger(engine_events, third.request_id).cache_miss_reason == "none"
    # B's edited prompt is what B's next turn runs on; the engine sees it changed.
    open_chat(again, chat_b)
    fourth = send_and_wait(qtbot, again, "Again")
    assert engine_results[-1].prompt_token_ids == chat_prompt(
        [("system", "You are brief."), ("user", "Hi"), ("assistant", reply_b.text),
         ("user", "Again")])
    assert ledger(engine_events, fourth.request_id).cache_miss_reason == "system_prompt_changed"


# ----- a sampled reply is cached whole ---------------------------------------------------------
def test_the_next_turn_reuses_the_whole_sampled_reply(
    qtbot, make_window, engine_events, tiny_model_dir: Path
) -> None:
    """A sampled reply whose text re-tokenizes to other ids (a merge the model split): the
    window sends the ids the model produced with it, so the next turn reads none of it again."""
    window = make_window()
    show_and_wait(qtbot, window)
    settings(window, temperature=100, max_tokens=6)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))

    def sample(seed: int) -> GenerationResult:  # a new chat's first reply with this seed
        window.menus.new_action.trigger()
        window.controls.seed.setText(str(seed))
        return send_and_wait(qtbot, window, "Hello there")

    # Each reply is checked, not assumed (split_reply.SPLIT_SEEDS says how rare a split is).
    first = first_split_reply(sample, tokenizer, {tokenizer.eos_token_id}, SPLIT_SEEDS)[1]
    second = send_and_wait(qtbot, window, "And then?")
    record = ledger(engine_events, second.request_id)
    # The first turn's prompt and every reply token fed back (all but the last sampled one).
    assert record.cached_tokens == len(first.prompt_token_ids) + len(first.token_ids) - 1
    assert record.cache_miss_reason == "none"
    window.close()


# ----- Compare, opened from the window's menu -----------------------------------------------------
def click_menu_item(qtbot, window: MainWindow, menu_title: str, item: str) -> None:
    """Open a menu bar menu with the mouse and click one of its items."""
    bar = window.menuBar()
    title = next(a for a in bar.actions() if a.text().replace("&", "") == menu_title)
    qtbot.mouseClick(bar, Qt.MouseButton.LeftButton, pos=bar.actionGeometry(title).center())
    menu = title.menu()
    qtbot.waitExposed(menu)
    action = next(a for a in menu.actions() if a.text() == item)
    qtbot.mouseClick(menu, Qt.MouseButton.LeftButton, pos=menu.actionGeometry(action).center())


# A menu bar's popup on the offscreen platform: it cannot raise itself or grab the keyboard.
@pytest.mark.qt_log_ignore("This plugin does not support raise",
                           "This plugin does not support grabbing the keyboard")
def test_compare_opened_from_the_menu_runs_and_shows_the_engines_numbers(
    qtbot, make_window, engine_results, tiny_engine: Engine
) -> None:
    window = make_window()
    show_and_wait(qtbot, window)
    greedy(window, 6)
    window.composer.set_text("What is 2 + 2?")
    click_menu_item(qtbot, window, "Chat", "Compare backends…")
    dialog = window.findChild(CompareDialog)
    assert dialog is not None and dialog.isVisible()
    assert dialog.local is tiny_engine  # the router lends its local engine
    assert dialog.prompt.toPlainText() == "What is 2 + 2?"
    dialog.pickers[1].set_kind(LOCAL)  # the local model on both sides
    with qtbot.waitSignal(dialog.sig_finished, timeout=WAIT_MS):
        qtbot.mouseClick(dialog.run_button, Qt.MouseButton.LeftButton)

    assert len(engine_results) == 2
    by_side = [next(r for r in engine_results if r.request_id == side.request_id)
               for side in dialog.sides]
    rows = {name: row for row, (name, _) in enumerate(TABLE_ROWS)}
    for col, result in enumerate(by_side):
        assert result.metrics.output_tokens == 6  # the window's max tokens, greedy
        assert dialog.replies[col].toPlainText() == result.text
        assert dialog.table.item(rows["output tokens"], col).text() == "6"
        prompt_cell = dialog.table.item(rows["prompt tokens"], col)
        assert prompt_cell.text() == str(result.metrics.prompt_tokens)
        assert "6 tokens" in dialog.reply_status[col].text()
    assert by_side[0].text == by_side[1].text  # one model, greedy: the same reply
    assert dialog.table.item(rows["output tokens"], 2).text() == "1.00×"
    assert window.conversation_id is None and window.reply is None  # the chat is left alone
    dialog.close()


# ----- the shortcuts, as key presses --------------------------------------------------------------
def press(qtbot, window: MainWindow, keys: str) -> None:
    """Press a key combination where the keyboard focus is, as a user does."""
    combo = QKeySequence(keys)[0]
    target = QApplication.focusWidget()
    assert target is not None and target.window() is window, "the window has no focus"
    qtbot.keyClick(target, combo.key(), combo.keyboardModifiers())


def show_active(qtbot, window: MainWindow) -> None:
    """Show the window and make it the active one: key presses go to its focus widget."""
    show_and_wait(qtbot, window)
    window.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is window, timeout=WAIT_MS)
    qtbot.waitUntil(lambda: QApplication.focusWidget() is not None, timeout=WAIT_MS)


@pytest.fixture
def shown_window(qtbot, make_window) -> MainWindow:
    """A window shown and active, with three saved chats (newest first: c, b, a)."""
    window = make_window()
    show_active(qtbot, window)
    greedy(window, 2)
    for i, text in enumerate(("chat a", "chat b", "chat c")):
        if i:
            window.new_chat()
        send_and_wait(qtbot, window, text)
    window.composer.focus()
    return window


def test_enter_sends_what_was_typed(qtbot, make_window, engine_results) -> None:
    window = make_window()
    show_active(qtbot, window)
    greedy(window, 2)
    window.composer.focus()
    assert QApplication.focusWidget() is window.composer.editor
    qtbot.keyClicks(window.composer.editor, "Typed here")
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS):
        press(qtbot, window, "Return")
    messages = window.store.messages(window.conversation_id)
    assert [(m.role, m.content) for m in messages] == [
        ("user", "Typed here"), ("assistant", engine_results[-1].text)]
    assert window.composer.text() == ""


def test_esc_stops_the_reply_wherever_the_focus_is(qtbot, shown_window: MainWindow) -> None:
    window = shown_window
    greedy(window, 200)
    with qtbot.waitSignal(window.bridge.sig_token, timeout=WAIT_MS):
        assert window.send("Tell me a long story")
    window.sidebar.list.setFocus()  # not the composer: the window's own Esc
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS) as blocker:
        press(qtbot, window, "Esc")
    assert blocker.args[0].finish_reason == "cancelled"
    assert window.store.messages(window.conversation_id)[-1].status == "stopped"


def test_esc_in_the_search_box_clears_the_search_not_the_reply(
    qtbot, shown_window: MainWindow
) -> None:
    """Leaving a search with Esc (as in any search field) must not kill a reply being
    written; with the box empty, Esc stops it as it does everywhere."""
    window = shown_window
    greedy(window, 200)
    with qtbot.waitSignal(window.bridge.sig_token, timeout=WAIT_MS):
        assert window.send("Tell me a long story")
    chat = window.conversation_id
    press(qtbot, window, "Ctrl+F")
    qtbot.keyClicks(window.sidebar.search, "chat")
    press(qtbot, window, "Esc")
    assert window.sidebar.search.text() == ""
    assert [r.conversation_id for r in window.session.replies.values()] == [chat]
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS) as blocker:
        press(qtbot, window, "Esc")
    assert blocker.args[0].finish_reason == "cancelled"


def test_ctrl_n_opens_an_empty_chat_ready_to_type(qtbot, shown_window: MainWindow) -> None:
    window = shown_window
    window.controls.system_prompt.setFocus()
    press(qtbot, window, "Ctrl+N")
    assert window.conversation_id is None
    assert window.pane.title_label.text() == "New chat"
    assert window.session.visible_messages() == []
    assert "chat c" not in window.chat.toPlainText()
    assert QApplication.focusWidget() is window.composer.editor


@pytest.mark.parametrize(("next_keys", "previous_keys"),
                         [("Ctrl+Tab", "Ctrl+Shift+Tab"), ("Ctrl+PgDown", "Ctrl+PgUp")])
def test_next_and_previous_chat_keys_walk_the_list(qtbot, shown_window: MainWindow,
                                                   next_keys: str, previous_keys: str) -> None:
    window = shown_window
    c, b, a = window.sidebar.visible_ids()
    assert window.conversation_id == c
    seen = []
    for _ in range(3):
        press(qtbot, window, next_keys)
        seen.append(window.conversation_id)
    assert seen == [b, a, c]  # wraps at the end
    press(qtbot, window, previous_keys)
    assert window.conversation_id == a
    assert window.pane.title_label.text() == "chat a"
    assert next(m.content for m in window.store.messages(a)) == "chat a"


def test_f2_renames_the_chat_in_place(qtbot, shown_window: MainWindow) -> None:
    window = shown_window
    chat = window.conversation_id
    press(qtbot, window, "F2")
    editor = QApplication.focusWidget()
    assert editor is not None and editor is not window.composer.editor  # the title's editor
    qtbot.keyClick(editor, Qt.Key.Key_A, Mod.ControlModifier)
    qtbot.keyClicks(editor, "Renamed by keyboard")
    press(qtbot, window, "Return")  # the editor commits on the next turn of the event loop
    qtbot.waitUntil(lambda: window.store.conversation(chat).title == "Renamed by keyboard",
                    timeout=WAIT_MS)
    assert window.pane.title_label.text() == "Renamed by keyboard"


def test_ctrl_f_searches_the_chats(qtbot, shown_window: MainWindow) -> None:
    window = shown_window
    press(qtbot, window, "Ctrl+F")
    assert QApplication.focusWidget() is window.sidebar.search
    qtbot.keyClicks(window.sidebar.search, "chat b")
    titles = [window.store.conversation(i).title for i in window.sidebar.visible_ids()]
    assert titles == ["chat b"]


def test_ctrl_shift_backspace_deletes_the_chat_after_asking(
    qtbot, shown_window: MainWindow, monkeypatch: pytest.MonkeyPatch
) -> None:
    window = shown_window
    chat = window.conversation_id
    asked: list[str] = []

    def answer(_parent: QWidget, _title: str, text: str, *_args: Any) -> Any:
        asked.append(text)
        return QMessageBox.StandardButton.Yes

    monkeypatch.setattr(QMessageBox, "question", answer)
    press(qtbot, window, "Ctrl+Shift+Backspace")
    assert len(asked) == 1 and "chat c" in asked[0]
    assert window.store.conversation(chat) is None
    assert chat not in window.sidebar.visible_ids() and window.conversation_id is None


# ----- a chat that outgrows the context ---------------------------------------------------------
def fill_the_context(qtbot, window: MainWindow) -> None:
    """Two long turns: the next message no longer fits the tiny model's context."""
    greedy(window, 120)  # the tiny model runs to max tokens without an EOS
    send_and_wait(qtbot, window, "First question about Paris")
    send_and_wait(qtbot, window, "Second question about Berlin")


def choose_overflow(qtbot, window: MainWindow, label: str) -> None:
    """Generation → Advanced → Chat too long, picked with the keyboard."""
    controls = window.controls
    if not controls.advanced_toggle.isChecked():
        qtbot.mouseClick(controls.advanced_toggle, Qt.MouseButton.LeftButton)
    combo = controls.overflow
    combo.setFocus()
    while combo.currentText() != label:
        before = combo.currentIndex()
        qtbot.keyClick(combo, Qt.Key.Key_Down)
        assert combo.currentIndex() != before, f"no {label!r} in the list"


def test_a_chat_too_long_is_refused_by_default_in_one_line(
    qtbot, make_window, engine_results
) -> None:
    window = make_window()
    show_and_wait(qtbot, window)
    fill_the_context(qtbot, window)
    saved = len(window.store.messages(window.conversation_id))
    with qtbot.waitSignal(window.sig_reply_failed, timeout=WAIT_MS) as blocker:
        assert window.send("Third question, which no longer fits")
    assert "over the model's context of 256 tokens" in blocker.args[0]
    assert "\n" not in banner(window) and "over the model's context" in banner(window)
    assert banner(window).endswith("(Generation → Advanced → Chat too long)")  # the way out
    assert len(window.store.messages(window.conversation_id)) == saved  # nothing half-saved
    assert window.composer.text() == "Third question, which no longer fits"  # given back
    assert len(engine_results) == 2


def test_drop_the_oldest_turns_fits_the_prompt_and_says_so(
    qtbot, make_window, engine_results, tiny_model_dir: Path
) -> None:
    window = make_window()
    show_and_wait(qtbot, window)
    fill_the_context(qtbot, window)
    choose_overflow(qtbot, window, "Drop the oldest turns")
    greedy(window, 8)
    finished: list[GenerationResult] = []
    refusals: list[str] = []
    window.sig_reply_finished.connect(finished.append)
    window.sig_reply_failed.connect(refusals.append)
    assert window.send("Third question about Rome")
    qtbot.waitUntil(lambda: bool(finished or refusals), timeout=WAIT_MS)
    assert not refusals, refusals
    result = finished[0]

    engine = engine_results[-1]
    assert engine.request_id == result.request_id and engine.finish_reason == "length"
    assert engine.dropped_messages >= 1
    assert engine.metrics.prompt_tokens == len(engine.prompt_token_ids)
    assert engine.metrics.prompt_tokens + 1 <= CONTEXT  # it fits, with room to reply
    prompt = AutoTokenizer.from_pretrained(str(tiny_model_dir)).decode(engine.prompt_token_ids)
    assert "Third question about Rome" in prompt and "First question" not in prompt
    saved = window.store.messages(window.conversation_id)
    assert next(m.content for m in saved if m.role == "user") == "First question about Paris"
    assert saved[-1].metrics["prompt_tokens"] == engine.metrics.prompt_tokens
    note = banner(window)
    assert "\n" not in note and f"Left out the {engine.dropped_messages} oldest messages" in note
    # The choice is a setting like the others: a restart keeps it.
    window.close()
    again = make_window()
    assert again.controls.overflow_mode() == "drop_oldest"
    assert again.controls.overflow.currentText() == "Drop the oldest turns"


def test_the_dropped_turns_note_is_not_shown_when_nothing_was_dropped(
    qtbot, make_window, engine_results
) -> None:
    window = make_window()
    choose_overflow(qtbot, window, "Drop the oldest turns")
    greedy(window, 4)
    send_and_wait(qtbot, window, "Short chat")
    assert engine_results[-1].dropped_messages == 0
    assert banner(window) == ""



def test_on_a_server_the_choice_is_kept_but_not_offered(
    qtbot, remote_window, phasewise_server: Any, tmp_path: Path
) -> None:
    """A server decides itself what a chat too long gets: the setting is disabled there (its
    tooltip says why) and the user's saved choice stays for the local engine."""
    saved = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    saved.setValue("sampling/overflow", "drop_oldest")  # chosen in an earlier session
    saved.sync()
    window = remote_window(phasewise_server.base_url)  # the same settings file
    assert window.controls.overflow.isEnabled() is False
    assert "decides itself" in window.controls.overflow.toolTip()
    assert window.controls.overflow_mode() == "drop_oldest"


def test_a_message_too_long_alone_is_refused_even_when_dropping(qtbot, make_window) -> None:
    """Dropping old turns cannot make one message fit: the refusal does not point to the
    setting the user already chose."""
    window = make_window()
    choose_overflow(qtbot, window, "Drop the oldest turns")
    with qtbot.waitSignal(window.sig_reply_failed, timeout=WAIT_MS):
        assert window.send("word " * 300)
    assert "over the model's context of 256 tokens" in banner(window)
    assert "Chat too long" not in banner(window)
    assert window.conversation_id is None or window.store.messages(window.conversation_id) == []
