"""A reply being generated: its request's state, and the one per-token step every loop runs.

Whatever runs the model (torch or llama.cpp, alone or in a batch, plain or speculative), a
token is taken the same way: sampled (or a draft verified) from the logits, the sampler's view
reported now and then, its text pushed through the incremental detokenizer and the stop
matcher, stamped on the engine thread's clock, and the reply's end decided (stop, length,
cancel). The result and its metrics are built here too. Runs only on the engine thread.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine.core import host_logits
from engine.core.detok import (
    ByteDetokenizer,
    Detokenizer,
    IncrementalDetokenizer,
    StopMatcher,
)
from engine.core.ledger import CacheLease, KvLedger
from engine.core.prompt import ChatModel, PreparedPrompt, prepare_prompt
from engine.core.sampling import Distribution, make_generator, sample, sampler_view
from engine.core.speculative import Proposer, SpecStats, verify_sampled
from engine.events import (
    EngineEvent,
    FinishReason,
    GenerationResult,
    ModelInfo,
    PrefillStarted,
    SamplerSnapshot,
    TextFlushed,
    TokenEmitted,
)
from engine.metrics import RequestTimeline, compute_metrics, now_ns
from engine.params import GenerationRequest

SNAPSHOT_INTERVAL_NS = 100_000_000  # sampler snapshots at most 10 per second
EmitEvent = Callable[[EngineEvent], None]


class ReplyJob(Protocol):
    """A queued request as the loops see it (the worker's job object)."""

    @property
    def request(self) -> GenerationRequest: ...

    timeline: RequestTimeline
    cancel: threading.Event


@dataclass
class DetachedJob:
    """A request outside the engine's queue (benchmarks, a request run alone)."""

    request: GenerationRequest
    timeline: RequestTimeline = field(default_factory=lambda: RequestTimeline(now_ns()))
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Vocabulary:
    """What a reply needs of its model's vocabulary: the tokenizer (text, snapshots), the
    tokens that end a reply, and the stop strings the chat template implies."""

    tokenizer: Any  # decode(ids) -> str, as a Hugging Face tokenizer
    eos_ids: frozenset[int]
    stops: tuple[str, ...] = ()
    # a token's bytes as a reply shows them, where tokens are byte strings (llama.cpp): the
    # reply's text then streams through one UTF-8 decoder
    piece: Callable[[int], bytes] | None = None

    def detokenizer(self) -> Detokenizer:
        """A new reply's detokenizer."""
        if self.piece is not None:
            return ByteDetokenizer(self.piece)
        return IncrementalDetokenizer(self.tokenizer)


class Reply:
    """One request's generation: sampler, text state, budget, cache lease and timeline."""

    def __init__(self, job: ReplyJob, prompt: PreparedPrompt, lease: CacheLease,
                 vocab: Vocabulary, info: ModelInfo, emit: EmitEvent) -> None:
        params = job.request.params
        self.job = job
        self.prompt_ids = prompt.ids
        self.dropped_messages = prompt.dropped_messages  # oldest turns left out to fit
        self.lease = lease
        self.vocab = vocab
        self.info = info
        self.emit = emit
        self.budget = min(params.max_tokens, info.context_length - len(prompt.ids))
        self.generator = None if params.greedy else make_generator(params.seed)
        self.detok = vocab.detokenizer()
        self.stopper = StopMatcher(tuple(params.stop) + vocab.stops)
        self.generated: list[int] = []
        self.finish: FinishReason | None = None
        self.spec = SpecStats()
        self.speculative: str | None = None  # the method, once a drafter runs
        self.drafter: Proposer | None = None
        self.draft: list[int] = []  # proposed, to be fed after the last token and verified
        self._last_snapshot_ns = 0

    @property
    def request(self) -> GenerationRequest:
        return self.job.request

    @property
    def kv_len(self) -> int:
        """Positions this reply holds in the KV: the prompt plus every token fed back (the
        last emitted one is never fed)."""
        return len(self.prompt_ids) + max(len(self.generated) - 1, 0)

    def take(self, logits: torch.Tensor, proposal: tuple[int, torch.Tensor] | None = None
             ) -> int | None:
        """Take the next token from logits (shape (vocab,)); with `proposal` (a drafted token
        and the draft's probabilities), verify it by the speculative sampling rule instead.
        Sets `finish` when the reply ends here. Before the first token, empty logits (a prefill
        that Stop ended) or Stop end the reply with no token: None."""
        if not self.generated and (self.job.cancel.is_set() or not logits.numel()):
            self.finish = "cancelled"
            return None
        params = self.request.params
        seen = self.prompt_ids + self.generated if params.repetition_penalty != 1.0 else ()
        if proposal is not None:
            token = verify_sampled(logits, params, seen, proposal[0], proposal[1], self.generator)
            self._maybe_snapshot(logits, token)
        else:
            drawn = sample(logits, params, self.generator, seen)
            token = drawn.token
            self._maybe_snapshot(drawn.logits, token, drawn.chosen)
        self.generated.append(token)
        text, ends = self._text(token)
        self.emit(self._stamped(token, text))
        if ends:
            self.finish = "stop"
        elif len(self.generated) >= self.budget:
            self.finish = "length"
        elif self.job.cancel.is_set():
            self.finish = "cancelled"
        return token

    def use_drafter(self, drafter: Proposer | None) -> None:
        """Speculate with `drafter` (None: plain decoding), as the result will say."""
        self.drafter = drafter
        self.speculative = self.request.speculative if drafter is not None else None

    def propose(self) -> list[int]:
        """The next draft (empty without a drafter): at most what the budget leaves after the
        token the step takes anyway. Fed after the last token, verified by take_drafted."""
        left = self.budget - len(self.generated) - 1
        self.draft = self.drafter.propose(left) if self.drafter is not None else []
        return self.draft

    def take_drafted(self, rows: torch.Tensor) -> tuple[int | None, int]:
        """Take tokens from rows: the logits after the last token and after each token of the
        draft fed with it. Row j's token is final; the walk goes on only while it equals
        draft[j] (then row j + 1 was computed on the right prefix). The last token taken (None:
        Stop before the first) and how many fed draft tokens were rejected (to cut from the
        cache). Consumes the draft."""
        draft, self.draft = self.draft, []
        drafter = self.drafter
        if not draft:  # a plain step: one row
            token = self.take(host_logits.row(rows, 0))
            if token is not None and drafter is not None:
                drafter.append(token)
            return token, 0
        probs = drafter.draft_probs if drafter is not None else None
        accepted, token = 0, None
        for j in range(rows.shape[0]):
            proposal = (draft[j], probs[j]) if probs and j < len(draft) else None
            token = self.take(host_logits.row(rows, j), proposal)
            if token is None:
                break
            if drafter is not None:
                drafter.append(token)
            if self.finish is not None or j >= len(draft) or token != draft[j]:
                break
            accepted += 1
        self.spec.proposed += len(draft)
        self.spec.accepted += accepted
        return token, len(draft) - accepted

    def _text(self, token: int) -> tuple[str, bool]:
        """The text one token adds to the reply, and whether it ends it (EOS or a stop)."""
        if token in self.vocab.eos_ids and not self.request.params.ignore_eos:
            return self.stopper.feed(self.detok.flush()) + self.stopper.flush(), True
        return self.stopper.feed(self.detok.push(token)), self.stopper.stopped

    def _stamped(self, token: int, text: str) -> TokenEmitted:
        """Stamp a token on the engine's clock (the timeline's ITL source), make its event."""
        t = now_ns()
        timeline = self.job.timeline
        timeline.token_ns.append(t)
        return TokenEmitted(self.request.request_id, t, len(timeline.token_ns) - 1, token, text)

    def _maybe_snapshot(self, logits: torch.Tensor, token: int,
                        chosen: Distribution | None = None) -> None:
        """The sampler's view of this token (chosen: the distribution it was drawn from),
        throttled so it costs nothing per token."""
        t = now_ns()
        if self.generated and t - self._last_snapshot_ns < SNAPSHOT_INTERVAL_NS:
            return
        self._last_snapshot_ns = t
        self.emit(sampler_snapshot(self.vocab.tokenizer, self.request, logits, token,
                                   len(self.generated), t, chosen))

    def result(self) -> GenerationResult:
        """End the reply: flush held-back text (unless a stop string cut it), stamp the end,
        and build the result with its metrics."""
        request, timeline = self.request, self.job.timeline
        finish: FinishReason = self.finish or "length"
        if finish != "stop":
            tail = self.stopper.feed(self.detok.flush()) + self.stopper.flush()
            if tail:
                self.emit(TextFlushed(request.request_id, now_ns(), tail))
        timeline.done_ns = now_ns()
        info = self.info
        prompt = len(self.prompt_ids)
        # The prompt tokens in the cache now: all of them once the prefill gave logits; after
        # a Stop inside it, what the lease holds (the chunks read; an alternative's fork of
        # its source's). Its cached part can be no more than that.
        in_cache = prompt if timeline.first_logits_ns or self.generated else \
            min(len(self.lease.ids), prompt)
        cached = min(self.lease.cached_tokens, in_cache)
        metrics = compute_metrics(
            timeline, prompt_tokens=prompt, cached_tokens=cached,
            parameters=info.parameters, weight_bytes_per_step=info.weight_bytes_per_step,
            cache_miss_reason=self.lease.miss_reason, prefilled_tokens=in_cache - cached,
            restored=self.lease.restored)
        return GenerationResult(
            request_id=request.request_id, text=self.stopper.emitted, finish_reason=finish,
            token_ids=list(self.generated), prompt_token_ids=self.prompt_ids, metrics=metrics,
            model=info, dropped_messages=self.dropped_messages, speculative=self.speculative,
            spec_proposed=self.spec.proposed, spec_accepted=self.spec.accepted)


def open_reply(model: ChatModel, cache: KvLedger[Any], job: ReplyJob, vocab: Vocabulary,
               emit: EmitEvent) -> Reply:
    """Start a request: its prompt, a lease on the longest cached prefix of it (an empty one
    when the request must not reuse the cache), and the PrefillStarted event."""
    request, timeline = job.request, job.timeline
    timeline.prefill_start_ns = now_ns()
    prompt = prepare_prompt(model, request)
    if request.reuse_cache:
        lease = cache.acquire(request.conversation_id, prompt.ids, prompt.layout)
    else:
        lease = cache.cold_lease(request.conversation_id)
    emit(PrefillStarted(request.request_id, timeline.prefill_start_ns, len(prompt.ids),
                        lease.cached_tokens, lease.miss_reason))
    return Reply(job, prompt, lease, vocab, model.info, emit)


def sibling_reply(job: ReplyJob, source: Reply, lease: CacheLease, emit: EmitEvent) -> Reply:
    """Alternative `job` of source's prompt, on `lease` (a fork of source's prefilled cache):
    its prefill is source's, every prompt token cached."""
    timeline, src = job.timeline, source.job.timeline
    timeline.prefill_start_ns, timeline.first_logits_ns = src.prefill_start_ns, \
        src.first_logits_ns
    ids = list(source.prompt_ids)
    emit(PrefillStarted(job.request.request_id, timeline.prefill_start_ns, len(ids), len(ids),
                        "none"))
    reply = Reply(job, PreparedPrompt(ids), lease, source.vocab, source.info, emit)
    reply.dropped_messages = source.dropped_messages  # the same prompt, the same turns left out
    return reply


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def readable_piece(text: str) -> str:
    """A candidate token's text as people read it: a byte-fallback token of an ASCII byte
    (<0x0A>) is that character ("\\n"); a byte of a multi-byte character stays <0xE2>, as it
    means nothing alone."""
    byte = _BYTE_PIECE.fullmatch(text)
    if byte is None or int(byte.group(1), 16) >= 0x80:
        return text
    return chr(int(byte.group(1), 16))


def sampler_snapshot(tokenizer: Any, request: GenerationRequest, logits: torch.Tensor,
                     token: int, index: int, t: int,
                     chosen: Distribution | None = None) -> SamplerSnapshot:
    """The sampler's view of one token: the top candidates after temperature, the top-p cut
    (chosen: the distribution the token was drawn from, if at hand)."""
    params = request.params
    top, kept = sampler_view(logits, params, chosen=chosen)
    candidates = tuple((tid, readable_piece(tokenizer.decode([tid])), p) for tid, p in top)
    return SamplerSnapshot(request.request_id, t, index, params.temperature, params.top_p,
                           candidates, kept, token)
