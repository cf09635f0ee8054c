"""The chat window end to end with the tiny engine: streaming, stop, actions, persistence."""

from __future__ import annotations

import threading

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox

from engine import GenerationRequest, PrefillStarted, SamplingParams, TokenEmitted
from engine.worker import Engine
from tests.support.window_helpers import LONG, WAIT_MS, greedy, send_and_wait
from ui.store import STOPPED, ChatStore


@pytest.fixture
def submitted(monkeypatch, tiny_engine: Engine) -> list[GenerationRequest]:
    """Every request the window submits, in order."""
    requests: list[GenerationRequest] = []
    original = tiny_engine.submit

    def spy(request: GenerationRequest):
        requests.append(request)
        return original(request)

    monkeypatch.setattr(tiny_engine, "submit", spy)
    return requests


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def test_reply_streams_into_view_and_is_saved(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, 40)
    painted: list[int] = []
    window.chat.sig_tokens_painted.connect(lambda _rid, idx, _ns: painted.extend(idx))

    result = send_and_wait(qtbot, window, "Hello")

    assert result.metrics.output_tokens == 40
    assert painted == list(range(40))  # every token reached the screen, in order
    assert 1 <= window.chat.insert_count <= 40
    messages = window.store.messages(window.conversation_id)
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[1].content == result.text
    assert messages[1].status == "length"
    assert messages[1].settings["temperature"] == 0
    assert messages[1].metrics["output_tokens"] == 40
    assert "context" in window.status.context_label.text()
    assert not window.composer.text()


def test_esc_stops_within_one_step_and_keeps_partial(qtbot, make_window, tiny_engine) -> None:
    window = make_window()
    greedy(window, LONG)
    emitted = 0
    at_cancel: list[int] = []

    def count(event) -> None:  # engine thread
        nonlocal emitted
        if isinstance(event, TokenEmitted):
            emitted += 1

    tiny_engine.add_listener(count)
    original_cancel = tiny_engine.cancel

    def cancel(request_id: str) -> None:
        at_cancel.append(emitted)
        original_cancel(request_id)

    tiny_engine.cancel = cancel
    with qtbot.waitSignal(window.bridge.sig_token, timeout=WAIT_MS):
        window.send("Tell me a story")
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS) as blocker:
        qtbot.keyClick(window.composer.editor, Qt.Key.Key_Escape)

    result = blocker.args[0]
    assert result.finish_reason == "cancelled"
    assert result.metrics.output_tokens <= at_cancel[0] + 1  # at most the step in flight
    reply = window.store.messages(window.conversation_id)[-1]
    assert reply.status == STOPPED
    assert reply.content == result.text
    assert window.composer.button.text() == "Send"


def test_controls_map_to_next_request(qtbot, make_window, submitted) -> None:
    window = make_window()
    controls = window.controls
    changes: list[tuple[str, object]] = []
    controls.sig_setting_changed.connect(lambda name, value: changes.append((name, value)))
    controls.temperature.setValue(0)
    controls.top_p.setValue(50)
    controls.max_tokens.setValue(7)
    controls.top_k.setValue(5)
    controls.min_p.setValue(0.1)
    controls.seed.setText("42")
    controls.seed.editingFinished.emit()

    assert controls._labels["temperature"].text() == "greedy"
    assert controls._labels["top_p"].text() == "0.50"
    assert controls.max_tokens_box.value() == 7
    assert ("temperature", 0.0) in changes and ("seed", 42) in changes
    assert controls.max_tokens.maximum() == window.model_info.context_length

    send_and_wait(qtbot, window, "Hi")
    assert submitted[-1].params == SamplingParams(
        temperature=0.0, top_p=0.5, top_k=5, min_p=0.1, max_tokens=7, seed=42
    )


