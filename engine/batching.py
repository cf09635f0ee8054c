"""Continuous batching: several requests share each decode step.

Requests join and leave between steps. A joining request gets its own prefill on its
prefix-cache lease (batch of one, exactly as when it runs alone); then its KV rows join the
batch. The batch's KV is one left-padded DynamicCache with a padding mask and per-row
position ids, re-packed only when a row joins or leaves, never per step. A leaving row's KV
(padding stripped) goes back into the prefix cache, so its conversation's next turn hits.

"N alternatives" of one prompt share one prefill: the first row prefills, the others copy
its KV and first logits, then each samples with its own generator.

Runs only on the engine thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

from engine.detok import IncrementalDetokenizer, StopMatcher
from engine.events import (
    EngineEvent,
    FinishReason,
    GenerationResult,
    PrefillStarted,
    TextFlushed,
)
from engine.generate import (
    SNAPSHOT_INTERVAL_NS,
    ChunkedPrefill,
    default_prefill_chunk,
    eos_token_ids,
    now_ns,
    prepare_prompt,
    sampler_snapshot,
    template_stops,
    token_event,
    token_text,
)
from engine.loader import LoadedModel
from engine.metrics import RequestTimeline, compute_metrics
from engine.params import GenerationRequest
from engine.prefix_cache import CacheLease, PrefixCache, crop_to, new_cache
from engine.sampling import make_generator, sample_token
from engine.side_prefill import SidePrefill, can_prefill_beside
from engine.side_thread import step_rows_beside

if TYPE_CHECKING:  # transformers is not imported at run time here: the llama.cpp batcher
    from transformers import DynamicCache  # imports this module and never needs it

MAX_BATCH = 8  # rows decoding at once; later requests wait in the queue
# While rows stream, each engine step spends a token budget: one decode token per row plus a
# prefill chunk (Sarathi-Serve). The budget starts here and then follows the clock, so that a
# chunk takes about CHUNK_STALL decode steps: a streaming row's ITL stays near (1 + CHUNK_STALL)
# times its ITL alone where a small chunk is cheap. On a CPU a chunk also pays a fixed cost (all
# weights read, attention and KV copies over the whole cached prompt): on the Xeon VM an 8-token
# chunk at 4,000 tokens of context cost 2.5-3.5 decode steps and a 32-token one 3.5-5, so
# smaller chunks stop helping ITL while the prompt crawls (8: 10 tok/s against 103 in one pass).
STEP_TOKEN_BUDGET = 32
CHUNK_STALL = 1.0
MIN_INTERLEAVED_CHUNK = 32
ALT_CACHE_SUFFIX = "~alt"  # prefix-cache key of alternative i >= 1: f"{conversation}~alt{i}"


def alternative_cache_key(conversation_id: str | None, index: int) -> str:
    """Where alternative `index` (>= 1) of a conversation's reply keeps its cached prefix;
    alternative 0 uses the conversation's own entry."""
    return f"{conversation_id}{ALT_CACHE_SUFFIX}{index}"

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (1, H, T, D)


class BatchJob(Protocol):
    """What the batcher needs of a queued request (the worker's job object)."""

    @property
    def request(self) -> GenerationRequest: ...

    timeline: RequestTimeline
    cancel: threading.Event


@dataclass
class DetachedJob:
    """A request outside the engine's queue (benchmarks): the caller handles its events."""

    request: GenerationRequest
    timeline: RequestTimeline = field(default_factory=lambda: RequestTimeline(now_ns()))
    cancel: threading.Event = field(default_factory=threading.Event)


Emit = Callable[[BatchJob, EngineEvent], None]
Done = Callable[[BatchJob, GenerationResult | None, BaseException | None], None]


def batchable(request: GenerationRequest) -> bool:
    """Speculative requests verify several tokens per step: they run alone."""
    return request.speculative is None


