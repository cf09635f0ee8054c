"""What every Backend promises its callers, as plain functions of a started, loaded backend.

tests/contract/test_backend_contract.py runs each check against every in-process backend. They are
plain functions (no fixtures) so a backend that must live in a child process (llama.cpp: native
code) can run the same checks there and report the outcome.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from engine import (
    ChatMessage,
    EngineEvent,
    GenerationRequest,
    GenerationResult,
    ModelLoaded,
    ModelLoadError,
    ModelLoadFailed,
    PrefillStarted,
    RequestFailed,
    RequestFinished,
    RequestQueued,
    SamplerSnapshot,
    SamplingParams,
    TextFlushed,
    TokenEmitted,
)
from engine.events import TERMINAL_EVENTS
from engine.params import Speculative
from engine.protocol import Backend, RequestHandle
from engine.remote import REMOTE_SPEC

WAIT_S = 120.0
TINY = {"kernel": "fp32-eager"}  # the same decode path every run, no timing probe

# Backend ids -> (spec, options) of a load that must fail on it.
BAD_LOADS: dict[str, tuple[str, dict[str, Any]]] = {
    "engine": ("/no/such/model-folder", {}),
    "router": (REMOTE_SPEC, {"base_url": "http://127.0.0.1:9/v1"}),  # nothing listens there
    "remote": (REMOTE_SPEC, {"model": "no-such-model"}),  # the server does not have it
}
PROMPT = "Tell me a short story about a lighthouse keeper and a storm."
# A reply that copies from its prompt: prompt lookup ("ngram") finds drafts in it.
COPY_PROMPT = ("Copy this list exactly, then stop: apples, pears, plums, apples, pears, plums, "
               "apples, pears, plums.")


def request(text: str = PROMPT, *, max_tokens: int = 8, temperature: float = 0.0,
            seed: int | None = None, conversation_id: str | None = None) -> GenerationRequest:
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    return GenerationRequest([ChatMessage("user", text)], params,
                             conversation_id=conversation_id)


class Recorder:
    """A listener that keeps every event of the requests it is told about, in order."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.events: list[EngineEvent] = []
        self._lock = threading.Lock()

    def __call__(self, event: EngineEvent) -> None:
        with self._lock:
            self.events.append(event)

    def of(self, request_id: str) -> list[EngineEvent]:
        with self._lock:
            return [e for e in self.events if getattr(e, "request_id", None) == request_id]

    def of_type(self, kind: type) -> list[EngineEvent]:
        with self._lock:
            return [e for e in self.events if isinstance(e, kind)]


@contextmanager
def recording(backend: Backend) -> Iterator[Recorder]:
    recorder = Recorder(backend)
    backend.add_listener(recorder)
    try:
        yield recorder
    finally:
        backend.remove_listener(recorder)


def drain(handle: RequestHandle) -> list[EngineEvent]:
    """Every event of a request, from its handle, until it ends."""
    return list(handle.events(timeout=WAIT_S))


# ----- the checks ---------------------------------------------------------------------------------
def check_event_order(backend: Backend) -> GenerationResult:
    """Queued, prefill start, tokens, then exactly one RequestFinished, last; stamps never go
    back; listeners see exactly what the handle sees."""
    with recording(backend) as seen:
        handle = backend.submit(request(conversation_id="contract-order"))
        events = drain(handle)
        result = handle.wait(WAIT_S)
    kinds = [type(e) for e in events]
    assert kinds[0] is RequestQueued, kinds
    assert kinds[1] is PrefillStarted, kinds
    assert kinds[-1] is RequestFinished, kinds
    assert sum(k in TERMINAL_EVENTS for k in kinds) == 1, kinds
    assert TokenEmitted in kinds
    stamps = [e.t_ns for e in events if isinstance(e, (RequestQueued, PrefillStarted,
                                                       TokenEmitted, RequestFinished))]
    assert stamps == sorted(stamps)
    assert seen.of(handle.request_id) == events
    assert result.text == "".join(e.text for e in events
                                  if isinstance(e, (TokenEmitted, TextFlushed)))
    return result


