"""Synthetic engine event sequences for the HUD tests (and the README screenshot).

Stamps are made up but consistent: metrics come from engine.metrics.compute_metrics over the
same timeline the events carry, exactly as the engine builds them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from engine.events import (
    EngineEvent,
    GenerationResult,
    ModelInfo,
    ModelLoaded,
    PrefillStarted,
    RequestFinished,
    RequestQueued,
    SamplerSnapshot,
    TokenEmitted,
)
from engine.metrics import RequestTimeline, compute_metrics

MS = 1_000_000
INFO = ModelInfo(
    name="SmolLM2-135M-Instruct", source="default", path="/models/smollm2", device="cpu",
    dtype="float32", context_length=8192, parameters=134_515_008,
    weight_bytes_per_step=538_060_032, kernel="fp32-eager",
)
WORDS = [" The", " capital", " of", " France", " is", " Paris", ".", " It", " is", " known",
         " for", " the", " Eiffel", " Tower", ",", " art", " and", " food", "."]


@dataclass
class ReplySpec:
    request_id: str
    start_ns: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    queue_ms: float = 1.0
    prefill_ms_per_token: float = 3.0
    itl_ms: float = 34.0
    miss_reason: str = "first_turn"
    temperature: float = 0.7
    top_p: float = 0.9


def reply_events(spec: ReplySpec, *, jitter: bool = True) -> list[EngineEvent]:
    """Queued -> prefill -> tokens (with snapshots every 5th token) -> finished."""
    t = spec.start_ns
    tl = RequestTimeline(submitted_ns=t)
    events: list[EngineEvent] = [RequestQueued(spec.request_id, t)]
    t += int(spec.queue_ms * MS)
    tl.prefill_start_ns = t
    events.append(PrefillStarted(spec.request_id, t, spec.prompt_tokens, spec.cached_tokens,
                                 spec.miss_reason))
    t += int((spec.prompt_tokens - spec.cached_tokens) * spec.prefill_ms_per_token * MS)
    tl.first_logits_ns = t
    for i in range(spec.output_tokens):
        if i:
            wobble = ((i * 37) % 11 - 5) / 60 if jitter else 0.0
            t += int(spec.itl_ms * (1 + wobble) * MS)
        else:
            t += MS // 2  # sampling the first token
        word = WORDS[i % len(WORDS)]
        if i % 5 == 0:
            events.append(snapshot(spec, t, i, word))
        tl.token_ns.append(t)
        events.append(TokenEmitted(spec.request_id, t, i, 100 + i % len(WORDS), word))
    t += MS
    tl.done_ns = t
    metrics = compute_metrics(tl, prompt_tokens=spec.prompt_tokens,
                              cached_tokens=spec.cached_tokens, parameters=INFO.parameters,
                              weight_bytes_per_step=INFO.weight_bytes_per_step,
                              cache_miss_reason=spec.miss_reason)
    result = GenerationResult(spec.request_id, "".join(WORDS), "stop",
                              [100 + i % len(WORDS) for i in range(spec.output_tokens)],
                              list(range(spec.prompt_tokens)), metrics, INFO)
    events.append(RequestFinished(spec.request_id, t, result))
    return events


@dataclass(frozen=True)
class Stamped:
    """A reply's numbers worked out from its events' stamps alone (design.md's definitions),
    independent of engine.metrics and of the HUD's own folding."""

    itl_s: list[float]
    queue_s: float
    ttft_s: float
    decode_s: float
    e2e_s: float | None  # None while the reply runs
    output_tokens: int


def from_stamps(events: list[EngineEvent]) -> Stamped:
    queued = next(e.t_ns for e in events if isinstance(e, RequestQueued))
    prefill = next(e.t_ns for e in events if isinstance(e, PrefillStarted))
    tokens = [e.t_ns for e in events if isinstance(e, TokenEmitted)]
    done = next((e.t_ns for e in events if isinstance(e, RequestFinished)), None)
    return Stamped(itl_s=[(b - a) / 1e9 for a, b in itertools.pairwise(tokens)],
                   queue_s=(prefill - queued) / 1e9, ttft_s=(tokens[0] - queued) / 1e9,
                   decode_s=(tokens[-1] - tokens[0]) / 1e9,
                   e2e_s=None if done is None else (done - queued) / 1e9,
                   output_tokens=len(tokens))


def snapshot(spec: ReplySpec, t: int, index: int, word: str) -> SamplerSnapshot:
    probs = [0.41, 0.22, 0.12, 0.08, 0.05, 0.04, 0.03, 0.02, 0.015, 0.01]
    texts = [word, " a", " the", " Lyon", " in", " very", "\n", " its", " one", " so"]
    candidates = tuple((100 + k if k else 100 + index % len(WORDS), txt, p)
                       for k, (txt, p) in enumerate(zip(texts, probs, strict=True)))
    kept = next(k + 1 for k in range(len(probs)) if sum(probs[: k + 1]) >= spec.top_p * 0.98)
    return SamplerSnapshot(spec.request_id, t, index, spec.temperature, spec.top_p,
                           candidates, kept, candidates[1][0] if index % 10 == 5 else
                           candidates[0][0])


def loaded_event(t_ns: int = 1_000 * MS) -> ModelLoaded:
    return ModelLoaded(t_ns, INFO, 1.2)


def conversation_specs(start_ns: int = 2_000 * MS) -> list[ReplySpec]:
    """Four chat turns: a cold first turn, then cached follow-ups, one with an edit."""
    return [
        ReplySpec("req-1", start_ns, 420, 0, 180),
        ReplySpec("req-2", start_ns + 9_000 * MS, 640, 598, 120, miss_reason="none"),
        ReplySpec("req-3", start_ns + 15_000 * MS, 820, 300, 240, queue_ms=40,
                  miss_reason="edited_history"),
        ReplySpec("req-4", start_ns + 27_000 * MS, 1100, 1058, 300, miss_reason="none",
                  temperature=1.1, top_p=0.8),
    ]


def history_events(tokens: int = 10_000, per_reply: int = 250,
                   start_ns: int = 2_000 * MS) -> list[list[EngineEvent]]:
    """A long session: replies of per_reply tokens until `tokens` have been emitted.

    Conversations of eight turns whose prompts grow and are cached (a new conversation
    every eighth reply), so per-turn panels and the context forecast see a realistic history.
    Returns one event list per reply, in order, with consistent session-wide stamps.
    """
    replies = []
    start = start_ns
    for number in range(-(-tokens // per_reply)):
        turn = number % 8
        prompt = 300 + turn * (per_reply + 30)
        spec = ReplySpec(f"req-{number + 1}", start, prompt, 0 if turn == 0 else prompt - 30,
                         min(per_reply, tokens - number * per_reply),
                         miss_reason="first_turn" if turn == 0 else "none")
        events = reply_events(spec)
        replies.append(events)
        start = events[-1].t_ns + 1_000 * MS  # the user reads, then sends the next turn
    return replies
