"""Continuous batching in the engine: rows share decode steps, join and leave between steps,
and each row's output is exactly what the request gives alone."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine import (
    ChatMessage,
    EngineEvent,
    GenerationRequest,
    GenerationResult,
    InvalidRequestError,
    PhasewiseError,
    PrefillStarted,
    SamplingParams,
    TokenEmitted,
)
from engine.core.schedule import MAX_BATCH
from engine.worker import Engine
from tests.support.fault_injection import ForwardFault
from tests.support.tiny_model import sharpened

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    "Hello",
    "The capital of France is Paris and the capital of Germany is",
    "def main():",
    "Emoji and CJK café naïve résumé, hello how are you today? I am fine",
]


@pytest.fixture(scope="module")
def sharp_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its layer weights scaled up (tests/support/tiny_model.py): its
    greedy output depends on the whole context (the plain tiny model repeats one token), so a
    wrong KV row or position shows up as different tokens."""
    return sharpened(tiny_model_dir, tmp_path_factory.mktemp("sharp-model"))


@pytest.fixture
def engine(sharp_model_dir: Path) -> Iterator[Engine]:
    with Engine(cache_budget_bytes=64 << 20) as eng:
        eng.load_model_sync(str(sharp_model_dir), kernel="fp32-eager")
        yield eng


def ask(text: str, params: SamplingParams = GREEDY, **kw: Any) -> GenerationRequest:
    return GenerationRequest([ChatMessage("user", text)], params, **kw)


def alone(engine: Engine, request: GenerationRequest) -> GenerationResult:
    """The request run by itself, cold (nothing else in the batch, nothing cached)."""
    solo = GenerationRequest(request.messages, request.params, reuse_cache=False)
    return engine.submit(solo).wait(60)


def token_order(engine: Engine) -> list[str]:
    """Request ids of TokenEmitted events, in the order the engine emitted them."""
    order: list[str] = []
    engine.add_listener(lambda e: order.append(e.request_id) if isinstance(e, TokenEmitted)
                        else None)
    return order


def on_token(engine: Engine, request_id: str, index: int, action: Callable[[], Any]) -> None:
    """Run action (on the engine thread) when request_id emits its token number `index`."""
    def listener(event: EngineEvent) -> None:
        if isinstance(event, TokenEmitted) and event.request_id == request_id \
                and event.index == index:
            action()

    engine.add_listener(listener)


