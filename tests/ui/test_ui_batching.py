"""The window with several replies at once: N alternatives in one chat (keep one), and two
chats streaming side by side. The engine batches them."""

from __future__ import annotations

import threading

import pytest

from engine import TokenEmitted
from engine.worker import Engine
from tests.support.window_helpers import WAIT_MS, settings
from ui.store import DONE

LONG = 200  # the tiny model (context 256) runs to max tokens without an EOS


def test_alternatives_stream_at_once_and_one_is_kept(qtbot, make_window,
                                                      tiny_engine: Engine) -> None:
    window = make_window()
    # Sampled at 0.01: alternatives need a temperature above 0, and near-greedy text from the
    # tiny random model re-tokenizes to the same ids, so the adopted cache matches exactly.
    settings(window, temperature=1, max_tokens=12)
    window.composer.alternatives.setValue(3)
    live_streams: list[int] = []
    window.chat.sig_tokens_painted.connect(
        lambda *_: live_streams.append(len(window.chat._streams)))

    with qtbot.waitSignal(window.sig_alternatives_ready, timeout=WAIT_MS):
        assert window.send("Hello")

    conv = window.conversation_id
    alts = window.session.alternative_sets[conv]
    assert len(alts.results) == 3 and window.session.replies == {}
    assert max(live_streams) == 3  # all three were on screen, streaming, at once
    prefilled = sorted(r.metrics.prefilled_tokens for r in alts.results.values())
    assert prefilled[:2] == [0, 0] and prefilled[2] > 0  # one shared prefill
    html = window.chat.toHtml()
    assert all(f"Alternative {i}" in html for i in (1, 2, 3))
    assert [m.role for m in window.store.messages(conv)] == ["user"]  # nothing saved yet
    assert not window.send("Next")  # a pick comes first
    assert "Keep one" in window.notice_label.text()

    kept = alts.results[1]
    window.chat.sig_action.emit("keep", 1)  # the "Keep this one" link of alternative 2

    messages = window.store.messages(conv)
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[1].content == kept.text and messages[1].status == "length"
    assert messages[1].metrics["output_tokens"] == 12
    assert conv not in window.session.alternative_sets
    assert "Alternative 1" not in window.chat.toHtml()
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS) as finished:
        window.composer.alternatives.setValue(1)
        assert window.send("Next")
    metrics = finished.args[0].metrics
    assert metrics.cached_tokens > 0  # the next turn builds on it,
    assert metrics.cache_miss_reason == "none"  # as the chat's own cache (it was adopted)
    assert not [key for key in tiny_engine.prefix_cache.conversations() if "~alt" in key]
    assert [m.role for m in window.store.messages(conv)] == ["user", "assistant"] * 2


# The link's menu is a popup: on the offscreen platform there is nothing to raise or grab.
@pytest.mark.qt_log_ignore("This plugin does not support (raise|grabbing the keyboard)")
def test_alternatives_link_regenerates_the_last_reply_as_a_set(qtbot, make_window) -> None:
    window = make_window()
    settings(window, temperature=1, max_tokens=6)  # 0.01, as above
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS):
        assert window.send("Hello")
    conv = window.conversation_id
    reply = window.store.messages(conv)[-1]
    menu = window.ask_alternatives(reply.id)  # what the link under the reply opens
    assert menu is not None
    with qtbot.waitSignal(window.sig_alternatives_ready, timeout=WAIT_MS):
        menu.defaultAction().trigger()  # its default: three, with × N at 1
    assert len(window.session.alternative_sets[conv].results) == 3
    assert [m.role for m in window.store.messages(conv)] == ["user"]  # the old reply went
    kept = window.session.alternative_sets[conv].results[0]
    assert window.keep_alternative(0)
    assert not window.keep_alternative(0)  # the set is gone
    saved = window.store.messages(conv)[-1]
    assert (saved.role, saved.content, saved.status) == ("assistant", kept.text, "length")


def test_two_chats_stream_at_once_and_both_are_saved(qtbot, make_window,
                                                      tiny_engine: Engine) -> None:
    window = make_window()
    settings(window, temperature=0, max_tokens=LONG)
    order: list[str] = []
    b_sent = threading.Event()

    def watch(event: object) -> None:  # on the engine thread
        if isinstance(event, TokenEmitted):
            order.append(event.request_id)
            if event.index == 1:
                # A's second token waits until B is queued: B joins while A has LONG - 2
                # tokens to go, whatever the machine's speed (B needs 30)
                b_sent.wait(WAIT_MS / 1000)

    tiny_engine.add_listener(watch)
    first_ids: list[str] = []
    window.sig_reply_started.connect(first_ids.append)
    finished: dict[str, object] = {}
    window.sig_reply_finished.connect(lambda r: finished.setdefault(r.request_id, r))
    assert window.send("Hello from chat A")
    chat_a = window.conversation_id
    qtbot.waitUntil(lambda: bool(window.reply and window.reply.text), timeout=WAIT_MS)

    window.new_chat()
    assert window.composer.button.text() == "Send"  # chat B is idle while A writes
    settings(window, temperature=0, max_tokens=30)
    assert window.send("And hello from chat B")
    b_sent.set()
    chat_b = window.conversation_id
    assert chat_a != chat_b
    a_id, b_id = first_ids
    qtbot.waitUntil(lambda: b_id in finished, timeout=WAIT_MS)
    assert a_id in window.session.replies, "A is still streaming after B finished"
    # B's tokens came between A's: both decoded in the same steps
    b_tokens = [i for i, rid in enumerate(order) if rid == b_id]
    assert any(rid == a_id for rid in order[b_tokens[0]: b_tokens[-1]])

    window.open_conversation(chat_a)  # A's live text is back on screen
    assert window.composer.button.text() == "Stop"
    assert window.chat.stream_text(a_id) or a_id in finished
    qtbot.waitUntil(lambda: a_id in finished, timeout=WAIT_MS)
    for conv, result in ((chat_a, finished[a_id]), (chat_b, finished[b_id])):
        messages = window.store.messages(conv)
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[1].content == result.text and messages[1].status in (DONE, "length")
        assert messages[1].metrics["output_tokens"] == result.metrics.output_tokens


def test_view_streams_several_replies_into_their_own_blocks(qtbot) -> None:
    from ui.chat_view import ChatView

    view = ChatView()
    qtbot.addWidget(view)
    for rid in "abc":
        view.begin_stream(rid, f"Alternative {rid}")
        view.push_token(rid, 0, rid.upper() + "0")
    for i in range(1, 4):
        for rid in "cab":
            view.push_token(rid, i, f" {rid.upper()}{i}")
        view.flush()
    view.end_stream("b")
    view.push_token("a", 4, " A4")
    view.end_stream()

    text = view.toPlainText()
    assert [line for line in text.splitlines() if not line.startswith("Alternative")] == [
        "A0 A1 A2 A3 A4", "B0 B1 B2 B3", "C0 C1 C2 C3"]
    assert text.index("Alternative a") < text.index("Alternative b") < text.index(
        "Alternative c")