def test_regenerate_and_edit_reuse_the_conversation_cache(qtbot, make_window, submitted) -> None:
    window = make_window()
    greedy(window, 8)
    prefills: list[PrefillStarted] = []
    window.bridge.sig_prefill_started.connect(prefills.append)
    first = send_and_wait(qtbot, window, "Hello")
    conv = window.conversation_id
    reply_id = window.store.messages(conv)[-1].id

    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS) as blocker:
        window.regenerate(reply_id)
    again = blocker.args[0]
    assert again.text == first.text  # greedy: same history, same reply
    assert again.prompt_token_ids == first.prompt_token_ids
    # the whole prompt was cached: all of it is reused but the last token, which is run
    # again for fresh logits
    whole = len(first.prompt_token_ids) - 1
    assert prefills[-1].cached_tokens == again.metrics.cached_tokens == whole

    user_id = window.store.messages(conv)[0].id
    window.edit(user_id)
    assert window.composer.text() == "Hello" and window.composer.editing
    edited = send_and_wait(qtbot, window, "Hello again")
    # the cache holds the first prompt (and its reply): the edited prompt reuses exactly the
    # tokens it shares with it, up to where "Hello" became "Hello again"
    shared = common_prefix(first.prompt_token_ids, edited.prompt_token_ids)
    assert 0 < shared < len(first.prompt_token_ids)
    assert prefills[-1].cached_tokens == edited.metrics.cached_tokens == shared
    assert {r.conversation_id for r in submitted} == {conv}
    messages = window.store.messages(conv)
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[0].content == "Hello again"


def test_restart_restores_chats_and_sliders(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, 5)
    window.controls.top_p.setValue(80)
    result = send_and_wait(qtbot, window, "Remember me")
    conv = window.conversation_id
    window.close()

    again = make_window()
    assert again.conversation_id == conv
    assert again.sidebar.visible_ids() == [conv]
    assert again.controls.temperature.value() == 0
    assert again.controls.top_p.value() == 80
    assert again.controls.max_tokens.value() == 5
    assert again.store.messages(conv)[-1].content == result.text


def test_closing_mid_reply_keeps_the_partial_reply(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, LONG)
    window.send("Tell me a story")
    qtbot.waitUntil(lambda: bool(window.reply and window.reply.text), timeout=WAIT_MS)
    conv, partial = window.conversation_id, window.reply.text
    window.close()

    assert window.reply is None
    reply = ChatStore(window.store.path).messages(conv)[-1]
    assert reply.status == STOPPED
    assert reply.content.startswith(partial)


def test_failed_model_load_keeps_the_old_model(qtbot, make_window, tiny_engine, tmp_path) -> None:
    window = make_window()
    before = tiny_engine.model_info
    with qtbot.waitSignal(window.bridge.sig_model_load_failed, timeout=WAIT_MS):
        window.load_model(str(tmp_path / "no-such-model"))

    assert window.notice.isVisibleTo(window)
    assert "Model not loaded" in window.notice_label.text()
    assert before.name in window.notice_label.text()
    assert window.model_info == before and tiny_engine.model_info == before
    assert not window.status.progress.isVisibleTo(window)
    greedy(window, 3)
    send_and_wait(qtbot, window, "still works")


def test_bad_input_gives_one_line_and_loses_nothing(qtbot, make_window) -> None:
    window = make_window()
    assert not window.send("   \n ")
    assert window.notice_label.text() == "Type a message first."
    assert window.store.conversations() == []

    huge = "word " * 20_000  # 100k characters: far beyond the tiny model's context
    window.composer.set_text(huge)
    with qtbot.waitSignal(window.sig_reply_failed, timeout=WAIT_MS) as blocker:
        window.send(huge)
    message = blocker.args[0]
    assert "\n" not in message and message == window.notice_label.text()
    assert window.composer.text() == huge  # handed back, nothing lost
    assert window.store.messages(window.conversation_id) == []
    assert window.reply is None