@contextlib.contextmanager
def engine_held(engine: Engine) -> Iterator[None]:
    """Keep the engine thread busy inside a one-token request until the block ends, so
    everything submitted inside the block is queued when it resumes."""
    entered, gate = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait(30)

    blocker = ask("wait", SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    on_token(engine, blocker.request_id, 0, hold)
    handle = engine.submit(blocker)
    assert entered.wait(30)
    try:
        yield
    finally:
        gate.set()
        handle.wait(30)


def interleaved(order: list[str], a: str, b: str) -> bool:
    """b emitted a token between two of a's tokens: they shared decode steps."""
    first_a, last_a = order.index(a), len(order) - 1 - order[::-1].index(a)
    return b in order[first_a:last_a]


def test_batched_greedy_output_matches_each_request_alone(engine: Engine) -> None:
    requests = [ask(p, conversation_id=f"c{i}") for i, p in enumerate(PROMPTS)]
    expected = [alone(engine, r).token_ids for r in requests]
    assert len({tuple(t) for t in expected}) == len(PROMPTS), "prompts give different replies"
    order = token_order(engine)

    handles = [engine.submit(r) for r in requests]
    results = [h.wait(60) for h in handles]

    assert [r.token_ids for r in results] == expected
    assert all(interleaved(order, requests[0].request_id, r.request_id) for r in requests[1:])


def test_sampled_rows_with_seeds_match_alone(engine: Engine) -> None:
    requests = [ask(p, SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=i,
                                      ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    expected = [alone(engine, r).token_ids for r in requests]
    handles = [engine.submit(r) for r in requests]
    assert [h.wait(60).token_ids for h in handles] == expected


def test_requests_join_and_leave_mid_run(engine: Engine) -> None:
    long = ask(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    short = ask(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    late = ask(PROMPTS[3])
    expected = {r.request_id: alone(engine, r).token_ids for r in (long, short, late)}
    order = token_order(engine)
    handles: list = []
    on_token(engine, long.request_id, 3, lambda: handles.append(engine.submit(short)))
    on_token(engine, short.request_id, 2, lambda: handles.append(engine.submit(late)))

    first = engine.submit(long).wait(60)
    results = [first] + [h.wait(60) for h in handles]

    assert {r.request_id: r.token_ids for r in results} == expected
    assert order.index(short.request_id) > order.index(long.request_id) + 3  # joined later
    assert interleaved(order, long.request_id, short.request_id)
    assert interleaved(order, long.request_id, late.request_id)
    # short left after 5 tokens while the others went on
    short_last = len(order) - 1 - order[::-1].index(short.request_id)
    assert long.request_id in order[short_last + 1 :]


def test_cancelling_one_row_leaves_the_others_intact(engine: Engine) -> None:
    requests = [ask(p) for p in PROMPTS[:3]]
    expected = [alone(engine, r).token_ids for r in requests]
    victim = requests[1]
    on_token(engine, victim.request_id, 4, lambda: engine.cancel(victim.request_id))

    results = [h.wait(60) for h in [engine.submit(r) for r in requests]]

    assert results[1].finish_reason == "cancelled"
    assert results[1].token_ids == expected[1][:5]
    assert [results[0].token_ids, results[2].token_ids] == [expected[0], expected[2]]
    assert {results[0].finish_reason, results[2].finish_reason} == {"length"}
    assert engine._active == {}


def test_per_row_metrics_add_up(engine: Engine) -> None:
    prefills: dict[str, PrefillStarted] = {}
    engine.add_listener(lambda e: prefills.setdefault(e.request_id, e)
                        if isinstance(e, PrefillStarted) else None)
    handles = [engine.submit(ask(p, conversation_id=f"m{i}")) for i, p in enumerate(PROMPTS)]
    results = [h.wait(60) for h in handles]

    for result in results:
        m = result.metrics
        assert m.prompt_tokens == len(result.prompt_token_ids) == m.cached_tokens + \
            m.prefilled_tokens
        assert m.prefilled_tokens == m.prompt_tokens  # first turns: nothing cached
        assert m.output_tokens == len(result.token_ids) == GREEDY.max_tokens
        assert len(m.itl_s) == m.output_tokens - 1
        assert m.queue_s + m.prefill_s <= m.ttft_s <= m.e2e_s
        assert m.decode_s == pytest.approx(sum(m.itl_s))
        assert m.decode_tok_s == pytest.approx((m.output_tokens - 1) / m.decode_s)
        assert prefills[result.request_id].prompt_tokens == m.prompt_tokens


def test_next_turn_hits_the_cache_after_a_batched_turn(engine: Engine) -> None:
    """Each row's KV goes back to its conversation: the next turn reuses exactly what it
    reuses after the same turn run alone (the random model's replies do not re-tokenize
    identically, so the ledger says where the match ends; it must not differ)."""

    def two_turns(tag: str, batched: bool) -> list[GenerationResult]:
        first = [ask(p, conversation_id=f"{tag}{i}") for i, p in enumerate(PROMPTS[:3])]
        replies = run(first, batched)
        follow_ups = [
            GenerationRequest([*r.messages, ChatMessage("assistant", reply.text),
                               ChatMessage("user", "And then?")], GREEDY,
                              conversation_id=r.conversation_id)
            for r, reply in zip(first, replies, strict=True)
        ]
        return run(follow_ups, batched)

    def run(requests: list[GenerationRequest], batched: bool) -> list[GenerationResult]:
        if batched:
            return [h.wait(60) for h in [engine.submit(r) for r in requests]]
        return [engine.submit(r).wait(60) for r in requests]

    sequential = two_turns("s", batched=False)
    for i in range(3):  # else they would donate their longer prefixes to the batched run
        engine.drop_conversation(f"s{i}")
    batched = two_turns("b", batched=True)

    def ledger(r: GenerationResult) -> tuple:
        return r.metrics.cached_tokens, r.metrics.cache_miss_reason, r.token_ids

    assert [ledger(r) for r in batched] == [ledger(r) for r in sequential]
    assert all(r.metrics.cached_tokens > len(PROMPTS[0]) for r in batched)


def test_alternatives_share_one_prefill_and_each_reproduces_alone(engine: Engine) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=40, ignore_eos=True)
    request = ask(PROMPTS[1], params, conversation_id="alt")
    order = token_order(engine)

    handles = engine.submit_alternatives(request, 3)
    results = [h.wait(60) for h in handles]

    ids = [r.request_id for r in results]
    assert len(set(ids)) == 3 and request.request_id not in ids
    prompt = len(results[0].prompt_token_ids)
    assert [r.metrics.prefilled_tokens for r in results] == [prompt, 0, 0]
    assert [r.metrics.cached_tokens for r in results] == [0, prompt, prompt]
    assert len({tuple(r.token_ids) for r in results}) == 3, "each alternative has its own seed"
    for i, result in enumerate(results):  # alternative i is the request with seed 40 + i
        solo = ask(PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=16, seed=40 + i,
                                              ignore_eos=True))
        assert result.token_ids == alone(engine, solo).token_ids
    assert interleaved(order, ids[0], ids[2])


def test_alternatives_count_is_checked() -> None:
    for n in (0, 9):
        with pytest.raises(InvalidRequestError, match="alternatives"):
            ask("hi").alternatives(n)


def test_one_batch_step_serves_every_row(engine: Engine) -> None:
    """The throughput mechanism: B requests of T tokens cost B prefills plus about T decode
    forwards in all, not B x T."""
    calls = 0
    model = engine._runtime.loaded.model
    original = model.forward

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with engine_held(engine):  # all four are queued when the engine resumes
        model.forward = counting
        handles = [engine.submit(ask(p, params)) for p in PROMPTS]
    try:
        results = [h.wait(60) for h in handles]
    finally:
        model.forward = original
    assert all(r.metrics.output_tokens == 12 for r in results)
    assert calls == len(PROMPTS) + (12 - 1)


def test_more_requests_than_a_batch_wait_their_turn(engine: Engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    requests = [ask(f"{PROMPTS[i % 4]} {i}", params) for i in range(MAX_BATCH + 3)]
    expected = [alone(engine, r).token_ids for r in requests]
    assert [h.wait(60).token_ids for h in [engine.submit(r) for r in requests]] == expected


def test_speculative_request_runs_alone_and_the_batch_goes_on(engine: Engine) -> None:
    plain = [ask(p) for p in PROMPTS[:2]]
    spec = ask(PROMPTS[2], speculative="ngram")
    expected = [alone(engine, r).token_ids for r in [*plain, spec]]
    handles = [engine.submit(r) for r in (plain[0], spec, plain[1])]
    results = [h.wait(60) for h in handles]
    assert [results[0].token_ids, results[2].token_ids, results[1].token_ids] == expected
    assert results[1].speculative == "ngram"


def test_a_forward_error_fails_the_batch_and_the_engine_recovers(engine: Engine) -> None:
    fault = ForwardFault(engine)
    with engine_held(engine):
        handles = [engine.submit(ask(p)) for p in PROMPTS[:2]]
        fault.arm(ValueError("bad step"), at=4)  # two prefills, one step, then this step
    for handle in handles:
        with pytest.raises(PhasewiseError, match="bad step"):
            handle.wait(60)
    fault.remove()
    assert engine._active == {}
    assert engine.submit(ask(PROMPTS[0])).wait(60).token_ids == alone(engine, ask(PROMPTS[0])
                                                                      ).token_ids


@pytest.mark.real_model
def test_real_model_batched_matches_alone(real_engine: Engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24)
    requests = [ask(p, params) for p in ("What is the capital of France?",
                                         "Name three colours.", "Say hi.")]
    expected = [alone(real_engine, r).token_ids for r in requests]
    assert [h.wait(120).token_ids for h in [real_engine.submit(r) for r in requests]] == expected


# ----- the scheduler's decisions on their own (mutation testing, `make mutation`) ---------------
def fake_loaded(context: int = 64, template_fallback: bool = False) -> Any:
    """What the Batcher reads of a loaded model to decide things, without a model."""
    from types import SimpleNamespace

    return SimpleNamespace(
        device=torch.device("cpu"), tokenizer=SimpleNamespace(eos_token_id=2),
        model=SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[2, 3])),
        info=SimpleNamespace(template_fallback=template_fallback, context_length=context))


def decisions(prefill_chunk: int = 256, streaming: int = 0, **kw: Any) -> Any:
    """A Batcher with `streaming` placeholder rows (only their count matters here)."""
    from engine.runtimes.torch.batching import Batcher
    from engine.runtimes.torch.prefix_cache import PrefixCache

    batcher = Batcher(fake_loaded(), PrefixCache(None, 1 << 20), lambda job, e: None,
                      lambda job, result, error: None, prefill_chunk=prefill_chunk, **kw)
    batcher.rows = [object()] * streaming
    return batcher


def test_speculative_requests_join_the_batch_only_where_it_verifies_drafts() -> None:
    from engine.core.batch import batchable

    for drafts_in_batch in (False, True):
        assert batchable(ask("hi"), drafts_in_batch)
        assert batchable(ask("hi", speculative="ngram"), drafts_in_batch) is drafts_in_batch
        assert not batchable(ask("hi", speculative="draft"), drafts_in_batch)


def test_only_caches_of_plain_attention_layers_batch() -> None:
    from types import SimpleNamespace

    from transformers import Lfm2Config, LlamaConfig, MistralConfig

    from engine.runtimes.torch.batching import cache_supports_batching

    sizes = dict(num_hidden_layers=2, hidden_size=16, intermediate_size=32, vocab_size=50,
                 num_attention_heads=2, num_key_value_heads=1)
    conv = Lfm2Config(**sizes, layer_types=["conv", "full_attention"])
    for config, expected in ((LlamaConfig(**sizes), True),
                             (MistralConfig(**sizes, sliding_window=4), True),  # kept whole
                             (conv, False), (None, False)):  # a recurrent layer; no layers
        loaded = SimpleNamespace(model=SimpleNamespace(config=config))
        assert cache_supports_batching(loaded) is expected, config


def test_a_prompt_alone_is_read_in_whole_chunks() -> None:
    assert decisions(prefill_chunk=256)._chunk_tokens() == 256
    assert decisions(prefill_chunk=256, streaming=3, interleave=False)._chunk_tokens() == 256


def test_beside_streaming_rows_a_chunk_is_the_budget_less_one_token_a_row() -> None:
    from engine.core.schedule import MIN_INTERLEAVED_CHUNK, STEP_TOKEN_BUDGET

    assert decisions()._chunk_tokens() == 256
    assert decisions(streaming=1).step_token_budget == STEP_TOKEN_BUDGET == 32
    assert MIN_INTERLEAVED_CHUNK == 32
    for budget, rows, expected in ((100, 3, 97), (100, 1, 99), (1000, 3, 256),
                                   (34, 3, 32), (32, 1, 32)):  # never below 32 tokens
        batcher = decisions(streaming=rows, step_token_budget=budget)
        assert batcher._chunk_tokens() == expected, (budget, rows)
    assert decisions(prefill_chunk=16, streaming=1, step_token_budget=100)._chunk_tokens() == 32


def test_the_budget_follows_the_clock_halfway_and_within_bounds() -> None:
    """The next chunk should take about one decode step (CHUNK_STALL = 1): the budget scales
    by sqrt(step / chunk), between 32 + rows and the prefill chunk + rows."""

    def adapted(budget: int, step_s: float, chunk_s: float, rows: int = 2) -> int:
        batcher = decisions(streaming=rows)
        batcher.step_token_budget, batcher._decode_step_s = budget, step_s
        batcher._adapt_budget(chunk_s)
        return batcher.step_token_budget

    assert adapted(100, 0.09, 0.04) == 150  # sqrt(2.25): chunks were cheap, grow them
    assert adapted(100, 0.01, 0.0225) == 67  # sqrt(0.444...) = 0.667
    assert adapted(100, 0.04, 0.04) == 100
    assert adapted(32, 0.01, 0.04) == 34  # halved to 16, floored at 32 + 2 rows
    assert adapted(32, 0.01, 0.04, rows=5) == 37
    assert adapted(200, 0.04, 0.01) == 258  # doubled to 400, capped at 256 + 2 rows
    assert adapted(100, 0.0, 0.04) == 100  # no decode step measured yet
    assert adapted(100, 0.04, 0.0) == 100
    fixed = decisions(streaming=2, step_token_budget=100)
    fixed._decode_step_s = 0.09
    fixed._adapt_budget(0.04)
    assert fixed.step_token_budget == 100  # a given budget stays


def test_a_row_may_generate_up_to_max_tokens_or_the_context_left() -> None:
    from engine.core.chat_template import FALLBACK_STOPS
    from engine.core.prompt import PreparedPrompt
    from engine.core.reply import DetachedJob, Reply
    from engine.runtimes.torch.batching import Batcher

    batcher = decisions()
    lease = batcher.prefix_cache.cold_lease("c")
    prompt = list(range(60))  # the fake context: 64

    def new_row(owner: Batcher, params: SamplingParams) -> Reply:
        return Reply(DetachedJob(ask("x", params)), PreparedPrompt(prompt), lease, owner.vocab,
                     owner.loaded.info, lambda event: None)

    assert new_row(batcher, SamplingParams(max_tokens=10)).budget == 4
    row = new_row(batcher, SamplingParams(max_tokens=3))
    assert row.budget == 3
    assert (row.prompt_ids, row.lease, row.generated, row.finish) == (prompt, lease, [], None)
    assert new_row(batcher, GREEDY).generator is None
    seeded = new_row(batcher, SamplingParams(seed=5))
    assert seeded.generator is not None
    assert seeded.generator.random() == np.random.default_rng(5).random()
    stops = SamplingParams(stop=("END",), max_tokens=4)
    plain = new_row(batcher, stops)
    assert plain.stopper.feed("a END b") == "a " and plain.stopper.stopped
    fallback = Batcher(fake_loaded(template_fallback=True), batcher.prefix_cache,
                       lambda job, e: None, lambda job, r, e: None, prefill_chunk=8)
    row = new_row(fallback, stops)
    assert row.stopper.feed(f"a {FALLBACK_STOPS[0]}") == "a " and row.stopper.stopped
    row = new_row(fallback, stops)
    assert row.stopper.feed("a END") == "a " and row.stopper.stopped


def test_the_batcher_knows_its_stop_tokens_and_room() -> None:
    from engine.core.schedule import MAX_BATCH

    batcher = decisions(streaming=3)
    assert batcher.vocab.eos_ids == {2, 3}
    assert batcher.room == MAX_BATCH - 3
    assert batcher.prefill_chunk == 256 and batcher.interleave and batcher.beside
    from engine.core.schedule import CPU_PREFILL_CHUNK

    assert decisions(prefill_chunk=0).prefill_chunk == CPU_PREFILL_CHUNK  # the device's own


@pytest.mark.parametrize("penalty", [5.0, 2.0])
def test_batched_rows_apply_the_repetition_penalty_to_their_own_tokens(
        engine: Engine, sharp_model_dir: Path, penalty: float) -> None:
    """Each row's penalty covers its own prompt and reply: checked against a plain forward over
    the whole sequence per token (tests/support/reference.py), not the engine."""
    from engine.runtimes.torch.loader import load_model
    from tests.support.reference import reference_greedy

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                            repetition_penalty=penalty)
    requests = [ask(p, params) for p in PROMPTS[1:3]]
    results = [h.wait(60) for h in [engine.submit(r) for r in requests]]
    loaded = load_model(str(sharp_model_dir))
    for result in results:
        assert result.token_ids == reference_greedy(loaded, result.prompt_token_ids, 16,
                                                    penalty)
    plain = [reference_greedy(loaded, r.prompt_token_ids, 16) for r in results]
    assert plain != [r.token_ids for r in results]  # the penalty changed a reply


def test_a_long_prompt_is_read_beside_streaming_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The schedule of a joining prompt: beside the rows (a side thread) only when rows stream,
    both beside and interleave are on, and its uncached part is long enough; else between."""
    from engine.core.reply import DetachedJob
    from engine.runtimes.torch import batching
    from tests.support.prefix_cache import feed

    asked: list[int] = []
    monkeypatch.setattr(batching, "can_prefill_beside",
                        lambda loaded, n: asked.append(n) is None and n >= 10)

    def path(prompt: int, cached: int = 0, streaming: int = 1, **kw: Any) -> tuple[str, Any]:
        batcher = decisions(streaming=streaming, **kw)
        if cached:
            lease = batcher.prefix_cache.acquire("c", list(range(cached + 1)))
            feed(lease, list(range(cached)))
            batcher.prefix_cache.release(lease)
        taken: list[str] = []
        batcher._prefill_beside = lambda job, lease, ids: taken.append(f"beside {len(ids)}")
        batcher._prefill_between = lambda job, lease, ids: taken.append(f"between {len(ids)}")
        job = DetachedJob(GenerationRequest([], SamplingParams(max_tokens=4), conversation_id="c",
                                            prompt_token_ids=list(range(prompt))))
        row, logits = batcher._prefill(job)
        assert logits.numel() == 0 and job.timeline.first_logits_ns == 0  # Stop came first
        assert job.timeline.prefill_start_ns > 0
        return taken[0], row

    assert path(12)[0] == "beside 12"
    assert path(9)[0] == "between 9"
    assert path(14, cached=5)[0] == "between 9"  # only the uncached part counts
    assert asked[-1] == 9
    assert path(12, streaming=0)[0] == "between 12"  # nothing streams: every core to it
    assert path(12, beside=False)[0] == "between 12"
    assert path(12, interleave=False)[0] == "between 12"
    row = path(14, cached=5)[1]
    assert (row.prompt_ids, row.lease.cached_tokens, row.lease.miss_reason) == \
        (list(range(14)), 5, "none")


def test_a_joining_prompt_reports_its_prefill_and_first_logits() -> None:
    from engine.core.reply import DetachedJob

    batcher = decisions()
    events: list[Any] = []
    batcher._emit = lambda job, event: events.append(event)
    batcher._prefill_between = lambda job, lease, ids: torch.tensor([[0.5, 1.5]])
    job = DetachedJob(GenerationRequest([], SamplingParams(max_tokens=4), conversation_id="c",
                                        prompt_token_ids=[1, 2, 3], reuse_cache=False))
    row, logits = batcher._prefill(job)
    assert logits.tolist() == [0.5, 1.5]
    assert job.timeline.first_logits_ns >= job.timeline.prefill_start_ns > 0
    started = events[0]
    assert isinstance(started, PrefillStarted)
    assert (started.request_id, started.t_ns, started.prompt_tokens, started.cached_tokens,
            started.cache_miss_reason) == (job.request.request_id, job.timeline.prefill_start_ns,
                                           3, 0, "disabled")
    assert row.lease.miss_reason == "disabled"


def test_chunks_alternate_with_decode_steps_while_rows_stream(tiny_model_dir: Path) -> None:
    """A 70-token prompt beside one streaming row, at a budget of 33: chunks of 32 (32, 32, 6 fed)
    with a decode step between two chunks (none after the last); alone: one chunk."""
    from engine.core.reply import DetachedJob
    from engine.runtimes.torch.batching import Batcher
    from engine.runtimes.torch.loader import load_model
    from engine.runtimes.torch.prefix_cache import PrefixCache

    loaded = load_model(str(tiny_model_dir))
    ids = list(range(3, 73))

    def prefill(streaming: int, **kw: Any) -> tuple[list[int], int, Any]:
        pool = PrefixCache(loaded.model.config, 1 << 30)
        batcher = Batcher(loaded, pool, lambda job, e: None, lambda job, r, e: None,
                          prefill_chunk=128, **kw)
        batcher.rows = [object()] * streaming
        lease = pool.cold_lease("c")
        chunks: list[int] = []
        steps: list[int] = []

        def step() -> None:
            steps.append(len(lease.ids))
            batcher._decode_step_s = 1e3  # a slow decode step: the next chunks may grow

        batcher.step = step
        real_step = batcher._chunk_tokens
        batcher._chunk_tokens = lambda: chunks.append(real_step()) or chunks[-1]
        logits = batcher._prefill_between(DetachedJob(ask("x")), lease, ids)
        assert lease.ids == ids and logits is not None and logits.shape[0] == 1
        return chunks, batcher.step_token_budget, steps

    chunks, budget, steps = prefill(1, step_token_budget=33)
    assert (chunks, steps, budget) == ([32, 32, 32], [32, 64], 33)
    chunks, budget, steps = prefill(1)  # adaptive: after a slow step, chunks grow to the cap
    assert (chunks[0], steps[0], budget) == (32, 32, 128 + 1)
    assert prefill(0)[0] == [128] and prefill(0)[2] == []
    assert prefill(1, interleave=False)[0:3:2] == ([128], [])


def test_a_cancelled_job_reads_no_more_of_its_prompt(tiny_model_dir: Path) -> None:
    from engine.core.reply import DetachedJob
    from engine.runtimes.torch.batching import Batcher
    from engine.runtimes.torch.loader import load_model
    from engine.runtimes.torch.prefix_cache import PrefixCache

    loaded = load_model(str(tiny_model_dir))
    pool = PrefixCache(loaded.model.config, 1 << 30)
    batcher = Batcher(loaded, pool, lambda job, e: None, lambda job, r, e: None, prefill_chunk=8)
    job = DetachedJob(ask("x"))
    job.cancel.set()
    lease = pool.cold_lease("c")
    assert batcher._prefill_between(job, lease, list(range(3, 20))) is None
    assert lease.ids == []


def test_how_a_row_decides_its_reply_ends() -> None:
    """One token per step: Stop before any token means nothing is sampled; an EOS token ends
    the reply ("stop") unless EOS is ignored; the budget ends it ("length"); Stop after a token
    keeps that token ("cancelled")."""
    import dataclasses
    from types import SimpleNamespace

    from engine import SamplerSnapshot
    from engine.core.prompt import PreparedPrompt
    from engine.core.reply import DetachedJob, Reply

    batcher = decisions()
    tokenizer = SimpleNamespace(
        eos_token_id=2, decode=lambda ids, skip_special_tokens=True: "".join(f"<{i}>" for i in ids))
    vocab = dataclasses.replace(batcher.vocab, tokenizer=tokenizer)
    events: list[Any] = []

    def row(budget: int = 8, **params: Any) -> Any:
        request = ask("x", SamplingParams(temperature=0.0, **params))
        r = Reply(DetachedJob(request), PreparedPrompt([5, 6, 7]),
                  batcher.prefix_cache.cold_lease("c"), vocab, batcher.loaded.info, events.append)
        r.budget = budget
        return r

    def favour(token: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(token), 10).float()

    stopped = row()
    stopped.job.cancel.set()
    stopped.take(favour(4))
    assert (stopped.generated, stopped.finish, events) == ([], "cancelled", [])
    empty = row()
    empty.take(torch.empty(0))
    assert (empty.generated, empty.finish, events) == ([], "cancelled", [])

    plain = row(budget=3)
    for token, finish in ((4, None), (8, None), (9, "length")):
        plain.take(favour(token))
        assert plain.finish == finish
    assert plain.generated == [4, 8, 9]
    emitted = [e for e in events if isinstance(e, TokenEmitted)]
    assert [(e.index, e.token_id, e.text) for e in emitted] == [(0, 4, "<4>"), (1, 8, "<8>"),
                                                                 (2, 9, "<9>")]
    snaps = [e for e in events if isinstance(e, SamplerSnapshot)]
    assert snaps[0].index == 0 and snaps[0].chosen_id == 4  # the first token's, always

    eos = row(budget=1)
    eos.take(favour(3))  # 3 is an EOS id (and the budget is reached)
    assert (eos.generated, eos.finish) == ([3], "stop")
    ignored = row(ignore_eos=True)
    ignored.take(favour(2))
    assert ignored.finish is None

    late = row()
    late.take(favour(4))
    late.job.cancel.set()
    late.take(favour(5))
    assert (late.generated, late.finish) == ([4, 5], "cancelled")

    penalised = row(repetition_penalty=4.0)
    penalised.take(torch.tensor([0.0, 0, 0, 0, 0, 3.0, 0, 0, 1.0, 0]))
    assert penalised.generated == [8]  # 5 is in the prompt: 3.0 / 4 < 1.0
