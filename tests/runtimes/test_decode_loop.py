"""The decode loop (engine.runtimes.torch.generate.DecodeSession, ChunkedPrefill) on the tiny model,
its outcomes checked against an independent reference: a plain forward over the whole sequence for
every token, no cache. Written for mutation testing (`make mutation`)."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import (
    GenerationRequest,
    PrefillProgress,
    PrefillStarted,
    SamplerSnapshot,
    SamplingParams,
    TextFlushed,
    TokenEmitted,
)
from engine.metrics import RequestTimeline, now_ns
from engine.runtimes.torch.generate import ChunkedPrefill, DecodeSession
from engine.runtimes.torch.loader import LoadedModel, load_model
from engine.runtimes.torch.prefix_cache import PrefixCache
from engine.tools.bench import fixed_prompt_ids
from tests.support.reference import reference_greedy


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir))


def decode(loaded: LoadedModel, request: GenerationRequest, pool: PrefixCache | None = None,
           cancel: threading.Event | None = None, session: DecodeSession | None = None,
           ) -> tuple[Any, list[Any], RequestTimeline]:
    pool = pool or PrefixCache(loaded.model.config, budget_bytes=1 << 30)
    session = session or DecodeSession(loaded, pool)
    events: list[Any] = []
    timeline = RequestTimeline(submitted_ns=now_ns())
    result = session.run(request, timeline, cancel or threading.Event(), events.append)
    return result, events, timeline


def prompt_request(loaded: LoadedModel, n: int = 16, **params: Any) -> GenerationRequest:
    return GenerationRequest([], SamplingParams(**params), conversation_id="c",
                             prompt_token_ids=fixed_prompt_ids(loaded, n))


def test_greedy_tokens_are_the_reference_and_stop_at_max_tokens(tiny: LoadedModel) -> None:
    request = prompt_request(tiny, temperature=0.0, max_tokens=5, ignore_eos=True)
    pool = PrefixCache(tiny.model.config, budget_bytes=1 << 30)
    result, events, timeline = decode(tiny, request, pool)
    prompt = list(request.prompt_token_ids or [])
    assert result.token_ids == reference_greedy(tiny, prompt, 5)
    assert result.finish_reason == "length"
    tokens = [e for e in events if isinstance(e, TokenEmitted)]
    assert [(e.index, e.token_id) for e in tokens] == list(enumerate(result.token_ids))
    assert timeline.token_ns == [e.t_ns for e in tokens]
    assert timeline.prefill_start_ns <= timeline.first_logits_ns <= timeline.token_ns[0]
    assert timeline.token_ns[-1] <= timeline.done_ns
    assert result.metrics.output_tokens == 5 and result.metrics.prompt_tokens == 16
    # what the chat view, the HUD and `ask --json` read off the result
    assert (result.request_id, result.model) == (request.request_id, tiny.info)
    assert result.speculative is None and result.spec_proposed == result.spec_accepted == 0
    # the cache keeps the prompt and every token fed back: all but the last one
    entry = pool._entries["c"]
    assert entry.ids == prompt + result.token_ids[:-1]
    assert entry.cache.get_seq_length() == 16 + 4


def test_the_repetition_penalty_covers_prompt_and_reply(tiny: LoadedModel) -> None:
    prompt = fixed_prompt_ids(tiny, 16)
    plain = reference_greedy(tiny, prompt, 6)
    penalised = reference_greedy(tiny, prompt, 6, penalty=3.0)
    assert penalised != plain  # the penalty matters on this model and prompt
    request = prompt_request(tiny, temperature=0.0, max_tokens=6, ignore_eos=True,
                             repetition_penalty=3.0)
    assert decode(tiny, request)[0].token_ids == penalised


def test_a_reply_ends_at_an_eos_token_unless_told_to_ignore_it(tiny: LoadedModel) -> None:
    pool = PrefixCache(tiny.model.config, budget_bytes=1 << 30)
    session = DecodeSession(tiny, pool)
    first = reference_greedy(tiny, fixed_prompt_ids(tiny, 16), 3, penalty=3.0)
    assert first[1] != first[0]
    # the reply's second token is this model's "EOS" here
    session.vocab = dataclasses.replace(session.vocab, eos_ids=frozenset({first[1]}))
    ends = decode(tiny, prompt_request(tiny, temperature=0.0, max_tokens=8,
                                       repetition_penalty=3.0), pool, session=session)[0]
    assert (ends.token_ids, ends.finish_reason) == (first[:2], "stop")
    assert ends.metrics.output_tokens == 2
    ignored = decode(tiny, prompt_request(tiny, temperature=0.0, max_tokens=3, ignore_eos=True,
                                         repetition_penalty=3.0), pool, session=session)[0]
    assert (ignored.token_ids, ignored.finish_reason) == (first, "length")


def test_stop_before_the_prefill_generates_nothing_and_keeps_nothing(tiny: LoadedModel) -> None:
    pool = PrefixCache(tiny.model.config, budget_bytes=1 << 30)
    cancel = threading.Event()
    cancel.set()
    result, events, timeline = decode(tiny, prompt_request(tiny, temperature=0.0), pool, cancel)
    assert (result.finish_reason, result.token_ids, result.text) == ("cancelled", [], "")
    assert [type(e) for e in events] == [PrefillStarted]
    assert timeline.first_logits_ns == 0 and timeline.token_ns == []
    m = result.metrics  # the prefill started (templating, the cache lookup), read nothing
    assert (m.output_tokens, m.prefilled_tokens, m.prefill_complete) == (0, 0, False)
    assert pool.conversations() == []


def test_stop_mid_reply_keeps_what_was_generated(tiny: LoadedModel) -> None:
    cancel = threading.Event()
    request = prompt_request(tiny, temperature=0.0, max_tokens=50, ignore_eos=True)
    pool = PrefixCache(tiny.model.config, budget_bytes=1 << 30)
    session = DecodeSession(tiny, pool)
    events: list[Any] = []

    def emit(event: Any) -> None:
        events.append(event)
        if isinstance(event, TokenEmitted) and event.index == 2:
            cancel.set()

    result = session.run(request, RequestTimeline(submitted_ns=now_ns()), cancel, emit)
    assert result.finish_reason == "cancelled"
    assert result.token_ids == reference_greedy(tiny, list(request.prompt_token_ids or []), 3)


def test_a_held_back_tail_is_flushed_when_the_reply_ends(tiny: LoadedModel) -> None:
    """A reply that ends in what could start a stop string: that text is held back while it
    streams, then flushed at the end (the reply ran out of tokens, no stop string came)."""
    whole = decode(tiny, prompt_request(tiny, temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert whole.text
    stop = whole.text[-1] + "\u2603\u2603"
    request = prompt_request(tiny, temperature=0.0, max_tokens=6, ignore_eos=True, stop=(stop,))
    result, events, _ = decode(tiny, request)
    assert (result.finish_reason, result.text) == ("length", whole.text)
    streamed = "".join(e.text for e in events if isinstance(e, TokenEmitted))
    flushed = [e.text for e in events if isinstance(e, TextFlushed)]
    assert flushed and flushed[-1].endswith(whole.text[-1])
    assert streamed + "".join(flushed) == whole.text
    last = next(e for e in reversed(events) if isinstance(e, TextFlushed))
    last_token = next(e for e in reversed(events) if isinstance(e, TokenEmitted))
    assert last.request_id == request.request_id  # the chat view files it under its reply
    assert last.t_ns >= last_token.t_ns  # stamped on the engine's clock, after the tokens


def test_the_first_token_gets_a_sampler_snapshot(tiny: LoadedModel) -> None:
    request = prompt_request(tiny, temperature=0.0, max_tokens=3, ignore_eos=True)
    result, events, _ = decode(tiny, request)
    snaps = [e for e in events if isinstance(e, SamplerSnapshot)]
    assert snaps and snaps[0].index == 0
    assert snaps[0].chosen_id == result.token_ids[0] == snaps[0].candidates[0][0]
    assert snaps[0].kept == 1
    for snap in snaps:
        assert snap.chosen_id == result.token_ids[snap.index]


@pytest.mark.parametrize("interval", ["none", "long"])
def test_sampler_snapshots_are_throttled_to_their_interval(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, interval: str) -> None:
    """The first token always has one; later ones once the interval has passed since the last:
    with none, every token (stamped when it was sampled); with a long one (as long as the
    monotonic clock has run), the first alone."""
    from engine.core import reply as reply_module

    interval_ns = 0 if interval == "none" else now_ns()
    monkeypatch.setattr(reply_module, "SNAPSHOT_INTERVAL_NS", interval_ns)
    request = prompt_request(tiny, temperature=0.0, max_tokens=5, ignore_eos=True)
    _, events, timeline = decode(tiny, request)
    snaps = [e for e in events if isinstance(e, SamplerSnapshot)]
    expected = range(5) if interval_ns == 0 else range(1)
    assert [s.index for s in snaps] == list(expected)
    assert all(timeline.first_logits_ns <= s.t_ns <= timeline.token_ns[s.index] for s in snaps)


def test_a_seeded_reply_repeats_and_another_seed_differs(tiny: LoadedModel) -> None:
    def sampled(seed: int) -> list[int]:
        request = prompt_request(tiny, temperature=1.5, max_tokens=12, ignore_eos=True,
                                 seed=seed)
        return decode(tiny, request)[0].token_ids

    assert sampled(3) == sampled(3)
    assert sampled(3) != sampled(4)


def test_chunked_prefill_reads_the_prompt_a_chunk_at_a_time(tiny: LoadedModel) -> None:
    prompt = fixed_prompt_ids(tiny, 5)
    pool = PrefixCache(tiny.model.config, budget_bytes=1 << 30)
    lease = pool.acquire("c", prompt)
    events: list[Any] = []
    prefill = ChunkedPrefill(tiny, lease, prompt, "r", events.append)
    with torch.inference_mode():
        steps = [prefill.step(2), prefill.step(0), prefill.step(2)]
        cold = tiny.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert steps[0] is None and steps[1] is None and steps[2] is not None
    assert prefill.done == 5 and prefill.finished
    assert lease.ids == prompt and lease.cache.get_seq_length() == 5
    assert steps[2].shape == (1, cold.shape[-1])
    assert torch.allclose(steps[2][0], cold, atol=1e-4)
    done = [e.done_tokens for e in events if isinstance(e, PrefillProgress)]
    assert done[-1] == 5 and {2, 3} <= set(done)  # after each chunk: 2, 3 (one token), 5


def test_chunked_prefill_stops_before_a_chunk_once_cancelled(tiny: LoadedModel) -> None:
    prompt = fixed_prompt_ids(tiny, 6)
    lease = PrefixCache(tiny.model.config, budget_bytes=1 << 30).acquire("c", prompt)
    prefill = ChunkedPrefill(tiny, lease, prompt, "r", lambda e: None)
    cancel = threading.Event()
    cancel.set()
    with torch.inference_mode():
        assert prefill.run(4, cancel) is None
        assert lease.ids == [] and prefill.done == 0
        cancel.clear()
        logits = prefill.run(4, cancel)
    assert logits is not None and lease.ids == prompt


def test_prefill_chunk_size_per_device_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.core.schedule import CPU_PREFILL_CHUNK, GPU_PREFILL_CHUNK, PREFILL_CHUNK_ENV
    from engine.runtimes.torch.generate import default_prefill_chunk

    monkeypatch.delenv(PREFILL_CHUNK_ENV, raising=False)
    assert default_prefill_chunk(torch.device("cpu")) == CPU_PREFILL_CHUNK == 256
    assert default_prefill_chunk(torch.device("cuda")) == GPU_PREFILL_CHUNK == 2048
    monkeypatch.setenv(PREFILL_CHUNK_ENV, "64")
    assert default_prefill_chunk(torch.device("cuda")) == 64
    for ignored in ("0", "-8", "big", ""):
        monkeypatch.setenv(PREFILL_CHUNK_ENV, ignored)
        assert default_prefill_chunk(torch.device("cpu")) == 256
    monkeypatch.setenv(PREFILL_CHUNK_ENV, "1")
    assert default_prefill_chunk(torch.device("cpu")) == 1


def test_a_taken_token_is_stamped_on_the_timeline(tiny: LoadedModel) -> None:
    from engine.core.ledger import CacheLease
    from engine.core.prompt import PreparedPrompt
    from engine.core.reply import DetachedJob, Reply
    from engine.runtimes.torch.generate import torch_vocabulary

    request = GenerationRequest([], SamplingParams(temperature=0.0, max_tokens=5),
                                prompt_token_ids=[1, 2, 3])
    timeline = RequestTimeline(submitted_ns=1, token_ns=[5, 9])
    events: list[Any] = []
    reply = Reply(DetachedJob(request, timeline), PreparedPrompt([1, 2, 3]),
                  CacheLease("c", [], None, 0, "none"), torch_vocabulary(tiny), tiny.info,
                  events.append)
    logits = torch.zeros(tiny.model.config.vocab_size)
    logits[42] = 1.0
    assert reply.take(logits) == 42 and reply.finish is None
    [event] = [e for e in events if isinstance(e, TokenEmitted)]
    assert (event.request_id, event.index, event.token_id) == (request.request_id, 2, 42)
    assert timeline.token_ns[:2] == [5, 9] and timeline.token_ns[2] == event.t_ns
    assert len(timeline.token_ns) == 3


def test_a_self_draft_is_accepted_whole_and_changes_nothing(tiny: LoadedModel,
                                                             tiny_model_dir: Path) -> None:
    """The model as its own draft: every proposal accepted, greedy and sampled; the reply is
    the plain one (greedy: the reference; sampled: the same seed again) and the cache mirrors
    prompt + reply minus its last token."""
    from engine.runtimes.torch.draft import load_draft

    draft = load_draft(str(tiny_model_dir), tiny, kernel="fp32-eager")
    prompt = fixed_prompt_ids(tiny, 12)
    for params in (SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
                   SamplingParams(temperature=1.0, seed=7, max_tokens=9, ignore_eos=True)):
        pool = PrefixCache(tiny.model.config, budget_bytes=1 << 30)
        request = GenerationRequest([], params, conversation_id="c", prompt_token_ids=prompt,
                                    speculative="draft")
        result, events, _ = decode(tiny, request, pool, session=DecodeSession(tiny, pool, draft))
        assert result.speculative == "draft" and result.finish_reason == "length"
        assert result.spec_accepted == result.spec_proposed > 0
        assert len(result.token_ids) == 9
        tokens = [e for e in events if isinstance(e, TokenEmitted)]
        assert [(e.index, e.token_id) for e in tokens] == list(enumerate(result.token_ids))
        entry = pool._entries["c"]
        assert entry.ids == prompt + result.token_ids[:-1]
        assert entry.cache.get_seq_length() == len(entry.ids)
        if params.greedy:
            assert result.token_ids == reference_greedy(tiny, prompt, 9)
        else:
            again = decode(tiny, request, session=DecodeSession(tiny, PrefixCache(
                tiny.model.config, budget_bytes=1 << 30), draft))[0]
            assert again.token_ids == result.token_ids
