"""The chat session without Qt: a recording view, the tiny engine, the store on disk. Engine
events reach the session on the test's thread, as the bridge hands them to the GUI thread."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import pytest

from engine import (
    EngineEvent,
    PrefillProgress,
    RequestFailed,
    RequestFinished,
    SamplingParams,
    TextFlushed,
    TokenEmitted,
)
from engine.worker import Engine
from ui.session import ActiveReply, ChatSession, PromptReading, ReplyOptions
from ui.store import ChatStore

WAIT_S = 60


class RecordingView:
    """A SessionView that keeps what it was told, by method name."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **_kw: self.calls.append((name, args[0] if len(args) == 1 else args))

    def said(self, name: str) -> list[Any]:
        return [arg for called, arg in self.calls if called == name]


@pytest.fixture
def session(tiny_engine: Engine, tmp_path: Path) -> Any:
    store = ChatStore(tmp_path / "chats.sqlite3")
    events: queue.Queue[EngineEvent] = queue.Queue()
    tiny_engine.add_listener(events.put)
    chat = ChatSession(tiny_engine, store, RecordingView())
    chat.events = events
    yield chat
    tiny_engine.remove_listener(events.put)
    store.close()


def options(alternatives: int = 1, **params: Any) -> ReplyOptions:
    return ReplyOptions(SamplingParams(**({"temperature": 0.0, "max_tokens": 6} | params)),
                        alternatives=alternatives)


def pump(chat: Any) -> None:
    """Hand engine events to the session until no reply runs."""
    while chat.replies:
        event = chat.events.get(timeout=WAIT_S)
        if isinstance(event, (TokenEmitted, TextFlushed)):
            chat.add_text(event.request_id, event.text)
        elif isinstance(event, RequestFinished):
            chat.on_finished(event)
        elif isinstance(event, RequestFailed):
            chat.on_failed(event)


def test_send_saves_the_exchange_with_its_metrics(session: Any) -> None:
    assert session.send("Hello there", options())
    view = session.view
    conv = session.conversation_id
    assert view.said("conversation_created") == [(conv, "Hello there")]
    assert len(view.said("message_saved")) == 1 and view.said("saving") == [True]
    (started,) = view.said("reply_started")
    assert isinstance(started, ActiveReply) and session.reply is started
    pump(session)
    (result,) = view.said("reply_finished")
    user, reply = session.store.messages(conv)
    assert (user.role, user.content) == ("user", "Hello there")
    assert reply.content == result.text == started.text
    assert reply.metrics["prompt_tokens"] == result.metrics.prompt_tokens
    assert view.said("saving")[-1] is False and session.reply is None


def test_refusals_say_why_and_send_nothing(session: Any) -> None:
    assert not session.send("   ", options())
    session.model_info = None
    assert not session.send("Hi", options())
    assert [m.split(":")[0] for m in session.view.said("notify")] == [
        "Type a message first.", "No model is loaded yet"]
    assert session.conversation_id is None and not session.replies


def test_a_busy_chat_refuses_a_second_send(session: Any) -> None:
    assert session.send("Hello", options(max_tokens=40))
    assert not session.send("Again", options())
    assert "still being written" in session.view.said("notify")[-1]
    session.stop(session.conversation_id)
    pump(session)


def test_alternatives_wait_for_a_pick_then_one_is_kept(session: Any,
                                                        tiny_engine: Engine) -> None:
    assert session.send("Hello", options(alternatives=2, temperature=1.0))
    conv = session.conversation_id
    pump(session)
    assert session.view.said("alternatives_ready") == [conv]
    results = dict(session.finished_alternatives(conv))
    assert sorted(results) == [0, 1]
    assert [m.role for m in session.store.messages(conv)] == ["user"]  # nothing kept yet
    assert session.keep_alternative(1)
    assert not session.keep_alternative(1)  # the set is gone
    kept = session.store.messages(conv)[-1]
    assert kept.content == results[1].text and kept.role == "assistant"
    assert conv in tiny_engine.prefix_cache.conversations()  # alternative 1's prefix, adopted


