"""The engine thread with the tiny model: events, metrics, cancel, errors."""

import threading

import pytest

from engine import (
    ChatMessage,
    GenerationRequest,
    PrefillStarted,
    RequestFailed,
    RequestFinished,
    RequestQueued,
    SamplerSnapshot,
    SamplingParams,
    TokenEmitted,
    worker,
)
from engine.errors import PhasewiseError
from engine.worker import Engine


def ask(text: str, **params) -> GenerationRequest:
    defaults = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    defaults.update(params)
    return GenerationRequest([ChatMessage("user", text)], SamplingParams(**defaults))


def test_event_sequence_and_metric_invariants(tiny_engine: Engine) -> None:
    handle = tiny_engine.submit(ask("Hello there"))
    events = list(handle.events(timeout=60))
    kinds = [type(e) for e in events]
    assert kinds[0] is RequestQueued
    assert kinds[1] is PrefillStarted
    assert kinds[-1] is RequestFinished
    result = handle.wait()
    m = result.metrics
    tokens = [e for e in events if isinstance(e, TokenEmitted)]
    assert len(tokens) == m.output_tokens == 12
    assert result.finish_reason == "length"
    assert m.prompt_tokens == m.cached_tokens + m.prefilled_tokens == len(result.prompt_token_ids)
    assert len(m.itl_s) == m.output_tokens - 1
    stamps = [e.t_ns for e in events]
    assert stamps == sorted(stamps), "events are stamped on one monotonic clock, in order"
    assert m.ttft_s >= m.queue_s + m.prefill_s
    assert any(isinstance(e, SamplerSnapshot) for e in events)


def test_streamed_text_equals_result_text(tiny_engine: Engine) -> None:
    handle = tiny_engine.submit(ask("Emoji 😀 please", temperature=1.0, seed=3, max_tokens=30))
    streamed = "".join(e.text for e in handle.events(timeout=60) if hasattr(e, "text"))
    assert streamed == handle.wait().text


def test_greedy_and_seeded_runs_repeat_exactly(tiny_engine: Engine) -> None:
    def run(**kw) -> list[int]:
        return tiny_engine.submit(ask("Hello", **kw)).wait(60).token_ids

    assert run() == run()
    assert run(temperature=1.0, seed=7) == run(temperature=1.0, seed=7)


def test_cancel_stops_within_one_step(tiny_engine: Engine) -> None:
    request = ask("Hello", max_tokens=200)
    cancelled_at: list[int] = []

    def cancel_on_third_token(event) -> None:
        ours = isinstance(event, TokenEmitted) and event.request_id == request.request_id
        if ours and event.index == 2 and not cancelled_at:
            cancelled_at.append(event.index)
            tiny_engine.cancel(request.request_id)

    tiny_engine.add_listener(cancel_on_third_token)
    result = tiny_engine.submit(request).wait(60)
    assert result.finish_reason == "cancelled"
    assert result.metrics.output_tokens == 3  # the token being emitted when cancel arrived


def test_queued_requests_run_in_order_and_report_queue_time(tiny_engine: Engine) -> None:
    requests = [ask(f"Hello {i}", max_tokens=8) for i in range(3)]
    ids = [r.request_id for r in requests]
    queued = threading.Event()
    stamps: dict[type, dict[str, int]] = {RequestQueued: {}, PrefillStarted: {}}
    prefills: list[str] = []
    first_tokens: list[str] = []

    def watch(event) -> None:
        if getattr(event, "request_id", None) not in ids:
            return
        if isinstance(event, (RequestQueued, PrefillStarted)):
            stamps[type(event)][event.request_id] = event.t_ns
        if isinstance(event, PrefillStarted):
            prefills.append(event.request_id)
        if isinstance(event, TokenEmitted) and event.index == 0:
            first_tokens.append(event.request_id)
            queued.wait(60)  # the first reply waits until the other two are queued behind it

    tiny_engine.add_listener(watch)
    handles = [tiny_engine.submit(r) for r in requests]
    queued.set()
    results = [h.wait(60) for h in handles]
    assert all(r.finish_reason == "length" for r in results)
    assert prefills == ids and first_tokens == ids  # started in the order they came
    for rid, result in zip(ids, results, strict=True):  # queue = prefill start - submitted
        waited = stamps[PrefillStarted][rid] - stamps[RequestQueued][rid]
        assert result.metrics.queue_s == pytest.approx(waited / 1e9)
    # the later two waited behind the first, which held its first token until they came
    assert stamps[PrefillStarted][ids[1]] > stamps[PrefillStarted][ids[0]]
    assert results[2].metrics.queue_s > 0


