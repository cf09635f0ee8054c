"""Behaviours the two runtimes' copies of the loop had drifted apart on, now written once in the
core (engine/core/): each test is one drift the issue found, on the torch runtime in-process
(llama.cpp runs the same core code; its own checks are in tests/test_llamacpp_*.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from engine import GenerationRequest, PrefillStarted, SamplingParams, TokenEmitted
from engine.core.reply import DetachedJob
from engine.metrics import RequestTimeline, now_ns
from engine.runtimes.torch.batching import Batcher
from engine.runtimes.torch.draft import load_draft
from engine.runtimes.torch.generate import DecodeSession
from engine.runtimes.torch.loader import LoadedModel, load_model
from engine.runtimes.torch.prefix_cache import PrefixCache
from engine.tools.bench import fixed_prompt_ids


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir))


def pool_for(loaded: LoadedModel) -> PrefixCache:
    return PrefixCache(loaded.model.config, budget_bytes=1 << 30)


def request(loaded: LoadedModel, max_tokens: int = 24, conversation: str = "c",
            **kw: Any) -> GenerationRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return GenerationRequest([], params, conversation_id=conversation,
                             prompt_token_ids=fixed_prompt_ids(loaded, 12), **kw)


def test_stop_while_the_draft_proposes_ends_the_reply_before_verifying(
        tiny: LoadedModel, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop pressed while the draft model proposes: no verification forward runs and no token
    comes after it (it was honoured on llama.cpp only)."""
    draft = load_draft(str(tiny_model_dir), tiny, kernel="fp32-eager")
    cancel = threading.Event()
    events: list[Any] = []
    proposals: list[int] = []
    real_propose = draft.propose

    def propose(*args: Any, **kwargs: Any) -> list[int]:
        drafted = real_propose(*args, **kwargs)
        proposals.append(sum(isinstance(e, TokenEmitted) for e in events))
        if len(proposals) == 2:
            cancel.set()  # the user presses Stop while the draft model runs
        return drafted

    monkeypatch.setattr(draft, "propose", propose)
    pool = pool_for(tiny)
    result = DecodeSession(tiny, pool, draft=draft).run(
        request(tiny, speculative="draft"), RequestTimeline(now_ns()), cancel, events.append)
    assert result.finish_reason == "cancelled" and len(proposals) == 2
    assert len(result.token_ids) == proposals[1]  # nothing verified after the Stop
    assert pool._entries["c"].ids == result.prompt_token_ids + result.token_ids[:-1]