def test_the_history_carries_each_replys_own_ids(session: Any, tiny_engine: Engine) -> None:
    """A finished reply and a kept alternative go into the next request with the ids their
    model produced (the prompt checks they still fit); a user message carries none. Seeded:
    unseeded, the tiny model's sampled alternative could end at once, and an empty reply is
    not history."""
    assert session.send("Hello", options(alternatives=2, temperature=1.0, seed=11))
    conv = session.conversation_id
    pump(session)
    kept = dict(session.finished_alternatives(conv))[1]
    assert kept.text  # the premise: the kept alternative says something
    assert session.keep_alternative(1)
    assert session.send("And then?", options())
    pump(session)
    reply = session.view.said("reply_finished")[-1]
    history = session.history(conv)
    assert [m.role for m in history] == ["user", "assistant", "user", "assistant"]
    identity = tiny_engine.model_info.identity
    assert [(m.token_ids, m.token_model) for m in history] == [
        (None, None), (tuple(kept.token_ids), identity),
        (None, None), (tuple(reply.token_ids), identity)]


def test_each_reply_knows_its_chat_turn_and_the_request_that_wrote_it(session: Any) -> None:
    """What the views name a reply by comes from the session: its chat's title and its turn
    (user turns, not messages); a regenerated reply answers the same turn, alternatives share
    it; a saved reply maps back to the request that wrote it this run."""
    assert session.send("Trip plan", options())
    pump(session)
    assert session.send("And the hotels?", options())
    pump(session)
    conv = session.conversation_id
    first, second = session.view.said("reply_started")
    assert [(r.chat_title, r.turn) for r in (first, second)] == [("Trip plan", 1), ("Trip plan", 2)]
    saved = [m.id for m in session.store.messages(conv) if m.role == "assistant"]
    assert [session.reply_of_message[m] for m in saved] == [first.request_id, second.request_id]

    session.regenerate(saved[-1], options(temperature=1.0), alternatives=2)
    *_, alt_1, alt_2 = session.view.said("reply_started")
    assert [(r.turn, r.alternative) for r in (alt_1, alt_2)] == [(2, 0), (2, 1)]
    pump(session)
    assert session.keep_alternative(1)
    kept = [m.id for m in session.store.messages(conv) if m.role == "assistant"][-1]
    assert session.reply_of_message[kept] == alt_2.request_id


def test_the_time_left_is_said_once_and_a_late_report_is_ignored(session: Any) -> None:
    assert session.send("Hello", options(max_tokens=3))
    reply = session.reply
    rid = reply.request_id
    early = PrefillProgress(rid, 1, 90, 2_000, 420.0, None)
    known = PrefillProgress(rid, 2, 840, 2_000, 420.0, 1_160 / 420)
    assert session.on_prefill_progress(early) is reply
    assert reply.reading == PromptReading(early, "estimating time left", None)
    session.on_prefill_progress(known)
    assert reply.reading == PromptReading(known, "3 s left", 1_160 / 420)
    done = PrefillProgress(rid, 3, 2_000, 2_000, 420.0, 0.0)
    assert PromptReading.of(done).left == "" and PromptReading.of(done).left_s is None
    session.add_token(TokenEmitted(rid, 4, 0, 7, "Hi"))  # it writes: the reading is over
    assert reply.reading is None
    assert session.on_prefill_progress(known) is None and reply.reading is None
    session.stop(session.conversation_id)
    pump(session)


def test_a_failed_request_gives_the_text_back(session: Any) -> None:
    # the view says a draft model is loaded but the engine has none: the engine refuses
    failing = ReplyOptions(SamplingParams(temperature=0.0, max_tokens=6),
                           speculative="draft", draft_loaded=True)
    assert session.send("Hello", failing)
    conv = session.conversation_id
    pump(session)
    assert session.view.said("restore_text") == ["Hello"]
    assert "draft model" in session.view.said("reply_failed")[0]
    assert session.store.messages(conv) == []