def test_prompt_longer_than_context_is_refused_with_count(tiny_engine: Engine) -> None:
    handle = tiny_engine.submit(ask("Hello there, how are you? " * 100))
    with pytest.raises(PhasewiseError, match=r"761 over the model's context of 256 tokens"):
        handle.wait(60)
    assert isinstance(list(handle.events(timeout=5))[-1], RequestFailed)
    # the engine keeps working
    assert tiny_engine.submit(ask("Hello")).wait(60).finish_reason == "length"


def test_max_tokens_is_capped_by_context(tiny_engine: Engine) -> None:
    result = tiny_engine.submit(ask("Hello", max_tokens=10_000)).wait(120)
    assert result.finish_reason == "length"
    assert result.metrics.prompt_tokens + result.metrics.output_tokens == 256


def test_stop_string_ends_the_reply(tiny_engine: Engine) -> None:
    sampled = {"temperature": 1.0, "seed": 5, "max_tokens": 20}
    base = tiny_engine.submit(ask("Hello", **sampled)).wait(60).text
    start = next(i for i in range(2, len(base) - 2) if base[i : i + 2].strip())
    stop = base[start : start + 2]
    result = tiny_engine.submit(ask("Hello", **sampled, stop=(stop,))).wait(60)
    assert result.finish_reason == "stop"
    assert result.text == base[: base.find(stop)]


def test_failed_load_keeps_the_old_model(tiny_engine: Engine, tmp_path) -> None:
    before = tiny_engine.model_info
    with pytest.raises(PhasewiseError, match="not found"):
        tiny_engine.load_model_sync(str(tmp_path / "missing"))
    assert tiny_engine.model_info == before
    assert tiny_engine.submit(ask("Hello")).wait(60).finish_reason == "length"


def test_a_load_error_opening_with_a_blank_line_still_says_why(
        tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected error whose text opens with a newline (multiprocessing's spawn error
    does) is quoted by its first line with words, not as "cannot load X: "."""
    def fails(spec: str, **_options: object) -> None:
        raise RuntimeError("\n        An attempt has been made to start a new process\nmore")

    monkeypatch.setattr(worker.runtimes, "load", fails)
    with pytest.raises(PhasewiseError) as caught:
        tiny_engine.load_model_sync("somewhere")
    assert str(caught.value) == "cannot load somewhere: An attempt has been made to start a " \
        "new process"


def test_no_model_loaded_fails_clearly() -> None:
    with Engine() as engine, pytest.raises(PhasewiseError, match="no model is loaded"):
        engine.submit(ask("Hello")).wait(30)


def test_shutdown_mid_reply_cancels_the_reply_and_the_queued_one(tiny_model_dir) -> None:
    engine = Engine().start()
    engine.load_model_sync(str(tiny_model_dir), kernel="fp32-eager")
    first, queued = ask("Hello", max_tokens=200), ask("Queued", max_tokens=200)
    started, shut = threading.Event(), threading.Event()

    def hold_the_first_token(event) -> None:
        # On the engine thread: the reply cannot go on (nor end) until shutdown was called.
        if isinstance(event, TokenEmitted) and event.request_id == first.request_id:
            started.set()
            shut.wait(60)

    engine.add_listener(hold_the_first_token)
    handles = [engine.submit(first)]
    assert started.wait(60)
    handles.append(engine.submit(queued))
    engine.shutdown(timeout=0)  # asks, without waiting for the thread
    shut.set()
    results = [h.wait(30) for h in handles]
    assert [r.finish_reason for r in results] == ["cancelled", "cancelled"]
    assert results[0].metrics.output_tokens == 1  # stopped within the step it came in
    assert results[1].metrics.output_tokens == 0  # never started decoding
    engine.shutdown()


def test_a_request_after_shutdown_fails_at_once(tiny_model_dir) -> None:
    """No engine thread serves the inbox after shutdown: the caller gets an error now, not a
    wait that ends only with its own timeout."""
    engine = Engine().start()
    engine.load_model_sync(str(tiny_model_dir), kernel="fp32-eager")
    engine.shutdown()
    with pytest.raises(PhasewiseError, match="the engine has shut down"):
        engine.submit(ask("Hello")).wait(0)
    late = engine.submit_alternatives(ask("Hello", temperature=0.7), 2)
    for handle in late:
        with pytest.raises(PhasewiseError, match="the engine has shut down"):
            handle.wait(0)
