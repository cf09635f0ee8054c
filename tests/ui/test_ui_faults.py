"""Window faults: storage failures, out of memory, and changes while a reply streams."""

from __future__ import annotations

import threading
from pathlib import Path

from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QMessageBox

from app.gui import build_backend, build_window
from engine import TokenEmitted
from engine.worker import Engine
from tests.support.fault_injection import ForwardFault
from tests.support.window_helpers import LONG, WAIT_MS, greedy, send_and_wait
from ui.main_window import MainWindow
from ui.store import STOPPED, ChatStore


def page_count(store: ChatStore) -> int:
    return int(store._db.execute("PRAGMA page_count").fetchone()[0])


def start_long_reply(qtbot, window: MainWindow, text: str = "Tell me a story") -> None:
    greedy(window, LONG)
    with qtbot.waitSignal(window.bridge.sig_token, timeout=WAIT_MS):
        assert window.send(text)


def test_read_only_database_mid_reply_keeps_the_app_usable(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, 4)
    first = send_and_wait(qtbot, window, "Hello")
    conv = window.conversation_id
    start_long_reply(qtbot, window)
    window.store._db.execute("PRAGMA query_only=ON")  # every write now fails: read-only
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS) as blocker:
        window.stop()

    assert "Not saved" in window.notice_label.text() and "readonly" in window.notice_label.text()
    assert window.chat.toPlainText().endswith(blocker.args[0].text)  # still on screen
    assert window.store.messages(conv)[1].content == first.text  # saved before: intact
    window.store._db.execute("PRAGMA query_only=OFF")
    greedy(window, 3)
    send_and_wait(qtbot, window, "Still here?")
    assert window.store.messages(conv)[-2].content == "Still here?"


def test_disk_full_on_send_keeps_the_message_in_the_composer(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, 3)
    send_and_wait(qtbot, window, "Hello")
    conv = window.conversation_id
    before = window.store.messages(conv)
    window.store._db.execute(f"PRAGMA max_page_count={page_count(window.store)}")
    big = "a long message that needs new pages " * 300
    window.composer.set_text(big)

    assert not window.send(big)
    assert "database or disk is full" in window.notice_label.text()
    assert window.composer.text() == big and window.reply is None
    assert window.store.messages(conv) == before
    window.store._db.execute("PRAGMA max_page_count=1073741823")
    send_and_wait(qtbot, window, "short")


def test_out_of_memory_mid_reply_says_so_and_next_turn_works(
    qtbot, make_window, tiny_engine: Engine
) -> None:
    window = make_window()
    greedy(window, 5)
    send_and_wait(qtbot, window, "Hello")
    fault = ForwardFault(tiny_engine)
    fault.arm(RuntimeError("CUDA out of memory. Tried to allocate 1 GiB"), at=3)
    with qtbot.waitSignal(window.sig_reply_failed, timeout=WAIT_MS) as blocker:
        window.send("And then?")
    fault.remove()

    assert blocker.args[0].startswith("out of memory") and "\n" not in blocker.args[0]
    assert window.notice_label.text() == blocker.args[0]
    assert window.composer.text() == "And then?"  # handed back
    assert [m.role for m in window.store.messages(window.conversation_id)] == [
        "user", "assistant"]
    send_and_wait(qtbot, window, "And then?")


def test_deleting_the_streaming_chat_stops_it_cleanly(qtbot, make_window, tiny_engine,
                                                      monkeypatch) -> None:
    monkeypatch.setattr(QMessageBox, "question", lambda *_a: QMessageBox.StandardButton.Yes)
    window = make_window()
    start_long_reply(qtbot, window)
    conv = window.conversation_id
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS) as blocker:
        window.delete_conversation(conv)

    assert blocker.args[0].finish_reason == "cancelled"
    assert window.store.conversation(conv) is None and window.store.messages(conv) == []
    qtbot.waitUntil(lambda: conv not in tiny_engine.prefix_cache.conversations(), timeout=WAIT_MS)
    greedy(window, 3)
    send_and_wait(qtbot, window, "Fresh start")
    assert window.conversation_id != conv


def test_edits_and_switches_while_streaming(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, 3)
    send_and_wait(qtbot, window, "Other chat")
    other = window.conversation_id
    window.new_chat()
    start_long_reply(qtbot, window, "Main chat")
    main = window.conversation_id
    user_id = window.store.messages(main)[0].id

    window.edit(user_id)
    assert not window.composer.editing and "still being written" in window.notice_label.text()
    window.open_conversation(other)  # browsing elsewhere does not disturb the reply
    assert "Other chat" in window.chat.toPlainText()
    window.open_conversation(main)
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS) as blocker:
        window.stop()
    reply = window.store.messages(main)[-1]
    assert (reply.status, reply.content) == (STOPPED, blocker.args[0].text)
    assert window.store.messages(other)[0].content == "Other chat"


