"""A long prompt prefilled beside the streaming rows (engine/runtimes/llamacpp/side_prefill.py).

While a row streams, a prompt of SIDE_MIN_TOKENS or more goes through a second llama.cpp
context in a thread of its own; its KV is then copied onto its sequence in the main context.
Everything that runs llama.cpp runs in a spawned child process (run_in_child).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from engine.runtimes.llamacpp import side_prefill
from tests.support.child import CHILD_TIMEOUT_S, needs_llama_cpp, run_in_child
from tests.support.llamacpp import (
    agree_until_near_tie,
    alone_with_margins,
    chat_ids,
    load_default,
)

pytestmark = pytest.mark.timeout(CHILD_TIMEOUT_S + 60)
LONG_TOKENS = 600  # over SIDE_MIN_TOKENS: prefilled beside a streaming row


def _side_body(memory_bytes: int | None = None, long_tokens: int = LONG_TOKENS) -> dict:
    """Three prompts joining while a row streams: a cold one, one that continues a cached chat
    (its prefix is copied into the side context), one stopped at its first progress. With
    memory_bytes, the machine reports that much free memory."""
    from engine.core.reply import DetachedJob
    from engine.events import PrefillProgress, TokenEmitted
    from engine.params import GenerationRequest, SamplingParams
    from engine.runtimes.llamacpp.batcher import LlamaBatcher
    from engine.tools.bench import fixed_prompt_ids

    if memory_bytes is not None:
        side_prefill.free_memory = lambda _device: memory_bytes  # type: ignore[assignment]
    import torch

    runtime = load_default()

    loaded = runtime.model
    torch_threads = torch.get_num_threads()
    pool = runtime.new_prefix_cache(1 << 30)
    stream_ids = chat_ids(loaded, "Count to twenty.")
    source = fixed_prompt_ids(loaded, 2 * LONG_TOKENS)
    long_ids, turn1_ids = source[:long_tokens], source[LONG_TOKENS : LONG_TOKENS + 300]
    stream_alone = alone_with_margins(loaded, pool, stream_ids, 32)
    long_alone = alone_with_margins(loaded, pool, long_ids, 6)
    events: list[tuple[str, str, int]] = []
    results: dict[str, Any] = {}

    def job(name: str, ids: list[int], tokens: int, chat: str | None = None) -> Any:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        return DetachedJob(GenerationRequest([], params, request_id=name, prompt_token_ids=ids,
                                             conversation_id=chat, reuse_cache=chat is not None))

    def emit(job_: Any, event: Any) -> None:
        if isinstance(event, PrefillProgress):
            events.append(("progress", event.request_id, event.done_tokens))
            if event.request_id == "stop":
                job_.cancel.set()  # Stop pressed once the first side chunk is in
        elif isinstance(event, TokenEmitted):
            events.append(("token", event.request_id, 0))

    def done(job_: Any, result: Any, error: Any) -> None:
        results[job_.request.request_id] = ((result.finish_reason, result.token_ids,
                                             result.metrics.cached_tokens)
                                            if result else repr(error))

    batcher = LlamaBatcher(loaded, pool, emit, done)

    def beside_a_stream(name: str, long: Any) -> None:
        batcher.admit([job(name, stream_ids, 32)])
        batcher.step()
        batcher.admit([long])
        while batcher.rows:
            batcher.step()

    beside_a_stream("stream-cold", job("cold", long_ids, 6))
    batcher.admit([job("turn1", turn1_ids, 4, chat="chat")])
    while batcher.rows:
        batcher.step()
    turn2_ids = turn1_ids + results["turn1"][1] + long_ids[:side_prefill.SIDE_MIN_TOKENS + 44]
    turn2_alone = alone_with_margins(loaded, pool, turn2_ids, 6)
    beside_a_stream("stream-turn2", job("turn2", turn2_ids, 6, chat="chat"))
    beside_a_stream("stream-stop", job("stop", long_ids, 6))
    lib = loaded.llama_cpp
    return {
        "side_prefills": batcher.side_prefills, "mixed_steps": batcher.mixed_steps,
        "threads": (int(lib.llama_n_threads(loaded.ctx)), loaded.n_threads),
        "torch_threads": (torch.get_num_threads(), torch_threads),
        "events": events, "results": results,
        "cold_agrees": agree_until_near_tie(results["cold"][1], *long_alone),
        "turn2_agrees": agree_until_near_tie(results["turn2"][1], *turn2_alone),
        "streams_agree": [agree_until_near_tie(results[f"stream-{name}"][1], *stream_alone)
                          for name in ("cold", "turn2", "stop")],
    }


@needs_llama_cpp
def test_a_long_prompt_is_prefilled_beside_a_streaming_row() -> None:
    """The row keeps streaming while the prompt goes in on the side context; both replies are
    their alone runs' (up to a near-tie); a cached prefix is used, not prefilled again; Stop
    ends the side prefill at its next chunk and the row streams on; the main context gets
    its threads back."""
    out = run_in_child(_side_body)
    assert out["side_prefills"] == 3 and out["mixed_steps"] == 0
    results, events = out["results"], out["events"]
    assert results["cold"][0] == "length" and len(results["cold"][1]) == 6
    assert out["cold_agrees"] and out["turn2_agrees"] and all(out["streams_agree"]), out
    turn2_cached = results["turn2"][2]
    assert turn2_cached >= 300  # turn 1's prompt came from the cache into the side context
    progress = [done for kind, rid, done in events if kind == "progress" and rid == "cold"]
    assert progress == sorted(progress) and progress[-1] == LONG_TOKENS and len(progress) >= 2
    before_in = events[: events.index(("progress", "cold", LONG_TOKENS))]
    streamed = before_in.count(("token", "stream-cold", 0))
    assert streamed > 2, "the row streamed no token while the prompt was prefilled beside it"
    assert results["stop"][:2] == ("cancelled", [])
    stop_progress = [done for kind, rid, done in events if kind == "progress" and rid == "stop"]
    assert 1 <= len(stop_progress) <= 2  # the chunk under way when Stop came may finish
    assert stop_progress[-1] < LONG_TOKENS
    assert results["stream-stop"][0] == "length" and len(results["stream-stop"][1]) == 32
    assert out["threads"][0] == out["threads"][1]  # the main context's and the sampler's
    assert out["torch_threads"][0] == out["torch_threads"][1]  # threads, given back


@needs_llama_cpp
def test_without_memory_to_spare_the_prompt_rides_in_the_rows_steps() -> None:
    """A side context needs its own KV memory: where the machine has too little free, the
    prompt goes in the rows' steps as before, and the replies are the same."""
    out = run_in_child(_side_body, 1 << 20, side_prefill.SIDE_MIN_TOKENS)
    assert out["side_prefills"] == 0 and out["mixed_steps"] > 0
    assert out["cold_agrees"] and out["turn2_agrees"] and all(out["streams_agree"]), out
    assert out["results"]["stop"][:2] == ("cancelled", [])