def check_metric_identities(backend: Backend) -> None:
    """prompt = cached + prefilled (a whole prefill: only a Stop inside it reads fewer); one
    ITL gap between consecutive emitted tokens; queue + prefill <= TTFT <= e2e; a second turn
    on the same prefix reports it cached."""
    first = request(conversation_id="contract-metrics")
    handle = backend.submit(first)
    events = drain(handle)
    m = handle.wait(WAIT_S).metrics
    tokens = [e for e in events if isinstance(e, TokenEmitted)]
    assert m.output_tokens >= len(tokens) >= 1  # a server may pack tokens into a chunk
    if not backend.is_remote:
        assert m.output_tokens == len(tokens)
    assert len(m.itl_s) == len(tokens) - 1
    assert 0 <= m.queue_s + m.prefill_s <= m.ttft_s + 1e-9  # float sums of ns stamps
    assert m.ttft_s <= m.e2e_s
    assert m.prompt_tokens_known
    assert m.prompt_tokens == m.cached_tokens + m.prefilled_tokens and m.prefill_complete
    assert m.prompt_tokens > 0
    # the next turn extends the same chat: a backend with a prefix cache reuses it
    reply = handle.wait(WAIT_S).text
    follow = GenerationRequest(
        [*first.messages, ChatMessage("assistant", reply), ChatMessage("user", "And then?")],
        first.params, conversation_id="contract-metrics")
    second = backend.submit(follow)
    m2 = second.wait(WAIT_S).metrics
    assert m2.prompt_tokens == m2.cached_tokens + m2.prefilled_tokens
    if backend.capabilities.prefix_cache_ledger:
        assert m2.cached_tokens > 0
        assert m2.prefilled_tokens < m2.prompt_tokens


def check_cancel(backend: Backend) -> None:
    """Cancelling after the first token ends the request as cancelled, keeping its text: the
    result holds exactly what was streamed (tokens and text), and stopped short."""
    budget = 200
    handle = backend.submit(request(max_tokens=budget, conversation_id="contract-cancel"))
    events = handle.events(timeout=WAIT_S)
    seen: list[EngineEvent] = []
    for event in events:
        seen.append(event)
        if isinstance(event, TokenEmitted):
            backend.cancel(handle.request_id)
            break
    seen += list(events)
    assert isinstance(seen[-1], RequestFinished), seen[-1:]
    result = handle.wait(WAIT_S)
    assert result.finish_reason == "cancelled"
    tokens = [e for e in seen if isinstance(e, TokenEmitted)]
    streamed = "".join(e.text for e in seen if isinstance(e, (TokenEmitted, TextFlushed)))
    assert result.text == streamed and result.text, (result.text, streamed)
    assert 1 <= len(tokens) <= result.metrics.output_tokens < budget
    if not backend.is_remote:  # a server may pack tokens into a chunk, and names no ids
        assert result.token_ids == [e.token_id for e in tokens]
        assert result.metrics.output_tokens == len(tokens)


def check_bad_input(backend: Backend) -> None:
    """An invalid request fails with one line (and only fails); the backend serves on."""
    bad = GenerationRequest([ChatMessage("user", "hi")],
                            SamplingParams(temperature=-1.0, max_tokens=4))
    handle = backend.submit(bad)
    events = drain(handle)
    assert isinstance(events[-1], RequestFailed)
    assert not any(isinstance(e, RequestFinished) for e in events)
    message = events[-1].message
    assert message and "\n" not in message and "temperature" in message
    assert backend.submit(request(max_tokens=2)).wait(WAIT_S).metrics.output_tokens >= 1