def cache_supports_batching(loaded: LoadedModel) -> bool:
    """Only plain full-size attention layers (sliding-window ones included, see new_cache) can
    be padded and concatenated row-wise."""
    from transformers.cache_utils import DynamicLayer

    layers = new_cache(loaded.model.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


@dataclass
class Row:
    """One request in the batch: its sampler, text state and KV bookkeeping."""

    job: BatchJob
    prompt_ids: list[int]
    lease: CacheLease
    budget: int
    generator: torch.Generator | None
    detok: IncrementalDetokenizer
    stopper: StopMatcher
    generated: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    last_snapshot_ns: int = 0
    dropped_messages: int = 0  # oldest messages left out to fit the context

    @property
    def request(self) -> GenerationRequest:
        return self.job.request

    @property
    def kv_len(self) -> int:
        """Positions this row holds in the KV: the prompt plus every token fed back."""
        return len(self.prompt_ids) + max(len(self.generated) - 1, 0)


class Batcher:
    """The decode batch: admit (prefill + join), step (one forward for all rows), leave."""

    def __init__(self, loaded: LoadedModel, prefix_cache: PrefixCache, emit: Emit,
                 done: Done, *, prefill_chunk: int | None = None, interleave: bool = True,
                 step_token_budget: int | None = None, beside: bool = True) -> None:
        self.loaded = loaded
        self.prefix_cache = prefix_cache
        self._emit = emit
        self._done = done
        self.prefill_chunk = prefill_chunk or default_prefill_chunk(loaded.device)
        # While rows stream, a joining prompt is prefilled in chunks of the step's token budget
        # minus one per streaming row, with a decode step between chunks (interleave=False:
        # the whole prompt in prefill_chunk pieces first, the streams wait). A given budget
        # stays fixed; None adapts it to the measured step and chunk times.
        self.interleave = interleave
        self.adaptive_budget = step_token_budget is None
        self.step_token_budget = step_token_budget or STEP_TOKEN_BUDGET
        # A long prompt joining streaming rows on a CPU is prefilled beside them in a thread on
        # half the cores (engine/side_prefill.py); beside=False keeps it between the steps.
        self.beside = beside
        self.side_prefills = 0
        self._decode_step_s = 0.0  # moving average of a decode step's time
        self.eos_ids = eos_token_ids(loaded)
        self.stops = template_stops(loaded)
        self.rows: list[Row] = []
        self._cache: DynamicCache | None = None
        self._pads: list[int] = []  # left padding of each row in the batched KV
        self.steps = 0
        self.repacks = 0

    @property
    def room(self) -> int:
        return MAX_BATCH - len(self.rows)

    # ----- joining ---------------------------------------------------------------------------
    @torch.inference_mode()
    def admit(self, jobs: Sequence[BatchJob]) -> None:
        """Prefill one request (or one prompt shared by N alternatives) and join the batch.
        A request that ends at its first token (or fails) never joins."""
        first = jobs[0]
        try:
            row, logits = self._prefill(first)
        except Exception as exc:
            for job in jobs:
                self._done(job, None, exc)
            return
        rows = [row] + [self._sibling(job, row, i) for i, job in enumerate(jobs[1:], 1)]
        kv = _layer_kv(row.lease.cache) if row.lease.cache.get_seq_length() else []
        joining: list[tuple[Row, LayerKV]] = []
        for r in rows:
            try:
                self._take_token(r, logits)
            except Exception as exc:
                self._done(r.job, None, exc)
                continue
            if r.finish is None:
                joining.append((r, kv))
            else:
                self._finish(r, None if r is row else kv)
        if joining:
            self._repack(joining)

    def _prefill(self, job: BatchJob) -> tuple[Row, torch.Tensor]:
        request, timeline = job.request, job.timeline
        timeline.prefill_start_ns = now_ns()
        prompt = prepare_prompt(self.loaded, request)
        if request.reuse_cache:
            lease = self.prefix_cache.acquire(request.conversation_id, prompt.ids, prompt.layout)
        else:
            lease = self.prefix_cache.cold_lease(request.conversation_id)
        self._emit(job, PrefillStarted(request.request_id, timeline.prefill_start_ns,
                                       len(prompt.ids), lease.cached_tokens, lease.miss_reason))
        row = self._new_row(job, prompt.ids, lease)
        row.dropped_messages = prompt.dropped_messages
        ids = prompt.ids[lease.cached_tokens :]
        if (self.beside and self.interleave and self.rows
                and can_prefill_beside(self.loaded, len(ids))):
            logits = self._prefill_beside(job, lease, ids)
        else:
            logits = self._prefill_between(job, lease, ids)
        if logits is None:
            return row, torch.empty(0)
        timeline.first_logits_ns = now_ns()
        return row, logits[0]

    def _prefill_between(self, job: BatchJob, lease: CacheLease,
                         ids: list[int]) -> torch.Tensor | None:
        """Prefill ids in chunks here, a decode step of the streaming rows between two chunks;
        the last position's logits, or None if Stop came first (within one chunk)."""
        prefill = ChunkedPrefill(self.loaded, lease, ids, job.request.request_id,
                                 lambda event: self._emit(job, event))
        while not job.cancel.is_set():
            start, streaming = now_ns(), self.interleave and bool(self.rows)
            logits = prefill.step(self._chunk_tokens())
            if logits is not None:
                return logits
            if streaming:
                self._adapt_budget((now_ns() - start) * 1e-9)
                self.step()  # the streaming rows get their next token between two chunks
        return None

    def _prefill_beside(self, job: BatchJob, lease: CacheLease,
                        ids: list[int]) -> torch.Tensor | None:
        """Prefill ids in a side thread on half the cores while the rows keep stepping here
        on the rest; progress as its chunks finish, every core to it once no row streams. The
        last position's logits, or None if Stop came first (within one chunk)."""
        side = SidePrefill(self.loaded, lease, ids, job.request.request_id, self.prefill_chunk,
                           job.cancel)
        self.side_prefills += 1
        threads, plain_step_s = torch.get_num_threads(), self._decode_step_s
        torch.set_num_threads(max(1, threads - side.threads))  # this (the engine) thread's own

        def on_progress() -> None:
            for event in side.progress():
                self._emit(job, event)

        try:
            step_rows_beside(side, lambda: bool(self.rows), self.step, threads, on_progress)
            return side.finish()
        finally:
            side.close()
            torch.set_num_threads(threads)
            self._decode_step_s = plain_step_s  # steps on fewer threads say nothing of the usual

    def _adapt_budget(self, chunk_s: float) -> None:
        """Scale the step's token budget so the next chunk takes about CHUNK_STALL decode
        steps (halfway there each time, so one noisy sample cannot swing it)."""
        if not self.adaptive_budget or self._decode_step_s <= 0 or chunk_s <= 0:
            return
        scale = (CHUNK_STALL * self._decode_step_s / chunk_s) ** 0.5
        lowest = MIN_INTERLEAVED_CHUNK + len(self.rows)
        highest = self.prefill_chunk + len(self.rows)
        self.step_token_budget = max(lowest, min(highest, round(self.step_token_budget * scale)))

    def _chunk_tokens(self) -> int:
        """The next prefill chunk's size: the step's token budget less one token per streaming
        row (Sarathi-Serve's stall-free batching), or a whole chunk when nothing streams."""
        if not (self.interleave and self.rows):
            return self.prefill_chunk
        share = self.step_token_budget - len(self.rows)
        return max(MIN_INTERLEAVED_CHUNK, min(self.prefill_chunk, share))

    def _sibling(self, job: BatchJob, source: Row, index: int) -> Row:
        """An alternative of source's prompt: its prefill is source's (all tokens cached)."""
        timeline, src = job.timeline, source.job.timeline
        timeline.prefill_start_ns, timeline.first_logits_ns = src.prefill_start_ns, \
            src.first_logits_ns
        ids = list(source.prompt_ids)
        conversation = alternative_cache_key(source.lease.conversation_id, index)
        lease = CacheLease(conversation, list(ids), None, len(ids), "none")
        self._emit(job, PrefillStarted(job.request.request_id, timeline.prefill_start_ns,
                                       len(ids), len(ids), "none"))
        row = self._new_row(job, ids, lease)
        row.dropped_messages = source.dropped_messages  # the same prompt, the same turns left out
        return row

    def _new_row(self, job: BatchJob, prompt_ids: list[int], lease: CacheLease) -> Row:
        params = job.request.params
        budget = min(params.max_tokens, self.loaded.info.context_length - len(prompt_ids))
        generator = None if params.greedy else make_generator(params.seed, self.loaded.device)
        return Row(job, prompt_ids, lease, budget, generator,
                   IncrementalDetokenizer(self.loaded.tokenizer),
                   StopMatcher(tuple(params.stop) + self.stops))

    # ----- decoding --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        """Rows cancelled since the last step leave; then one forward over all rows, one
        token each. A forward error fails every row (their leases are not returned)."""
        self._leave([r for r in self.rows if r.job.cancel.is_set()], "cancelled")
        if not self.rows:
            return
        start = now_ns()
        try:
            logits = self._forward()
        except Exception as exc:
            rows, self.rows, self._cache, self._pads = self.rows, [], None, []
            for row in rows:
                self._done(row.job, None, exc)
            return
        self.steps += 1
        failed: list[tuple[Row, BaseException]] = []
        for i, row in enumerate(self.rows):
            try:
                self._take_token(row, logits[i])
            except Exception as exc:
                failed.append((row, exc))
        step_s = (now_ns() - start) * 1e-9
        self._decode_step_s = step_s if not self._decode_step_s else \
            0.7 * self._decode_step_s + 0.3 * step_s
        for row, error in failed:
            self._drop(row)
            self._done(row.job, None, error)
        self._leave([r for r in self.rows if r.finish is not None], None)

    def _forward(self) -> torch.Tensor:
        """One decode step for every row: each feeds its last token at its own position."""
        device = self.loaded.device
        input_ids = torch.tensor([[r.generated[-1]] for r in self.rows], device=device)
        positions = torch.tensor([[r.kv_len] for r in self.rows], device=device)
        mask = None
        assert self._cache is not None  # rows have joined
        if any(self._pads):
            length = self._cache.get_seq_length() + 1
            pads = torch.tensor(self._pads, device=device)
            mask = (torch.arange(length, device=device)[None, :] >= pads[:, None]).long()
        out = self.loaded.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                cache=self._cache, use_cache=True, logits_to_keep=1)
        logits: torch.Tensor = out.logits[:, -1]
        _sync(logits)
        return logits

    def _take_token(self, row: Row, logits: torch.Tensor) -> None:
        """Sample and emit one token for row; set row.finish if the reply ends here."""
        if not row.generated and (row.job.cancel.is_set() or not logits.numel()):
            row.finish = "cancelled"  # stopped before its prefill ran
            return
        params = row.request.params
        seen = row.prompt_ids + row.generated if params.repetition_penalty != 1.0 else ()
        token = sample_token(logits, params, row.generator, seen)
        self._maybe_snapshot(row, logits, token)
        row.generated.append(token)
        row.finish = self._emit_text(row, token)
        if row.finish is None and len(row.generated) >= row.budget:
            row.finish = "length"
        if row.finish is None and row.job.cancel.is_set():
            row.finish = "cancelled"

    def _emit_text(self, row: Row, token: int) -> FinishReason | None:
        text, ends = token_text(token, self.eos_ids, row.request.params.ignore_eos, row.detok,
                                row.stopper)
        self._emit(row.job, token_event(row.request.request_id, row.job.timeline, token, text))
        return "stop" if ends else None

    def _maybe_snapshot(self, row: Row, logits: torch.Tensor, token: int) -> None:
        """The sampler's view of this token, throttled per row to ~10 per second."""
        t = now_ns()
        if row.generated and t - row.last_snapshot_ns < SNAPSHOT_INTERVAL_NS:
            return
        row.last_snapshot_ns = t
        self._emit(row.job, sampler_snapshot(self.loaded.tokenizer, row.request, logits, token,
                                             len(row.generated), t))

    # ----- leaving ---------------------------------------------------------------------------
    def _leave(self, leaving: list[Row], reason: FinishReason | None) -> None:
        """Finished rows hand their KV back to the prefix cache; the rest are re-packed."""
        if not leaving:
            return
        gone = {id(r) for r in leaving}
        kept: list[tuple[Row, LayerKV]] = []
        for i, row in enumerate(self.rows):
            kv = self._row_kv(i)
            if id(row) in gone:
                row.finish = row.finish or reason
                self._finish(row, None if row.lease.cache is self._cache else kv)
            else:
                kept.append((row, kv))
        self.rows, self._cache, self._pads = [], None, []
        if kept:
            self._repack(kept)

    def _drop(self, row: Row) -> None:
        """Remove a failed row without returning its KV to the prefix cache."""
        i = self.rows.index(row)
        kept = [(r, self._row_kv(j)) for j, r in enumerate(self.rows) if j != i]
        self.rows, self._cache, self._pads = [], None, []
        if kept:
            self._repack(kept)

    def _finish(self, row: Row, kv: LayerKV | None) -> None:
        """Return the row's KV (exactly prompt + fed tokens) to the prefix cache, report.

        kv None: the row's own lease cache holds its KV (it never shared a batch, or held
        the batch alone). An alternative that ended at its first token has nothing of its
        own to return."""
        length = row.kv_len
        if kv is not None and kv:
            layers = [(k[:, :, :length].clone(), v[:, :, :length].clone()) for k, v in kv]
            row.lease.cache = _build_cache(self.loaded, layers)
        if row.lease.cache is not None:
            crop_to(row.lease.cache, length)
            row.lease.ids = (row.prompt_ids + row.generated)[: row.lease.cache.get_seq_length()]
            self.prefix_cache.release(row.lease)
        self._done(row.job, self._result(row), None)

    def _result(self, row: Row) -> GenerationResult:
        request, timeline = row.request, row.job.timeline
        finish: FinishReason = row.finish or "length"
        if finish != "stop":
            tail = row.stopper.feed(row.detok.flush()) + row.stopper.flush()
            if tail:
                self._emit(row.job, TextFlushed(request.request_id, now_ns(), tail))
        timeline.done_ns = now_ns()
        metrics = compute_metrics(
            timeline,
            prompt_tokens=len(row.prompt_ids),
            cached_tokens=row.lease.cached_tokens,
            parameters=self.loaded.info.parameters,
            weight_bytes_per_step=self.loaded.info.weight_bytes_per_step,
            cache_miss_reason=row.lease.miss_reason,
        )
        return GenerationResult(
            request_id=request.request_id, text=row.stopper.emitted, finish_reason=finish,
            token_ids=list(row.generated), prompt_token_ids=row.prompt_ids, metrics=metrics,
            model=self.loaded.info, dropped_messages=row.dropped_messages,
        )

    # ----- the batched KV ----------------------------------------------------------------------
    def _row_kv(self, i: int) -> LayerKV:
        """Row i's KV with its left padding stripped (views into the batch)."""
        pad = self._pads[i]
        return [(k[i : i + 1, :, pad:], v[i : i + 1, :, pad:]) for k, v in _layer_kv(self._cache)]

    def _repack(self, joining: list[tuple[Row, LayerKV]]) -> None:
        """Rebuild the batched KV from the current rows plus `joining`, left-padded to the
        longest row (the common padding is dropped). A lone unpadded row keeps its cache."""
        entries = [(r, self._row_kv(i)) for i, r in enumerate(self.rows)] + joining
        self.rows = [r for r, _ in entries]
        lengths = [r.kv_len for r in self.rows]
        longest = max(lengths)
        self._pads = [longest - n for n in lengths]
        self.repacks += 1
        if len(entries) == 1:
            row, kv = entries[0]
            if row.lease.cache is None or row.lease.cache.get_seq_length() != longest:
                row.lease.cache = _build_cache(
                    self.loaded, [(k[:, :, :longest].clone(), v[:, :, :longest].clone())
                                  for k, v in kv])
            self._cache = row.lease.cache
            return
        layers = []
        for layer in range(len(entries[0][1])):
            keys = [_left_pad(kv[layer][0][:, :, :n], longest - n)
                    for (_, kv), n in zip(entries, lengths, strict=True)]
            values = [_left_pad(kv[layer][1][:, :, :n], longest - n)
                      for (_, kv), n in zip(entries, lengths, strict=True)]
            layers.append((torch.cat(keys), torch.cat(values)))
        self._cache = _build_cache(self.loaded, layers)
        for row in self.rows:  # their KV lives in the batch now; free the prefill copies
            row.lease.cache = None


def _left_pad(t: torch.Tensor, pad: int) -> torch.Tensor:
    return F.pad(t, (0, 0, pad, 0)) if pad else t


def _layer_kv(cache: Any) -> LayerKV:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _build_cache(loaded: LoadedModel, layers: LayerKV) -> DynamicCache:
    cache = new_cache(loaded.model.config)
    for i, (keys, values) in enumerate(layers):
        cache.update(keys, values, i)
    return cache


def _sync(t: torch.Tensor) -> None:
    """Stamps must mean 'the logits exist': wait for the GPU's queued work."""
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