def test_switching_models_mid_reply_finishes_then_switches(
    qtbot, make_window, tiny_engine: Engine, tiny_model_dir: Path
) -> None:
    window = make_window()
    greedy(window, 120)  # long, and the next turn still fits the tiny model's context
    asked = threading.Event()

    def hold(event: object) -> None:  # on the engine thread: the reply cannot get past its
        if isinstance(event, TokenEmitted) and event.index == 1:  # second token before the
            asked.wait(WAIT_MS / 1000)  # switch is asked for, however fast the machine

    tiny_engine.add_listener(hold)
    order: list[str] = []
    window.sig_reply_finished.connect(lambda result: order.append(result.finish_reason))
    window.bridge.sig_model_loading.connect(lambda *_: order.append("loading"))
    window.bridge.sig_model_loaded.connect(lambda *_: order.append("loaded"))
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS) as finished:
        assert window.send("Tell me a story")
        window.load_model(str(tiny_model_dir))
        asked.set()
    qtbot.waitUntil(lambda: "loaded" in order, timeout=WAIT_MS)
    # The reply ran to its end, undisturbed, and only then did the new model load.
    result = finished.args[0]
    assert (result.finish_reason, result.metrics.output_tokens) == ("length", 120)
    assert order[0] == "length" and order[-1] == "loaded" and order.count("length") == 1
    assert window.reply is None
    saved = window.store.messages(window.conversation_id)[-1]
    assert (saved.status, saved.content) == ("length", result.text)
    greedy(window, 3)
    prefills = []
    window.bridge.sig_prefill_started.connect(prefills.append)
    send_and_wait(qtbot, window, "After the switch")
    assert prefills[-1].cache_miss_reason == "model_changed"


def test_hundred_send_stop_cycles_in_the_window(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, LONG)
    for i in range(100):
        if i % 10 == 0:
            window.new_chat()  # keep each transcript short; the cycle is what is tested
        with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS):
            assert window.send(f"Hi {i}")
            assert not window.send("again")  # refused while busy
            window.stop()
    assert window.reply is None and window.composer.button.text() == "Send"
    statuses = {m.status for c in window.store.conversations() for m in window.store.messages(c.id)
                if m.role == "assistant"}
    assert statuses <= {STOPPED, "length"}
    assert len(window.store.conversations()) == 10


def test_missing_chat_template_is_announced(qtbot, tiny_model_no_template_dir, tmp_path) -> None:
    with Engine(cache_budget_bytes=8 << 20) as engine:
        engine.load_model_sync(str(tiny_model_no_template_dir))
        store = ChatStore(tmp_path / "c.sqlite3")
        settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
        window = build_window(build_backend(engine), store, settings, hud_calibrate=False)
        qtbot.addWidget(window)
        assert "no chat template" in window.notice_label.text()
        assert window.notice.isVisibleTo(window)
        window.close()
        store.close()


def test_ctrl_q_during_a_reply_says_it_is_kept_as_stopped(qtbot, make_window,
                                                          monkeypatch) -> None:
    """Issue 31 item 10: Ctrl+Q quit mid-reply without a word. It now asks, saying the reply
    is kept as stopped; No keeps the window and the reply running, Yes quits and keeps it."""
    from tests.support.window_helpers import show_and_wait

    window = make_window()
    show_and_wait(qtbot, window)
    asked: list[tuple[str, QMessageBox.StandardButton]] = []
    answer = [QMessageBox.StandardButton.No]

    def question(_parent, _title, text, _buttons, default) -> QMessageBox.StandardButton:
        asked.append((text, default))
        return answer[0]

    monkeypatch.setattr(QMessageBox, "question", question)
    start_long_reply(qtbot, window)
    conv = window.conversation_id
    window.menus.quit_action.trigger()
    assert len(asked) == 1 and "kept in the chat, marked stopped" in asked[0][0]
    assert asked[0][1] == QMessageBox.StandardButton.Yes  # Ctrl+Q, Enter quits
    assert window.isVisible() and window.session.replies  # No: still writing
    answer[0] = QMessageBox.StandardButton.Yes
    window.menus.quit_action.trigger()
    assert not window.isVisible() and len(asked) == 2
    assert window.store.messages(conv)[-1].status == STOPPED

    again = make_window()  # nothing running: Ctrl+Q quits without a question
    show_and_wait(qtbot, again)
    again.menus.quit_action.trigger()
    assert len(asked) == 2 and not again.isVisible()
