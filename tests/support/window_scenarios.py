"""What a user does in the chat window, written once for either engine.

Each scenario drives a window built by the app's own factory (app.gui.build_window on
app.gui.build_backend) and returns what it saw as plain data (a dict of numbers, texts and
flags), so that the same scenario runs in this process on the torch engine and in a spawned
child on llama.cpp (tests/ui/test_window_engines.py), where native code may crash without taking
the test run down. The tests assert on the dicts.

Where a scenario needs the reply at a known point (Stop after the second token, Stop while
the prompt is being read, another chat opened while one streams), a Gate holds the engine
thread at that event until the window has acted: the click lands where the test says, not
wherever the race put it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import Qt
from pytestqt.qtbot import QtBot

from engine import GenerationResult, PrefillProgress, PrefillStarted, RequestFinished, TokenEmitted
from engine.events import EngineEvent
from engine.worker import Engine
from tests.support.window_helpers import WAIT_MS, greedy, settings
from ui.hud.model import fmt_seconds
from ui.main_window import MainWindow

GATE_S = 60.0  # the engine thread waits at most this long for the window (no hang, ever)


@dataclass
class Rig:
    """A window on a local engine, and what the scenarios need to know of that engine."""

    window: MainWindow
    engine: Engine  # the router's local engine: its listeners run on the engine thread
    long_prompt: str  # several prefill chunks long, yet leaving room for a short reply
    chunk: int  # the most prompt tokens one prefill chunk reads
    stop_at: int  # Stop inside the prefill once this many prompt tokens are read
    wait_ms: int = WAIT_MS  # a wait that fails only when something hangs (never a timing check)


class Gate:
    """Holds the engine thread at the first event `when` picks, until release(): the window
    acts (Stop, opens another chat, sends) at that point of the reply."""

    def __init__(self, engine: Engine, when: Callable[[EngineEvent], bool]) -> None:
        self.engine = engine
        self.when = when
        self.event: Any = None
        self.reached = threading.Event()
        self._release = threading.Event()
        engine.add_listener(self._on_event)

    def _on_event(self, event: EngineEvent) -> None:  # engine thread
        if self.event is not None or not self.when(event):
            return
        self.event = event
        self.reached.set()
        self._release.wait(GATE_S)

    def wait(self, bot: QtBot, timeout_ms: int) -> Any:
        """Spin the GUI until the engine is held; the event it is held at."""
        bot.waitUntil(self.reached.is_set, timeout=timeout_ms)
        return self.event

    def release(self) -> None:
        self.engine.remove_listener(self._on_event)
        self._release.set()


def _started(window: MainWindow) -> list[str]:
    ids: list[str] = []
    window.sig_reply_started.connect(ids.append)
    return ids


def _finished(window: MainWindow) -> dict[str, GenerationResult]:
    done: dict[str, GenerationResult] = {}
    window.sig_reply_finished.connect(lambda r: done.setdefault(r.request_id, r))
    return done


def send_and_wait(bot: QtBot, rig: Rig, text: str) -> GenerationResult:
    """Send text (the window must take it); the reply's result once it ends."""
    with bot.waitSignal(rig.window.sig_reply_finished, timeout=rig.wait_ms) as blocker:
        assert rig.window.send(text)
    result: GenerationResult = blocker.args[0]
    return result


def _escape(bot: QtBot, window: MainWindow) -> None:
    """Stop, as the user does it: Esc in the message box."""
    bot.keyClick(window.composer.editor, Qt.Key.Key_Escape)


# ----- send and stream ------------------------------------------------------------------------
def send_and_stream(bot: QtBot, rig: Rig) -> dict[str, Any]:
    window = rig.window
    greedy(window, 24)
    painted: list[int] = []
    window.chat.sig_tokens_painted.connect(lambda _rid, idx, _ns: painted.extend(idx))
    shown = window.model_info
    result = send_and_wait(bot, rig, "Name three colours of the rainbow.")
    messages = window.store.messages(window.conversation_id)
    return {
        "window_engine": shown.engine if shown else "",
        "engine": result.model.engine if result.model else "",
        "finish": result.finish_reason,
        "output_tokens": result.metrics.output_tokens,
        "text": result.text,
        "painted": painted,
        "inserts": window.chat.insert_count,
        "roles": [m.role for m in messages],
        "saved_text": messages[-1].content,
        "saved_status": messages[-1].status,
        "saved_output_tokens": (messages[-1].metrics or {}).get("output_tokens"),
        "composer": window.composer.text(),
    }


