"""Issue 31 item 1: two chats streaming at once cost the window no more than one does. What
the GUI thread does for a reply in a chat that is not on screen is counted (never timed),
through the app's own factory (conftest's make_window): its tokens redraw only the HUD's
session-wide panels, never the panels about the reply the HUD shows, and never the chat view;
its text is whole when its chat is opened.

The background reply is held by a Gate on the engine thread after its second token, and the
test then hands the window a burst of that reply's tokens as the engine would (the bridge's
engine-thread listener), so every count is of a known number of tokens.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

from engine import SamplerSnapshot, TokenEmitted
from engine.worker import Engine
from tests.support.window_helpers import (
    LONG,
    WAIT_MS,
    click_chat,
    greedy,
    send_and_wait,
    show_and_wait,
)
from tests.support.window_scenarios import Gate
from ui.hud.model import ReplyRecord

BURST = 120  # tokens of the background reply handed to the window at once


def count_refreshes(hud: Any, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often each HUD panel is redrawn from now on."""
    counts: Counter[str] = Counter()
    # As on a screen tall enough for every panel: none is left dirty for being scrolled out.
    monkeypatch.setattr(hud, "_scrolled_out", lambda _panel: False)
    for key, panel in hud.panels.items():
        def counted(ctx: Any, _refresh: Any = panel.refresh, _key: str = key) -> None:
            counts[_key] += 1
            _refresh(ctx)
        monkeypatch.setattr(panel, "refresh", counted)
    return counts


def count_breakdowns(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The replies whose breakdown (the HUD's headline and advice) is worked out from now on."""
    seen: list[str] = []
    breakdown = ReplyRecord.breakdown

    def counted(reply: ReplyRecord) -> Any:
        seen.append(reply.request_id)
        return breakdown(reply)

    monkeypatch.setattr(ReplyRecord, "breakdown", counted)
    return seen


def burst(window: Any, request_id: str, after: int, t_ns: int) -> None:
    """BURST tokens of one reply (a sampler snapshot every tenth), handed to the window's
    bridge from a thread of their own, as the engine thread does between two drains."""
    def engine_thread() -> None:
        for i in range(after + 1, after + 1 + BURST):
            t = t_ns + i * 1_000_000
            if i % 10 == 0:
                window.bridge._on_engine_event(
                    SamplerSnapshot(request_id, t, i, 0.0, 1.0, ((7, " w", 1.0),), 1, 7))
            window.bridge._on_engine_event(TokenEmitted(request_id, t, i, 7, f" w{i}"))

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()


@pytest.fixture
def background(qtbot, make_window, tiny_engine: Engine) -> Any:
    """A window with chat A on screen (one finished reply) while chat B's reply streams in
    the background, held after its second token; yields (window, A, B's request id)."""
    window = make_window()
    show_and_wait(qtbot, window)
    greedy(window, 6)
    send_and_wait(qtbot, window, "Trip plan")
    chat_a = window.conversation_id
    window.new_chat()
    greedy(window, LONG)
    gate = Gate(tiny_engine, lambda e: isinstance(e, TokenEmitted) and e.index == 1)
    try:
        assert window.send("Tell me a long story about a dragon.")
        held = gate.wait(qtbot, WAIT_MS)
        reply = window.session.replies[held.request_id]
        qtbot.waitUntil(lambda: reply.output_tokens == 2, timeout=WAIT_MS)
        click_chat(qtbot, window, chat_a)  # the user goes back to chat A
        yield window, chat_a, held
    finally:
        gate.release()
    qtbot.waitUntil(lambda: not window.session.replies, timeout=WAIT_MS)  # B ended


def test_a_background_chat_streaming_redraws_only_the_hud_panels_that_show_every_reply(
        qtbot, background: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    window, _chat_a, held = background
    hud, chat = window.hud, window.chat
    reply = window.session.replies[held.request_id]
    shown = hud.selected_reply()
    assert shown is not None and shown.request_id != held.request_id  # A's own reply
    refreshes = count_refreshes(hud, monkeypatch)
    hud.flush()  # panels left dirty while scrolled out are drawn
    refreshes.clear()
    inserts = chat.insert_count
    summaries = count_breakdowns(monkeypatch)

    burst(window, held.request_id, held.index, held.t_ns)
    qtbot.waitUntil(lambda: reply.output_tokens == 2 + BURST, timeout=WAIT_MS)
    hud.flush()
    assert set(refreshes) <= {"throughput"}  # the session's decode rate draws every reply
    assert summaries == []  # the headline (A's numbers) is not worked out again
    assert chat.insert_count == inserts  # chat A's view is not touched by B's tokens
    assert window.sidebar.streaming_ids() == [window.session.replies[held.request_id]
                                              .conversation_id]  # B's dot
    assert hud.model.record(held.request_id).token_ns[-1] == held.t_ns + (1 + BURST) * 1_000_000

    # The HUD follows the reply the user picks: then B's tokens redraw its panels.
    hud.select_reply(held.request_id, pin=True)
    hud.flush()
    refreshes.clear()
    burst(window, held.request_id, held.index + BURST, held.t_ns + BURST * 1_000_000)
    qtbot.waitUntil(lambda: reply.output_tokens == 2 + 2 * BURST, timeout=WAIT_MS)
    hud.flush()
    assert {"itl", "breakdown", "throughput"} <= set(refreshes)


def test_a_background_chat_shows_its_whole_text_when_opened(qtbot, background: Any) -> None:
    window, _chat_a, held = background
    reply = window.session.replies[held.request_id]
    burst(window, held.request_id, held.index, held.t_ns)
    qtbot.waitUntil(lambda: reply.output_tokens == 2 + BURST, timeout=WAIT_MS)
    assert window.chat.stream_text(held.request_id) == ""  # not rendered while hidden

    click_chat(qtbot, window, reply.conversation_id)
    assert window.chat.stream_text(held.request_id) == reply.text
    assert reply.text.endswith(f" w{1 + BURST}")
    window.chat.flush()
    assert reply.text in window.chat.toPlainText()


def test_a_burst_of_tokens_reaches_the_hud_and_the_chat_in_one_call_each(
        qtbot, background: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bridge hands a drain's tokens over as one run (the HUD folds them and marks its
    panels once), not one signal and one HUD mark per token of every stream."""
    window, _chat_a, held = background
    reply = window.session.replies[held.request_id]
    runs: list[int] = []
    window.bridge.sig_stream.connect(lambda events: runs.append(len(events)))
    marks: list[object] = []
    mark = window.hud._mark_dirty
    monkeypatch.setattr(window.hud, "_mark_dirty", lambda keys: (marks.append(keys),
                                                                 mark(keys)))
    burst(window, held.request_id, held.index, held.t_ns)
    qtbot.waitUntil(lambda: reply.output_tokens == 2 + BURST, timeout=WAIT_MS)
    assert runs == [BURST + BURST // 10]  # one drain: every token and snapshot in one run
    assert len(marks) == 1
    assert len(window.hud.model.record(held.request_id).token_ns) == 2 + BURST
