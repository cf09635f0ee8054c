"""The decode loop for one request on llama.cpp: Phasewise's loop, clock, sampler and events,
llama.cpp's kernels.

The same steps as engine/generate.py's DecodeSession: prefill what the prefix cache lacks (in
llama_decode batches, Stop checked between them), then one timed llama_decode per token, the
token drawn by engine/sampling.py from a view of llama.cpp's logits buffer. Prompt-lookup
drafts and a draft model's (engine/llamacpp/draft.py, a second context) are verified in one
llama_decode with logits for every drafted position; rejected positions are dropped from the
sequence with seq_rm. Runs only in the engine thread.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from engine.detok import IncrementalDetokenizer, StopMatcher
from engine.draft import DraftProposer
from engine.errors import InvalidRequestError
from engine.events import FinishReason, GenerationResult, PrefillStarted, TextFlushed
from engine.generate import (
    SNAPSHOT_INTERVAL_NS,
    Emit,
    now_ns,
    prepare_prompt,
    sampler_snapshot,
    template_stops,
    token_event,
    token_text,
)
from engine.llamacpp.decode import feed
from engine.llamacpp.draft import LlamaDraftModel
from engine.llamacpp.model import LlamaCppModel
from engine.llamacpp.prefix_pool import SeqPrefixCache
from engine.metrics import RequestTimeline, compute_metrics
from engine.params import GenerationRequest
from engine.prefill_progress import PrefillReporter
from engine.prefix_cache import CacheLease
from engine.sampling import make_generator, sample_token
from engine.speculative import PromptLookup, SpecStats, verify_sampled


def eos_ids(loaded: LlamaCppModel) -> set[int]:
    """Every end-of-generation token of the vocabulary, computed once per model."""
    ids = loaded.eog_ids
    if ids is None:
        ids = loaded.eog_ids = loaded.tokenizer.end_of_generation_ids()
    return ids


class LlamaSession:
    """Runs one request to completion on the engine thread (DecodeSession's contract)."""

    def __init__(self, loaded: LlamaCppModel, prefix_cache: SeqPrefixCache,
                 draft: LlamaDraftModel | None = None) -> None:
        self.loaded = loaded
        self.prefix_cache = prefix_cache
        self.draft = draft  # proposes tokens for speculative="draft" requests
        self.eos_ids = eos_ids(loaded)
        self.stops = template_stops(loaded)  # type: ignore[arg-type]  # reads .info only
        self._last_snapshot_ns = 0

    @torch.inference_mode()
    def run(self, request: GenerationRequest, timeline: RequestTimeline,
            cancel: threading.Event, emit: Emit) -> GenerationResult:
        timeline.prefill_start_ns = now_ns()
        prompt = prepare_prompt(self.loaded, request)  # type: ignore[arg-type]
        if request.speculative == "draft" and self.draft is None:
            raise InvalidRequestError("speculative decoding with a draft model needs one: "
                                      "load it first (--draft-model SPEC)")
        budget = min(request.params.max_tokens, self.loaded.info.context_length - len(prompt.ids))
        pool = self.prefix_cache
        if request.reuse_cache:
            lease = pool.acquire(request.conversation_id, prompt.ids, prompt.layout)
        else:
            lease = pool.cold_lease(request.conversation_id)
        emit(PrefillStarted(request.request_id, timeline.prefill_start_ns, len(prompt.ids),
                            lease.cached_tokens, lease.miss_reason))
        try:
            result = dataclasses.replace(
                self._decode(request, prompt.ids, lease, budget, timeline, cancel, emit),
                dropped_messages=prompt.dropped_messages)
        except BaseException:
            pool.discard(lease)
            raise
        pool.release(lease)
        return result

    def _decode(self, request: GenerationRequest, prompt_ids: list[int], lease: CacheLease,
                budget: int, timeline: RequestTimeline, cancel: threading.Event,
                emit: Emit) -> GenerationResult:
        params = request.params
        generator = None if params.greedy else make_generator(params.seed, "cpu")
        detok = IncrementalDetokenizer(self.loaded.tokenizer)
        stopper = StopMatcher(tuple(params.stop) + self.stops)
        generated: list[int] = []
        finish: FinishReason = "length"
        drafter = self._drafter(request, prompt_ids, generator)
        stats = SpecStats()
        uncached = prompt_ids[lease.cached_tokens :]
        rows = self._forward(uncached, lease, 1, cancel,
                             PrefillReporter(request.request_id, len(uncached), emit))
        if rows is not None and isinstance(drafter, DraftProposer):
            assert self.draft is not None
            if not self.draft.prefill(prompt_ids, cancel):
                rows = None
        if rows is None:
            finish = "cancelled"  # Stop before or during the prefill: within one batch
        else:
            timeline.first_logits_ns = now_ns()
            draft: list[int] = []
            while True:
                # Row j's token is final; it continues the walk only when it equals draft[j]
                # (then row j + 1 was computed on the right prefix).
                accepted = 0
                outcome: FinishReason | None = None
                assert rows is not None  # only a cancelled prefill has no rows
                for j in range(rows.shape[0]):
                    logits = rows[j]
                    seen = prompt_ids + generated if params.repetition_penalty != 1.0 else ()
                    if drafter is not None and drafter.draft_probs and j < len(draft):
                        token = verify_sampled(logits, params, seen, draft[j],
                                               drafter.draft_probs[j], generator)
                    else:
                        token = sample_token(logits, params, generator, seen)
                    self._maybe_snapshot(emit, request, logits, token, len(generated))
                    generated.append(token)
                    if drafter is not None:
                        drafter.append(token)
                    text, ends = token_text(token, self.eos_ids, params.ignore_eos, detok,
                                            stopper)
                    emit(token_event(request.request_id, timeline, token, text))
                    outcome = "stop" if ends else None
                    if outcome is None and len(generated) >= budget:
                        outcome = "length"
                    if outcome is None and cancel.is_set():
                        outcome = "cancelled"
                    if outcome is not None or j >= len(draft) or token != draft[j]:
                        break
                    accepted += 1
                stats.accepted += accepted
                if draft:  # the sequence holds the last input token plus the whole draft
                    self._trim(lease, len(lease.ids) - len(draft) + accepted)
                if outcome is not None:
                    finish = outcome
                    break
                draft = drafter.propose(budget - len(generated) - 1) if drafter else []
                if draft and cancel.is_set():  # Stop while the draft model proposed
                    finish = "cancelled"
                    break
                stats.proposed += len(draft)
                rows = self._forward([token, *draft], lease, 1 + len(draft))
        # Plain decoding never feeds the last emitted token; a draft may have gone further.
        self._trim(lease, len(prompt_ids) + max(len(generated) - 1, 0))
        if finish != "stop":
            tail = stopper.feed(detok.flush()) + stopper.flush()
            if tail:
                emit(TextFlushed(request.request_id, now_ns(), tail))
        timeline.done_ns = now_ns()
        info = self.loaded.info
        metrics = compute_metrics(
            timeline, prompt_tokens=len(prompt_ids), cached_tokens=lease.cached_tokens,
            parameters=info.parameters, weight_bytes_per_step=info.weight_bytes_per_step,
            cache_miss_reason=lease.miss_reason)
        return GenerationResult(
            request_id=request.request_id, text=stopper.emitted, finish_reason=finish,
            token_ids=generated, prompt_token_ids=prompt_ids, metrics=metrics, model=info,
            speculative=request.speculative if drafter is not None else None,
            spec_proposed=stats.proposed, spec_accepted=stats.accepted)

    def _drafter(self, request: GenerationRequest, prompt_ids: list[int],
                 generator: torch.Generator | None) -> PromptLookup | DraftProposer | None:
        """As DecodeSession._drafter: prompt lookup for greedy requests; a draft model for
        greedy ones (exact) and sampled ones (the speculative sampling rule). None where a
        recurrent state cannot drop rejected drafts."""
        params = request.params
        if request.speculative is None or not self.loaded.can_roll_back:
            return None
        if request.speculative == "ngram":
            return PromptLookup(prompt_ids) if params.greedy else None
        assert self.draft is not None  # run() refuses a draft request without one
        stop_ids = () if params.ignore_eos else self.eos_ids
        return DraftProposer(self.draft, prompt_ids, stop_ids, params, generator)

    def _forward(self, ids: list[int], lease: CacheLease, rows: int,
                 cancel: threading.Event | None = None,
                 progress: PrefillReporter | None = None) -> torch.Tensor | None:
        """Feed ids on top of the lease's sequence; the logits of the last `rows` positions,
        shape (rows, vocab), a view valid until the next decode. None if cancelled."""
        if cancel is not None and cancel.is_set():
            return None
        if not feed(self.loaded, self.prefix_cache, lease, ids, rows, cancel, progress):
            return None
        return self.loaded.logits(rows)

    def _trim(self, lease: CacheLease, length: int) -> None:
        """Drop positions from `length` on, keeping lease.ids equal to the sequence."""
        if len(lease.ids) > length:
            self.prefix_cache.crop(lease.cache, length)
            del lease.ids[length:]

    def _maybe_snapshot(self, emit: Emit, request: GenerationRequest, logits: torch.Tensor,
                        token: int, index: int) -> None:
        """The sampler's view of this token, throttled to ~10 per second."""
        t = now_ns()
        if index and t - self._last_snapshot_ns < SNAPSHOT_INTERVAL_NS:
            return
        self._last_snapshot_ns = t
        emit(sampler_snapshot(self.loaded.tokenizer, request, logits, token, index, t))