# ----- Stop while it writes ------------------------------------------------------------------
def stop_mid_reply(bot: QtBot, rig: Rig) -> dict[str, Any]:
    """Esc while the reply streams, held at its second token until the key is pressed."""
    window = rig.window
    greedy(window, 200)
    gate = Gate(rig.engine, lambda e: isinstance(e, TokenEmitted) and e.index == 1)
    try:
        with bot.waitSignal(window.sig_reply_finished, timeout=rig.wait_ms) as blocker:
            assert window.send("Tell me a long story about a dragon and a knight.")
            gate.wait(bot, rig.wait_ms)
            button = window.composer.button.text()
            _escape(bot, window)
            gate.release()
    finally:
        gate.release()
    result: GenerationResult = blocker.args[0]
    saved = window.store.messages(window.conversation_id)[-1]
    return {
        "button_while_streaming": button,
        "button_after": window.composer.button.text(),
        "finish": result.finish_reason,
        "output_tokens": result.metrics.output_tokens,
        "tokens_at_stop": gate.event.index + 1,
        "saved_status": saved.status,
        "saved_matches": saved.content == result.text,
    }


# ----- Stop while the prompt is read, then Regenerate -------------------------------------------
STORY = "Write a long story about a dragon who learns to bake bread."


def stop_in_prefill_then_regenerate(bot: QtBot, rig: Rig) -> dict[str, Any]:
    """Esc while a long prompt is read (nothing else running), then Regenerate."""
    return _stop_in_prefill(bot, rig, beside_a_stream=False)


def stop_in_prefill_beside_a_stream_then_regenerate(bot: QtBot, rig: Rig) -> dict[str, Any]:
    """The same while another chat streams (the prompt is read beside its decode steps)."""
    return _stop_in_prefill(bot, rig, beside_a_stream=True)


def _stop_in_prefill(bot: QtBot, rig: Rig, *, beside_a_stream: bool) -> dict[str, Any]:
    window = rig.window
    ids, finished = _started(window), _finished(window)
    starts: dict[str, PrefillStarted] = {}
    window.bridge.sig_prefill_started.connect(lambda e: starts.setdefault(e.request_id, e))
    stream = None
    if beside_a_stream:  # chat B streams (held at its third token until A is sent)
        greedy(window, 64)  # it need only be streaming when A joins: A then goes beside it
        stream = Gate(rig.engine, lambda e: isinstance(e, TokenEmitted) and e.index == 2)
        assert window.send(STORY)
        stream.wait(bot, rig.wait_ms)
        window.new_chat()
    greedy(window, 8)
    gate = Gate(rig.engine, lambda e: isinstance(e, PrefillProgress)
                and e.done_tokens >= rig.stop_at)
    try:
        # Its own first words: no other chat on this engine has the prompt cached already
        assert window.send(("Beside a stream. " if beside_a_stream else "Alone. ")
                           + rig.long_prompt)
        cut_id = ids[-1]
        if stream is not None:
            stream.release()  # A joins while B streams
        held = gate.wait(bot, rig.wait_ms)
        _escape(bot, window)
    finally:
        gate.release()
        if stream is not None:
            stream.release()
    bot.waitUntil(lambda: cut_id in finished, timeout=rig.wait_ms)
    cut = finished[cut_id]
    conv = window.conversation_id
    saved = window.store.messages(conv)[-1]
    shown = stopped_reply_view(window)
    window.regenerate(saved.id)
    again_id = ids[-1]
    bot.waitUntil(lambda: again_id in finished, timeout=rig.wait_ms)
    result = finished[again_id]
    first, second = starts[cut_id], starts[again_id]
    return {
        "engine": result.model.engine if result.model else "",
        "read_at_stop": held.done_tokens,
        "prompt_total": held.total_tokens,
        "stopped_finish": cut.finish_reason,
        "stopped_output_tokens": cut.metrics.output_tokens,
        "stopped_status": saved.status,
        "stopped_read": cut.metrics.prefilled_tokens,
        "stopped_complete": cut.metrics.prefill_complete,
        "shown": shown,
        "first": (first.prompt_tokens, first.cached_tokens),
        "again": (second.prompt_tokens, second.cached_tokens, second.cache_miss_reason),
        "again_metrics_cached": result.metrics.cached_tokens,
        "again_finish": result.finish_reason,
        "again_output_tokens": result.metrics.output_tokens,
        "roles": [m.role for m in window.store.messages(conv)],
        "chunk": rig.chunk,
    }