def test_sidebar_search_rename_delete(qtbot, make_window, tiny_engine) -> None:
    window = make_window()
    store = window.store
    paris = store.create_conversation("Geography")
    store.add_message(paris, "user", "What is the capital of France? Paris!")
    code = store.create_conversation("Python help")
    store.add_message(code, "user", "reverse a string")
    window.sidebar.refresh()
    assert set(window.sidebar.visible_ids()) == {paris, code}

    window.sidebar.search.setText("PARIS")  # message text, case-insensitive
    assert window.sidebar.visible_ids() == [paris]
    window.sidebar.search.setText("python")  # title
    assert window.sidebar.visible_ids() == [code]
    window.sidebar.search.setText("100%")  # LIKE wildcards are literal
    assert window.sidebar.visible_ids() == []
    window.sidebar.search.clear()

    window.sidebar.rename(code, "Strings in Python")
    assert store.conversation(code).title == "Strings in Python"
    window.sidebar.list.setCurrentRow(window.sidebar.visible_ids().index(paris))
    assert window.conversation_id == paris
    with pytest.MonkeyPatch.context() as answer:  # the user confirms
        answer.setattr(QMessageBox, "question", lambda *_a: QMessageBox.StandardButton.Yes)
        window.delete_conversation(paris)
    assert store.conversation(paris) is None
    assert window.conversation_id is None
    assert window.sidebar.visible_ids() == [code]


def test_ctrl_n_starts_a_new_chat(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, 3)
    send_and_wait(qtbot, window, "first")
    assert window.conversation_id is not None
    window.menus.new_action.trigger()
    assert window.conversation_id is None
    assert window.menus.new_action.shortcut().toString() == "Ctrl+N"


def test_corrupt_database_is_backed_up_and_reported(qtbot, make_window, tmp_path) -> None:
    (tmp_path / "chats.sqlite3").write_bytes(b"this is not a database" * 100)
    window = make_window()
    assert window.store.recovered_from is not None
    assert window.store.recovered_from.read_bytes().startswith(b"this is not")
    assert "backed up" in window.notice_label.text()
    assert window.store.conversations() == []


def test_shift_enter_adds_a_line_and_enter_sends(qtbot, make_window) -> None:
    window = make_window()
    sent: list[str] = []
    window.composer.sig_send.disconnect()
    window.composer.sig_send.connect(sent.append)
    qtbot.keyClicks(window.composer.editor, "a")
    qtbot.keyClick(window.composer.editor, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(window.composer.editor, "b")
    qtbot.keyClick(window.composer.editor, Qt.Key.Key_Return)
    assert sent == ["a\nb"]


def test_engine_events_reach_the_gui_thread(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, 3)
    threads: list[threading.Thread] = []
    window.bridge.sig_token.connect(lambda _e: threads.append(threading.current_thread()))
    send_and_wait(qtbot, window, "x")
    assert threads and all(t is threading.main_thread() for t in threads)


def test_model_picker_requires_download_consent(qtbot) -> None:
    from ui.model_picker import ModelChoice, ModelPickerDialog

    dialog = ModelPickerDialog()
    qtbot.addWidget(dialog)
    assert dialog.choice() == ModelChoice("default", {"engine": "auto"})
    dialog.hub_id.setText("org/model")
    dialog.radios["hub"].setChecked(True)
    with pytest.raises(ValueError, match="Allow downloading"):
        dialog.choice()
    dialog.consent.setChecked(True)
    assert dialog.choice() == ModelChoice("org/model", {"engine": "auto", "allow_download": True})
    dialog.radios["gguf"].setChecked(True)
    with pytest.raises(ValueError, match="path"):
        dialog.choice()


def test_about_box_shows_version_and_model(make_window, qtbot) -> None:
    from PySide6.QtCore import QCoreApplication

    from app import __version__
    from ui.about import about_text

    QCoreApplication.setApplicationVersion(__version__)
    window = make_window()
    qtbot.waitUntil(lambda: window.model_info is not None)
    text = about_text(window.model_info)
    assert f"Phasewise {__version__}" in text
    assert window.model_info.name in text
    help_menu = [a.text() for a in window.menuBar().actions()]
    assert "&Help" in help_menu