def check_alternatives(backend: Backend) -> None:
    """N alternatives: ids {id}.{i}, each finishes; where the backend says they share one
    prefill, one PrefillStarted time for all and only the first computes the prompt."""
    base = request(max_tokens=6, temperature=0.9, seed=7, conversation_id="contract-alts")
    with recording(backend) as seen:
        handles = backend.submit_alternatives(base, 3)
        results = [h.wait(WAIT_S) for h in handles]
    assert [h.request_id for h in handles] == [f"{base.request_id}.{i}" for i in range(3)]
    assert all(r.finish_reason in ("stop", "length") for r in results)
    prefills = [e for h in handles for e in seen.of(h.request_id)
                if isinstance(e, PrefillStarted)]
    assert len(prefills) == 3
    if backend.capabilities.shared_prefill_alternatives:
        assert len({p.t_ns for p in prefills}) == 1
        computed = [p.prompt_tokens - p.cached_tokens for p in prefills]
        assert computed[0] > 0 and computed[1:] == [0, 0]
        assert len({r.metrics.prefill_s for r in results}) == 1
    backend.keep_alternative("contract-alts", 1, 3)  # accepted by every backend


def check_failed_load_keeps_model(backend: Backend, bad_spec: str,
                                  **bad_options: object) -> None:
    """A load that fails raises ModelLoadError (one line), broadcasts ModelLoadFailed, and the
    old model stays: same model_info, requests still run on it."""
    before = backend.model_info
    assert before is not None
    with recording(backend) as seen:
        try:
            backend.load_model_sync(bad_spec, timeout=WAIT_S, **bad_options)
        except ModelLoadError as exc:
            assert str(exc) and "\n" not in str(exc)
        else:
            raise AssertionError(f"loading {bad_spec!r} {bad_options} did not fail")
    assert seen.of_type(ModelLoadFailed)
    assert not seen.of_type(ModelLoaded)
    assert backend.model_info == before
    result = backend.submit(request(max_tokens=2)).wait(WAIT_S)
    assert result.model == before


def check_capabilities(backend: Backend, draft: str | None = None,
                       **draft_options: object) -> None:
    """What a backend says it can do, it does: each speculative method it lists runs and
    keeps greedy output unchanged, a draft model (`draft`, loaded with draft_options) loads
    where it says so and is refused where not, and sampler views come iff it says so."""
    caps = backend.capabilities
    assert caps.draft_model == ("draft" in caps.speculative)
    with recording(backend) as seen:
        plain = backend.submit(request(COPY_PROMPT, max_tokens=16, conversation_id="contract-caps"))
        result = plain.wait(WAIT_S)
    snapshots = [e for e in seen.of(plain.request_id) if isinstance(e, SamplerSnapshot)]
    assert bool(snapshots) == caps.sampler_view, snapshots[:1]
    if "ngram" in caps.speculative:
        _check_speculates_exactly(backend, "ngram", result)
    if not caps.draft_model:
        try:
            backend.load_draft_sync(draft or "any-draft", timeout=WAIT_S, **draft_options)
        except ModelLoadError as exc:
            assert str(exc) and "\n" not in str(exc)
        else:
            raise AssertionError("a backend without draft models loaded one")
        return
    assert draft is not None, "a backend with draft models is checked with one"
    backend.load_draft_sync(draft, timeout=WAIT_S, **draft_options)
    try:
        _check_speculates_exactly(backend, "draft", result)
    finally:
        backend.load_draft_sync(None, timeout=WAIT_S)
    dropped = backend.submit(dataclasses.replace(request(max_tokens=4), speculative="draft"))
    events = drain(dropped)
    assert isinstance(events[-1], RequestFailed) and "draft" in events[-1].message, events[-1:]


def _check_speculates_exactly(backend: Backend, method: Speculative,
                              plain: GenerationResult) -> None:
    """A greedy request with this method runs it and gives the plain reply's tokens."""
    spec = dataclasses.replace(
        request(COPY_PROMPT, max_tokens=16, conversation_id=f"contract-{method}"),
        speculative=method)
    result = backend.submit(spec).wait(WAIT_S)
    assert result.speculative == method, (method, result.speculative)
    assert result.spec_proposed > 0
    assert result.token_ids == plain.token_ids
    assert result.text == plain.text