def stopped_reply_view(window: MainWindow) -> dict[str, str]:
    """What the HUD and the chat show once a reply stopped: the headline, the TTFT plot's and
    the cache ledger's captions, the breakdown's table and advice, and the transcript (with
    the line under the reply)."""
    hud = window.hud
    hud.flush()
    return {
        "ttft": hud._kpis["TTFT"].text(),
        "itl": hud._kpis["ITL p50"].text(),
        "ttft_caption": hud.panels["ttft"].caption.text(),
        "cache_caption": hud.panels["cache"].caption.text(),
        "throughput_caption": hud.panels["throughput"].caption.text(),
        "itl_caption": hud.panels["itl"].caption.text(),
        "breakdown": hud.panels["breakdown"].table.text(),
        "advice": hud.advice_label.text(),
        "transcript": window.chat.toPlainText(),
    }


# ----- two chats at once, and the HUD of the chat on screen --------------------------------------
def hud_view(window: MainWindow) -> dict[str, Any]:
    """What the HUD shows now: the reply its panels describe (and its chat), the headline."""
    hud = window.hud
    hud.flush()
    reply = hud.selected_reply()
    chat = hud.model.chat_of(reply.request_id) if reply is not None else None
    return {
        "request_id": reply.request_id if reply is not None else None,
        "chat": chat[0] if chat else None,
        "ttft": hud._kpis["TTFT"].text(),
        "decode": hud._kpis["decode"].text(),
        "context": hud.panels["context"].caption.text(),
        "itl_caption": hud.panels["itl"].caption.text(),
    }


def headline(result: GenerationResult) -> dict[str, str]:
    """The HUD headline a finished reply should show."""
    m = result.metrics
    return {"ttft": fmt_seconds(m.ttft_s),
            "decode": f"{m.decode_tok_s:,.1f} tok/s" if m.decode_tok_s else "–",
            "context": f"{m.prompt_tokens + m.output_tokens:,} / "}