def _stop_inside_body() -> dict:
    """A side prefill on its own thread, stopped once its second chunk is half way through the
    model. Stop is pressed from inside the progress report (on the side thread, as the reading
    is written), so where it lands does not hang on how two threads happen to interleave."""
    import threading

    from engine.core.schedule import FIRST_SIDE_CHUNK
    from engine.tools.bench import fixed_prompt_ids

    runtime = load_default()

    loaded = runtime.model
    pool = runtime.new_prefix_cache(1 << 30)
    cancel = threading.Event()
    side = side_prefill.SidePrefill(loaded, pool.cold_lease(None), fixed_prompt_ids(
        loaded, LONG_TOKENS), cancel)
    readings: list[tuple[int, int, float]] = []
    report = side._now_reading

    def now_reading(begin: int, size: int, fraction: float) -> None:
        report(begin, size, fraction)
        readings.append(side.reading)  # every reading the engine thread could see
        if begin > 0 and fraction > 0.5:
            cancel.set()  # Stop pressed inside the second chunk

    side._now_reading = now_reading  # type: ignore[method-assign]
    side.start()
    side.wait(CHILD_TIMEOUT_S)
    try:
        logits = side.finish(pool)
    finally:
        side.close()
    return {"readings": readings, "done": side.done, "logits": logits,
            "first_chunk": FIRST_SIDE_CHUNK, "graph_nodes": loaded.graph_nodes}


@needs_llama_cpp
def test_a_side_prefill_reports_and_stops_inside_its_chunks() -> None:
    out = run_in_child(_stop_inside_body)
    first = out["first_chunk"]
    assert out["graph_nodes"] > 100  # learned from the first chunk
    # The first chunk teaches the meter the graph's size: only the second reports, and
    # Stop inside it leaves no third.
    assert {begin for begin, _, _ in out["readings"]} == {first}
    second = out["readings"]
    fractions = [f for _, _, f in second]
    assert all(0.0 < f < 1.0 for f in fractions) and fractions == sorted(fractions)
    assert fractions[-1] > 0.5  # Stop came once past half way
    assert out["done"] == first  # the second chunk was stopped inside: it never counted
    assert out["logits"] is None  # Stop came first: nothing to join with


def _model(threads: int, kv_bytes_per_token: int = 1024) -> Any:
    return SimpleNamespace(n_threads=threads, kv_bytes_per_token=kv_bytes_per_token)


def test_side_prefill_needs_a_long_prompt_two_cores_and_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(side_prefill, "free_memory", lambda _device: 8 << 30)
    long = side_prefill.SIDE_MIN_TOKENS
    assert side_prefill.can_prefill_beside(_model(2), long, long)
    assert not side_prefill.can_prefill_beside(_model(2), long, long - 1)  # short: in the steps
    assert not side_prefill.can_prefill_beside(_model(1), long, long)  # one core: nothing beside
    assert side_prefill.side_threads(_model(8)) == 4  # half the cores prefill, half decode
    need = side_prefill.side_context_bytes(_model(2, 1 << 20), 4000)
    assert need == 2 * (1 << 20) * 4096 + side_prefill.WORK_BYTES  # KV + its copy, padded
    monkeypatch.setattr(side_prefill, "free_memory", lambda _device: 2 * need - 1)
    assert not side_prefill.can_prefill_beside(_model(2, 1 << 20), 4000, 4000)
    monkeypatch.setattr(side_prefill, "free_memory", lambda _device: None)  # unknown: try
    assert side_prefill.can_prefill_beside(_model(2, 1 << 20), 4000, 4000)
