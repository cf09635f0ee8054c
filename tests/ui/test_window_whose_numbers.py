"""Issue 31 item 3 (the rest): the HUD says whose numbers it shows (the chat, the turn, live or
saved) in its header, and a click on a reply's stats line shows that reply in the HUD with the
picker on it. Through the app's own factory (conftest's make_window), with real clicks where
the user clicks; issue 27 item 6's one-way flow (the chat session's reply feeds the chat view
and the HUD alike) is checked where the two show the same thing.
"""

from __future__ import annotations

from typing import Any

import pytest
from PySide6.QtWidgets import QToolTip

from engine import PrefillProgress
from tests.support.window_helpers import (
    click_chat,
    click_stats_line,
    greedy,
    send_and_wait,
    show_and_wait,
)
from ui.hud.widget import LIVE_ITEM


def header(window: Any) -> str:
    """The HUD's header line as its next redraw shows it."""
    window.hud.flush()
    return window.hud.subject_label.text()


@pytest.fixture
def tips(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The stats line's breakdown tooltip (a popup the offscreen platform cannot raise)."""
    shown: list[str] = []
    monkeypatch.setattr(QToolTip, "showText", lambda _pos, text, *_a: shown.append(text))
    return shown


def test_the_hud_header_names_the_chat_the_turn_and_live_or_saved(qtbot, make_window) -> None:
    window = make_window()
    show_and_wait(qtbot, window)
    assert header(window) == "No reply yet"
    greedy(window, 6)
    send_and_wait(qtbot, window, "Trip plan")  # the chat is titled by its first line
    trip = window.conversation_id
    live: list[str] = []

    def at_first_token(event: Any) -> None:  # after the window's own slots
        if event.index == 0:
            live.append(header(window))

    window.bridge.sig_token.connect(at_first_token)
    send_and_wait(qtbot, window, "And the hotels?")
    window.bridge.sig_token.disconnect(at_first_token)
    assert live == ["Chat “Trip plan” · turn 2 · live"]
    assert header(window) == "Chat “Trip plan” · turn 2 · finished"
    assert window.hud.reply_combo.currentText() == LIVE_ITEM  # it follows the newest

    window.new_chat()  # nothing of its own yet: the newest reply, named as the other chat's
    assert header(window) == "Chat “Trip plan” · turn 2 · finished"
    send_and_wait(qtbot, window, "Other plans")
    assert header(window) == "Chat “Other plans” · turn 1 · finished"
    click_chat(qtbot, window, trip)  # the HUD switches with the chat
    assert header(window) == "Chat “Trip plan” · turn 2 · finished"
    window.close()

    restarted = make_window()  # the same chats, read back: their numbers are the saved ones
    show_and_wait(qtbot, restarted)
    click_chat(qtbot, restarted, trip)
    assert header(restarted) == "Chat “Trip plan” · turn 2 · saved"


def test_a_click_on_a_stats_line_shows_that_reply_and_moves_the_picker(
        qtbot, make_window, tips: list[str]) -> None:
    window = make_window()
    show_and_wait(qtbot, window)
    greedy(window, 6)
    first = send_and_wait(qtbot, window, "Trip plan")
    send_and_wait(qtbot, window, "And the hotels?")
    trip = window.conversation_id
    turn_1 = next(m for m in window.store.messages(trip) if m.role == "assistant")
    hud = window.hud

    click_stats_line(qtbot, window, turn_1.id)
    assert tips and tips[-1].startswith("TTFT ")  # the full breakdown at the pointer
    assert hud.selected_reply().request_id == first.request_id  # its record from this run
    assert hud.reply_combo.currentText() == "Trip plan · turn 1"
    assert header(window) == "Chat “Trip plan” · turn 1 · finished"
    assert not hud.pinned  # a look, not a pin: the next reply takes over

    send_and_wait(qtbot, window, "Thanks")
    assert hud.reply_combo.currentText() == LIVE_ITEM
    assert header(window) == "Chat “Trip plan” · turn 3 · finished"
    window.close()

    restarted = make_window()  # the chat reopens with its saved replies
    show_and_wait(qtbot, restarted)
    assert restarted.conversation_id == trip
    click_stats_line(qtbot, restarted, turn_1.id)
    assert restarted.hud.reply_combo.currentText() == "Trip plan · turn 1 (saved)"
    assert header(restarted) == "Chat “Trip plan” · turn 1 · saved"


def test_the_chat_and_the_hud_show_one_time_left_while_the_prompt_is_read(
        qtbot, make_window, monkeypatch: pytest.MonkeyPatch) -> None:
    """The session says a prompt's time left once; the reply's placeholder and the HUD's live
    breakdown both show that one (issue 27 item 6)."""
    from engine.runtimes.torch.generate import PREFILL_CHUNK_ENV

    monkeypatch.setenv(PREFILL_CHUNK_ENV, "8")  # several chunks even for a short prompt
    window = make_window()
    greedy(window, 4)
    seen: list[tuple[str, str, str]] = []

    def on_progress(event: PrefillProgress) -> None:  # after the window's own slots
        reply = window.session.replies.get(event.request_id)
        if reply is None or reply.reading is None:
            return
        window.hud.flush()
        seen.append((reply.reading.left, window.chat.status_text(event.request_id),
                     window.hud.panels["breakdown"].caption.text()))

    window.bridge.sig_prefill_progress.connect(on_progress)
    send_and_wait(qtbot, window, "The capital of France is Paris. Hello, how are you today? "
                                 "Tell me about the weather in Lyon in spring.")
    assert len(seen) >= 3
    for left, status, caption in seen:
        assert caption.endswith(f", {left}") if left else "left" not in caption
        assert f" · {left} · " in status if left else "left" not in status
    assert seen[-1][1] == "· Reading your prompt: 100%"


def test_what_the_chat_view_paints_reaches_the_huds_render_lag(qtbot, make_window) -> None:
    """The chat view's paint stamps go to the HUD as painted (no relay that drops any)."""
    window = make_window()
    greedy(window, 12)
    painted: dict[int, int] = {}
    window.chat.sig_tokens_painted.connect(
        lambda _rid, indexes, ns: painted.update(dict.fromkeys(indexes, ns)))
    result = send_and_wait(qtbot, window, "Trip plan")

    record = window.hud.model.record(result.request_id)
    assert painted and record.painted_ns == painted
    assert len(record.lags_s) == len(painted)