def two_chats_at_once(bot: QtBot, rig: Rig) -> dict[str, Any]:
    """Chat A answers; chat B starts a long reply; A is opened while B streams (the HUD must
    speak for A), A's second turn runs beside B's (one batch), then B is opened again."""
    window = rig.window
    ids, finished = _started(window), _finished(window)
    order: list[str] = []  # request ids of tokens, in the engine's own order
    ended: dict[str, int] = {}  # request id -> how many tokens the engine had sent as it ended

    def note(event: object) -> None:  # on the engine's thread: its order, not the UI's timing
        if isinstance(event, TokenEmitted):
            order.append(event.request_id)
        elif isinstance(event, RequestFinished):
            ended[event.request_id] = len(order)
    rig.engine.add_listener(note)

    greedy(window, 12)
    a1 = send_and_wait(bot, rig, "Name a fruit.")
    chat_a = window.conversation_id
    window.new_chat()
    greedy(window, 120)
    gate = Gate(rig.engine, lambda e: isinstance(e, TokenEmitted) and e.index == 2)
    try:
        assert window.send(STORY)
        chat_b, b_id = window.conversation_id, ids[-1]
        gate.wait(bot, rig.wait_ms)  # B is streaming (held at its third token), and on screen:
        bot.waitUntil(lambda: window.session.replies[b_id].output_tokens == 3, timeout=rig.wait_ms)
        window.open_conversation(chat_a)
        a_open = hud_view(window)
        button_a = window.composer.button.text()
        greedy(window, 12)
        assert window.send("And a vegetable?")  # A's second turn, while B streams
        a2_id = ids[-1]
    finally:
        gate.release()
    bot.waitUntil(lambda: a2_id in finished, timeout=rig.wait_ms)
    a_live = hud_view(window)
    bot.waitUntil(lambda: b_id in finished, timeout=rig.wait_ms)
    a_after_b = hud_view(window)
    window.open_conversation(chat_b)
    b_open = hud_view(window)
    b_tokens = [i for i, rid in enumerate(order) if rid == b_id]
    a2_tokens = [i for i, rid in enumerate(order) if rid == a2_id]
    saved = {}
    for name, conv in (("a", chat_a), ("b", chat_b)):
        messages = window.store.messages(conv)
        saved[name] = [(m.role, m.status) for m in messages]
    return {
        "chat_a": chat_a, "chat_b": chat_b, "a1": a1.request_id, "a2": a2_id, "b": b_id,
        "a1_headline": headline(a1), "a2_headline": headline(finished[a2_id]),
        "b_headline": headline(finished[b_id]),
        "a_open": a_open, "a_live": a_live, "a_after_b": a_after_b, "b_open": b_open,
        "button_a_while_b_streams": button_a,
        # the engine sent B's tokens after A's second reply ended
        "b_running_after_a": b_id in order[ended[a2_id]:],
        # A's second reply decoded in B's steps: B's tokens came before, between and after
        "b_tokens_around_a2": bool(a2_tokens) and any(
            a2_tokens[0] < i < a2_tokens[-1] for i in b_tokens),
        "saved": saved,
        "texts_saved": [window.store.messages(c)[-1].content == finished[r].text
                        for c, r in ((chat_a, a2_id), (chat_b, b_id))],
    }


# ----- alternatives ----------------------------------------------------------------------------
def alternatives(bot: QtBot, rig: Rig) -> dict[str, Any]:
    """x3 alternatives stream at once from one prefill; one is kept; the next turn builds on
    it."""
    window = rig.window
    # 0.01: alternatives need a temperature above 0; near-greedy text re-tokenizes the same
    settings(window, temperature=1, max_tokens=8)
    window.composer.alternatives.setValue(3)
    live_streams: list[int] = []
    window.chat.sig_tokens_painted.connect(
        lambda *_: live_streams.append(len(window.chat._streams)))
    with bot.waitSignal(window.sig_alternatives_ready, timeout=rig.wait_ms):
        assert window.send("Name a colour.")
    conv = window.conversation_id
    alts = window.session.alternative_sets[conv]
    results = dict(alts.results)
    html = window.chat.toHtml()
    refused = not window.send("Next")
    window.chat.sig_action.emit("keep", 1)  # the "Keep this one" link of alternative 2
    kept_messages = window.store.messages(conv)
    window.composer.alternatives.setValue(1)
    with bot.waitSignal(window.sig_reply_finished, timeout=rig.wait_ms) as blocker:
        assert window.send("Another one?")
    nxt = blocker.args[0].metrics
    cache = rig.engine.prefix_cache
    return {
        "count": len(results),
        "max_live_streams": max(live_streams, default=0),
        "prefilled": sorted(r.metrics.prefilled_tokens for r in results.values()),
        "labels_shown": all(f"Alternative {i}" in html for i in (1, 2, 3)),
        "refused_before_pick": refused,
        "kept_roles": [m.role for m in kept_messages],
        "kept_text": kept_messages[-1].content == results[1].text,
        "next_cached": nxt.cached_tokens,
        "next_prompt": nxt.prompt_tokens,
        "next_miss": nxt.cache_miss_reason,
        "leftover_alternative_caches": [k for k in (cache.conversations() if cache else [])
                                        if "~alt" in k],
        "engine": next(iter(results.values())).model.engine if results else "",
    }


SCENARIOS: dict[str, Callable[[QtBot, Rig], dict[str, Any]]] = {
    f.__name__: f for f in (send_and_stream, stop_mid_reply, stop_in_prefill_then_regenerate,
                            stop_in_prefill_beside_a_stream_then_regenerate, two_chats_at_once,
                            alternatives)
}