def test_a_failed_reply_discards_its_lease_alone_and_in_a_batch(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward that fails mid-reply: the lease's cache goes, nothing stays leased, and the
    chat's next turn says "evicted" (torch left it leased; llama.cpp discarded it)."""
    boom = RuntimeError("device lost")
    forward = tiny.model.forward
    calls = 0

    def failing(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:  # a decode step, after the prefill and one step
            raise boom
        return forward(*args, **kwargs)

    pool = pool_for(tiny)
    monkeypatch.setattr(tiny.model, "forward", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        DecodeSession(tiny, pool).run(request(tiny), RequestTimeline(now_ns()),
                                      threading.Event(), lambda event: None)
    calls = 0
    failures: list[tuple[Any, BaseException | None]] = []
    batcher = Batcher(tiny, pool, lambda job, event: None,
                      lambda job, result, error: failures.append((job, error)))
    job = DetachedJob(request(tiny, conversation="b"))
    batcher.admit([job])
    while batcher.rows:
        batcher.step()
    monkeypatch.setattr(tiny.model, "forward", forward)
    assert failures == [(job, boom)]
    assert pool.conversations() == [] and not pool._leased
    for conversation in ("c", "b"):
        lease = pool.acquire(conversation, fixed_prompt_ids(tiny, 12))
        assert (lease.cached_tokens, lease.miss_reason) == (0, "evicted")
        pool.release(lease)


def test_one_failing_alternative_leaves_the_others(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three alternatives of one prompt; making the second fails: it alone reports the error,
    the others finish (torch stranded the whole batch)."""
    from engine.runtimes.torch import batching

    real_sibling = batching.sibling_reply

    def sibling(job: Any, *args: Any, **kwargs: Any) -> Any:
        if job.request.request_id == "alt1":
            raise RuntimeError("no room for this one")
        return real_sibling(job, *args, **kwargs)

    monkeypatch.setattr(batching, "sibling_reply", sibling)
    outcomes: dict[str, Any] = {}
    started: list[Any] = []
    batcher = Batcher(tiny, pool_for(tiny),
                      lambda job, event: started.append((job.request.request_id, event))
                      if isinstance(event, PrefillStarted) else None,
                      lambda job, result, error: outcomes.update(
                          {job.request.request_id: result or error}))
    base = request(tiny, max_tokens=6)
    alternatives = [GenerationRequest([], SamplingParams(temperature=1.0, seed=i, max_tokens=6,
                                                         ignore_eos=True),
                                      conversation_id="c", prompt_token_ids=base.prompt_token_ids,
                                      request_id=f"alt{i}") for i in range(3)]
    batcher.admit([DetachedJob(r) for r in alternatives])
    while batcher.rows:
        batcher.step()
    assert isinstance(outcomes["alt1"], RuntimeError)
    for ok in ("alt0", "alt2"):
        assert outcomes[ok].finish_reason == "length" and len(outcomes[ok].token_ids) == 6
    prompt = len(base.prompt_token_ids or ())
    # the first reads the prompt; the other's prefill is the first's: every token cached
    assert [(rid, e.request_id, e.prompt_tokens, e.cached_tokens, e.cache_miss_reason)
            for rid, e in started] == [("alt0", "alt0", prompt, 0, "first_turn"),
                                       ("alt2", "alt2", prompt, prompt, "none")]
    assert outcomes["alt2"].metrics.cached_tokens == prompt


def test_a_draft_reads_the_prompt_during_the_prefill(tiny: LoadedModel,
                                                     tiny_model_dir: Path) -> None:
    """The draft model's share of the prompt counts as prefill on both runtimes: when the first
    token comes, the draft already holds the prompt (torch fed it in its first proposal)."""
    draft = load_draft(str(tiny_model_dir), tiny, kernel="fp32-eager")
    held: list[int] = []

    def on_event(event: Any) -> None:
        if isinstance(event, TokenEmitted) and event.index == 0:
            held.append(len(draft.ids))

    prompt = request(tiny, max_tokens=4, speculative="draft")
    DecodeSession(tiny, pool_for(tiny), draft=draft).run(
        prompt, RequestTimeline(now_ns()), threading.Event(), on_event)
    assert held == [len(prompt.prompt_token_ids or ())]


def test_both_runtimes_size_side_prefill_chunks_by_one_rule() -> None:
    """The side prefill's chunk rule is the schedule's, the same for both runtimes (they had
    0.5 s and 0.4 s targets and different first chunks): the last chunk's rate times the
    target, within the floor and the runtime's largest chunk; an untimed chunk gives the floor."""
    from engine.core import schedule

    target, floor = schedule.SIDE_CHUNK_S, schedule.MIN_SIDE_CHUNK
    assert schedule.next_side_chunk(500, 1.0, 4096) == round(500 * target)
    assert schedule.next_side_chunk(500, 2.0, 4096) == round(250 * target)  # the rate: 250/s
    assert schedule.next_side_chunk(500, 1.0, 100) == 100
    assert schedule.next_side_chunk(10, 10.0, 4096) == floor
    assert schedule.next_side_chunk(500, 0.0, 4096) == floor
    assert floor <= schedule.FIRST_SIDE_CHUNK


def test_stop_while_the_draft_reads_the_prompt_ends_the_reply_with_no_token(
        tiny: LoadedModel, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop lands while the draft model reads the prompt (after the target's prefill): the
    reply ends cancelled with no token, and the target's cache keeps the prompt it read."""
    draft = load_draft(str(tiny_model_dir), tiny, kernel="fp32-eager")
    cancel = threading.Event()

    def prefill(prompt_ids: Any, stop: threading.Event) -> bool:
        cancel.set()
        return False

    monkeypatch.setattr(draft, "prefill", prefill)
    events: list[Any] = []
    pool = pool_for(tiny)
    result = DecodeSession(tiny, pool, draft=draft).run(
        request(tiny, speculative="draft"), RequestTimeline(now_ns()), cancel, events.append)
    assert (result.finish_reason, result.token_ids) == ("cancelled", [])
    assert not [e for e in events if isinstance(e, TokenEmitted)]
    assert pool._entries["c"].ids == result.prompt_token_ids


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_stop_as_the_prefill_ends_takes_no_token(tiny: LoadedModel, speculative: Any) -> None:
    """Stop lands just as the prompt's last chunk returns its logits (too late for the prefill
    to see it): the reply takes no token and ends cancelled, plain or speculative, and the
    cache keeps the prompt it read."""
    cancel = threading.Event()
    session = DecodeSession(tiny, pool_for(tiny))
    read = session.runner.prefill

    def prefill(reply: Any, ids: list[int]) -> Any:
        logits = read(reply, ids)
        cancel.set()
        return logits

    session.runner.prefill = prefill  # type: ignore[method-assign]  # Stop, just too late
    events: list[Any] = []
    result = session.run(request(tiny, speculative=speculative), RequestTimeline(now_ns()),
                         cancel, events.append)
    assert (result.finish_reason, result.token_ids) == ("cancelled", [])
    assert not [e for e in events if isinstance(e, TokenEmitted)]
    assert session.cache._entries["c"].ids == result.prompt_token_ids


def test_a_prompt_that_fails_to_read_in_a_batch_discards_its_lease(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch's prefill fails: the request reports that error (not another one from the
    clean-up), its lease is discarded, and the chat's next turn says "evicted"."""
    boom = RuntimeError("device lost")

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise boom

    pool = pool_for(tiny)
    failures: list[tuple[Any, BaseException | None]] = []
    batcher = Batcher(tiny, pool, lambda job, event: None,
                      lambda job, result, error: failures.append((job, error)))
    job = DetachedJob(request(tiny, conversation="p"))
    monkeypatch.setattr(tiny.model, "forward", failing)
    batcher.admit([job])
    monkeypatch.undo()
    assert failures == [(job, boom)] and not batcher.rows and not pool._leased
    lease = pool.acquire("p", fixed_prompt_ids(tiny, 12))
    assert (lease.cached_tokens, lease.miss_reason) == (0, "evicted")
