"""The decode loop: prefill what the cache lacks, then one timed step per token.

Hand-written rather than generate(), so every token is stamped the moment it is emitted and
the KV cache stays ours to reuse on the next turn. Runs only in the engine thread.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.chat_template import FALLBACK_STOPS, encode_chat_with_spans
from engine.detok import IncrementalDetokenizer, StopMatcher
from engine.draft import DraftModel, DraftProposer
from engine.errors import ContextOverflowError, InvalidRequestError
from engine.events import (
    EngineEvent,
    FinishReason,
    GenerationResult,
    PrefillStarted,
    SamplerSnapshot,
    TextFlushed,
    TokenEmitted,
)
from engine.layer_progress import LayerProgress, decoder_layers
from engine.loader import LoadedModel
from engine.metrics import RequestTimeline, compute_metrics
from engine.params import ChatMessage, GenerationRequest
from engine.prefill_progress import PrefillReporter
from engine.prefix_cache import (
    CacheLease,
    PrefixCache,
    PromptLayout,
    crop_to,
    model_rollback_blocker,
)
from engine.sampling import make_generator, sample_token, sampler_view
from engine.speculative import PromptLookup, SpecStats, verify_sampled

Emit = Callable[[EngineEvent], None]
SNAPSHOT_INTERVAL_NS = 100_000_000  # sampler snapshots at most 10 per second
# Prompt tokens per prefill forward. On the Xeon VM (SmolLM2-135M, fp32, a 2,048-token prompt,
# one thread of a shared machine, best of 2) chunks of 128 / 256 / 512 kept 76% / 87% / 92% of
# one pass's tokens per CPU-second; 256 keeps progress and Stop within about half a second
# (~0.55-0.8 s a chunk at this CPU's 2-thread prefill rate), 512 would double that. A GPU takes
# big chunks at no cost.
CPU_PREFILL_CHUNK = 256
GPU_PREFILL_CHUNK = 2048
PREFILL_CHUNK_ENV = "PHASEWISE_PREFILL_CHUNK"  # overrides both (tokens)


def default_prefill_chunk(device: torch.device) -> int:
    """Prompt tokens per prefill forward on this device (PHASEWISE_PREFILL_CHUNK overrides)."""
    override = os.environ.get(PREFILL_CHUNK_ENV, "")
    if override.isdigit() and int(override) > 0:
        return int(override)
    return GPU_PREFILL_CHUNK if device.type == "cuda" else CPU_PREFILL_CHUNK


def now_ns() -> int:
    return time.perf_counter_ns()


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for source in (loaded.tokenizer.eos_token_id, loaded.model.generation_config.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return ids


def template_stops(loaded: LoadedModel) -> tuple[str, ...]:
    """Stop strings the chat template implies (the plain fallback template has no EOS turn)."""
    return FALLBACK_STOPS if loaded.info.template_fallback else ()


@torch.inference_mode()
def warm_up(loaded: LoadedModel) -> None:
    """One short forward pass, so the first reply does not pay one-time kernel set-up
    (about 3 s on a small CPU) inside its measured prefill."""
    from transformers import DynamicCache

    ids = torch.tensor([[loaded.tokenizer.eos_token_id or 0] * 4], device=loaded.device)
    loaded.model(input_ids=ids, cache=DynamicCache(config=loaded.model.config), use_cache=True,
                 logits_to_keep=1)


@dataclass
class PreparedPrompt:
    ids: list[int]
    layout: PromptLayout = field(default_factory=PromptLayout)

    @property
    def dropped_messages(self) -> int:
        return self.layout.dropped_messages


def prepare_prompt(loaded: LoadedModel, request: GenerationRequest) -> PreparedPrompt:
    """Tokenize the request and check that it fits the context (at least one reply token)."""
    request.validate()
    context = loaded.info.context_length
    if request.prompt_token_ids is not None:
        ids = list(request.prompt_token_ids)
        if len(ids) + 1 > context:
            raise ContextOverflowError(len(ids), context)
        return PreparedPrompt(ids)
    messages = list(request.messages)
    prompt = _encode_messages(loaded, messages)
    if len(prompt.ids) + 1 <= context:
        return prompt
    droppable = [i for i, m in enumerate(messages[:-1]) if m.role != "system"]
    if request.overflow != "drop_oldest" or not droppable:
        raise ContextOverflowError(len(prompt.ids), context)
    return _drop_oldest_to_fit(loaded, messages, droppable, context)


def _drop_oldest_to_fit(
    loaded: LoadedModel, messages: list[ChatMessage], droppable: list[int], context: int
) -> PreparedPrompt:
    """The prompt with the fewest oldest non-system messages dropped that fits the context.

    Dropping more never makes the prompt longer, so a binary search over the count needs
    O(log n) encodes of the history instead of one per dropped message.
    """

    def without_oldest(count: int) -> list[ChatMessage]:
        gone = set(droppable[:count])
        return [m for i, m in enumerate(messages) if i not in gone]

    fewest = _encode_messages(loaded, without_oldest(len(droppable)))
    if len(fewest.ids) + 1 > context:
        raise ContextOverflowError(len(fewest.ids), context)
    # Invariant: dropping `hi` messages fits (best is that prompt); dropping lo - 1 does not.
    lo, hi, best = 1, len(droppable), fewest
    while lo < hi:
        mid = (lo + hi) // 2
        candidate = _encode_messages(loaded, without_oldest(mid))
        if len(candidate.ids) + 1 <= context:
            hi, best = mid, candidate
        else:
            lo = mid + 1
    best.layout = dataclasses.replace(best.layout, dropped_messages=hi)
    return best


def _encode_messages(loaded: LoadedModel, messages: list[ChatMessage]) -> PreparedPrompt:
    ids, spans = encode_chat_with_spans(loaded.tokenizer, messages)
    if not ids:
        raise InvalidRequestError("prompt is empty")
    assistant = [s for s in spans if s[0] == "assistant"]
    layout = PromptLayout(
        spans=tuple(spans),
        generated_span=(assistant[-1][1], assistant[-1][2]) if assistant else None,
    )
    return PreparedPrompt(ids, layout)


class DecodeSession:
    """Runs one request to completion on the engine thread."""

    def __init__(self, loaded: LoadedModel, prefix_cache: PrefixCache,
                 draft: DraftModel | None = None, prefill_chunk: int | None = None) -> None:
        self.loaded = loaded
        self.prefix_cache = prefix_cache
        self.draft = draft  # proposes tokens for speculative="draft" requests
        self.prefill_chunk = prefill_chunk or default_prefill_chunk(loaded.device)
        self.eos_ids = eos_token_ids(loaded)
        self.stops = template_stops(loaded)

    @torch.inference_mode()
    def run(
        self,
        request: GenerationRequest,
        timeline: RequestTimeline,
        cancel: threading.Event,
        emit: Emit,
    ) -> GenerationResult:
        timeline.prefill_start_ns = now_ns()
        prompt = prepare_prompt(self.loaded, request)
        if request.speculative == "draft" and self.draft is None:
            raise InvalidRequestError("speculative decoding with a draft model needs one: "
                                      "load it first (--draft-model SPEC)")
        params = request.params
        budget = min(params.max_tokens, self.loaded.info.context_length - len(prompt.ids))
        if request.reuse_cache:
            lease = self.prefix_cache.acquire(request.conversation_id, prompt.ids, prompt.layout)
        else:
            lease = self.prefix_cache.cold_lease(request.conversation_id)
        emit(PrefillStarted(request.request_id, timeline.prefill_start_ns, len(prompt.ids),
                            lease.cached_tokens, lease.miss_reason))
        healthy = False
        try:
            result = self._decode(request, prompt.ids, lease, budget, timeline, cancel, emit)
            healthy = True
            return dataclasses.replace(result, dropped_messages=prompt.dropped_messages)
        finally:
            if healthy:
                self.prefix_cache.release(lease)

    def _decode(
        self,
        request: GenerationRequest,
        prompt_ids: list[int],
        lease: CacheLease,
        budget: int,
        timeline: RequestTimeline,
        cancel: threading.Event,
        emit: Emit,
    ) -> GenerationResult:
        params = request.params
        device = self.loaded.device
        generator = None if params.greedy else make_generator(params.seed, device)
        detok = IncrementalDetokenizer(self.loaded.tokenizer)
        stopper = StopMatcher(tuple(params.stop) + self.stops)
        generated: list[int] = []
        finish: FinishReason = "length"
        self._last_snapshot_ns = 0

        drafter = self._drafter(request, prompt_ids, generator)
        stats = SpecStats()
        prefill = ChunkedPrefill(self.loaded, lease, prompt_ids[lease.cached_tokens :],
                                 request.request_id, emit)
        rows = prefill.run(self.prefill_chunk, cancel)
        if rows is None:
            finish = "cancelled"  # Stop before or during the prefill: within one chunk
        else:
            timeline.first_logits_ns = now_ns()
            draft: list[int] = []
            while True:
                # Walk the verified rows: row j's token is final; it continues the walk only
                # when it equals draft[j] (then row j + 1 was computed on the right prefix).
                accepted = 0
                outcome: FinishReason | None = None
                for j, logits in enumerate(rows):
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
                    outcome = self._emit_checked(emit, request, timeline, token, detok, stopper,
                                                 params.ignore_eos)
                    if outcome is None and len(generated) >= budget:
                        outcome = "length"
                    if outcome is None and cancel.is_set():
                        outcome = "cancelled"
                    if outcome is not None or j >= len(draft) or token != draft[j]:
                        break
                    accepted += 1
                stats.accepted += accepted
                if draft:
                    # The cache holds the last step's input token plus the whole draft.
                    self._trim(lease, len(lease.ids) - len(draft) + accepted)
                if outcome is not None:
                    finish = outcome
                    break
                room = budget - len(generated) - 1
                draft = drafter.propose(room) if drafter is not None else []
                if draft:
                    stats.proposed += len(draft)
                rows = self._forward([token, *draft], lease, rows=1 + len(draft))
        # Plain decoding never feeds the last emitted token; a draft may have gone further.
        self._trim(lease, len(prompt_ids) + max(len(generated) - 1, 0))
        if finish != "stop":
            tail = stopper.feed(detok.flush()) + stopper.flush()
            if tail:
                emit(TextFlushed(request.request_id, now_ns(), tail))
        timeline.done_ns = now_ns()
        metrics = compute_metrics(
            timeline,
            prompt_tokens=len(prompt_ids),
            cached_tokens=lease.cached_tokens,
            parameters=self.loaded.info.parameters,
            weight_bytes_per_step=self.loaded.info.weight_bytes_per_step,
            cache_miss_reason=lease.miss_reason,
        )
        return GenerationResult(
            request_id=request.request_id,
            text=stopper.emitted,
            finish_reason=finish,
            token_ids=generated,
            prompt_token_ids=prompt_ids,
            metrics=metrics,
            model=self.loaded.info,
            speculative=request.speculative if drafter is not None else None,
            spec_proposed=stats.proposed,
            spec_accepted=stats.accepted,
        )

    def _forward(self, ids: list[int], lease: CacheLease, rows: int = 1) -> torch.Tensor:
        """Run ids through the model on top of the lease's cache; return the logits of the
        last `rows` positions, shape (rows, vocab)."""
        input_ids = torch.tensor([ids], device=self.loaded.device)
        out = self.loaded.model(input_ids=input_ids, cache=lease.cache, use_cache=True,
                                logits_to_keep=rows)
        lease.ids.extend(ids)
        logits: torch.Tensor = out.logits[0, -rows:]
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        return logits

    @staticmethod
    def _trim(lease: CacheLease, length: int) -> None:
        """Drop cached positions from `length` on, keeping lease.ids equal to the cache."""
        if len(lease.ids) > length:
            crop_to(lease.cache, length)
            del lease.ids[length:]

    def _drafter(self, request: GenerationRequest, prompt_ids: list[int],
                 generator: torch.Generator | None) -> PromptLookup | DraftProposer | None:
        """Greedy requests: verification keeps the output identical to plain decoding.
        Sampled requests: a draft model's sampled drafts pass the speculative sampling test,
        which keeps the output distribution the target's; prompt lookup decodes them plainly."""
        params = request.params
        if request.speculative is None or (request.speculative == "ngram" and not params.greedy):
            return None
        if model_rollback_blocker(self.loaded.model.config) is not None:
            return None  # a rejected draft could not be taken back out of this model's cache
        if request.speculative == "ngram":
            return PromptLookup(prompt_ids)
        assert self.draft is not None  # run() refuses a draft request without one
        stop_ids = () if params.ignore_eos else self.eos_ids
        return DraftProposer(self.draft, prompt_ids, stop_ids, params, generator)

    def _emit_checked(
        self,
        emit: Emit,
        request: GenerationRequest,
        timeline: RequestTimeline,
        token: int,
        detok: IncrementalDetokenizer,
        stopper: StopMatcher,
        ignore_eos: bool,
    ) -> FinishReason | None:
        """Emit one token's text; return "stop" if it ends the reply (EOS or a stop string)."""
        text, ends = token_text(token, self.eos_ids, ignore_eos, detok, stopper)
        emit(token_event(request.request_id, timeline, token, text))
        return "stop" if ends else None

    def _maybe_snapshot(
        self, emit: Emit, request: GenerationRequest, logits: torch.Tensor, token: int, index: int
    ) -> None:
        """Report the sampler's view of this token, throttled so it costs nothing per token."""
        t = now_ns()
        if index and t - self._last_snapshot_ns < SNAPSHOT_INTERVAL_NS:
            return
        self._last_snapshot_ns = t
        emit(sampler_snapshot(self.loaded.tokenizer, request, logits, token, index, t))


# ----- pieces shared with the batcher (engine/batching.py) -------------------------------------
class ChunkedPrefill:
    """Feeds a prompt's uncached tokens through the model a chunk at a time on top of a lease's
    cache, and reports PrefillProgress after each chunk (on a CPU, within it too).

    Chunks keep Stop and progress within one chunk's time and let the batcher run decode steps
    between them; attention over the cache makes the result the one-pass prefill's (within fp
    rounding)."""

    def __init__(self, loaded: LoadedModel, lease: CacheLease, ids: list[int], request_id: str,
                 emit: Emit) -> None:
        self.loaded = loaded
        self.lease = lease
        self.ids = ids
        self.request_id = request_id
        self.done = 0
        self._reporter = PrefillReporter(request_id, len(ids), emit)
        # Progress from inside a chunk as its layers run: on a CPU, where a hook runs after
        # its layer's ops (engine.layer_progress); a GPU chunk is short anyway.
        self._layers = decoder_layers(loaded.model) if loaded.device.type == "cpu" else []

    @property
    def finished(self) -> bool:
        return self.done >= len(self.ids)

    def step(self, max_tokens: int) -> torch.Tensor | None:
        """Run the next chunk of at most max_tokens; return the last prompt position's logits,
        shape (1, vocab), once the whole prompt is in the cache, else None."""
        chunk = self.ids[self.done : self.done + self.lease.chunk_limit(max(1, max_tokens))]
        input_ids = torch.tensor([chunk], device=self.loaded.device)
        with self._progress_within(self.done, len(chunk)):
            out = self.loaded.model(input_ids=input_ids, cache=self.lease.cache,
                                    use_cache=True, logits_to_keep=1)
        self.lease.ids.extend(chunk)
        self.lease.fed()  # a recurrent cache keeps a checkpoint one token before the end
        self.done += len(chunk)
        logits = out.logits[0, -1:]
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        self._reporter.chunk_done(self.done)
        return logits if self.finished else None

    def _progress_within(self, begin: int, size: int) -> AbstractContextManager[object]:
        if not self._layers:
            return nullcontext()
        return LayerProgress(self._layers,
                             lambda fraction: self._reporter.within(begin, size, fraction))

    def run(self, chunk: int, cancel: threading.Event) -> torch.Tensor | None:
        """The whole prefill in chunks; None if cancel was set before a chunk (what was
        computed stays in the lease, so a retry of the same prompt reuses it)."""
        while not cancel.is_set():
            logits = self.step(chunk)
            if logits is not None:
                return logits
        return None


def token_text(token: int, eos_ids: set[int], ignore_eos: bool,
               detok: IncrementalDetokenizer, stopper: StopMatcher) -> tuple[str, bool]:
    """The text one token adds to the reply, and whether it ends it (EOS or a stop string)."""
    if token in eos_ids and not ignore_eos:
        return stopper.feed(detok.flush()) + stopper.flush(), True
    return stopper.feed(detok.push(token)), stopper.stopped


def token_event(request_id: str, timeline: RequestTimeline, token: int,
                text: str) -> TokenEmitted:
    """Stamp a token on the engine's clock (the timeline's ITL source) and make its event."""
    t = now_ns()
    timeline.token_ns.append(t)
    return TokenEmitted(request_id, t, len(timeline.token_ns) - 1, token, text)


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
                     token: int, index: int, t: int) -> SamplerSnapshot:
    """The sampler's view of one token: the top candidates after temperature, the top-p cut."""
    params = request.params
    top, kept = sampler_view(logits, params)
    candidates = tuple((tid, readable_piece(tokenizer.decode([tid])), p) for tid, p in top)
    return SamplerSnapshot(request.request_id, t, index, params.temperature, params.top_p,
                           candidates, kept, token)
