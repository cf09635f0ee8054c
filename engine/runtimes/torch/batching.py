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

from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.core.batch import BatchCore, Done, Emit, alternative_cache_key
from engine.core.ledger import CacheLease
from engine.core.reply import Reply, ReplyJob, open_reply, sibling_reply
from engine.core.schedule import (
    CHUNK_STALL,
    MIN_INTERLEAVED_CHUNK,
    STEP_TOKEN_BUDGET,
)
from engine.core.side_thread import step_rows_beside
from engine.events import FinishReason
from engine.metrics import now_ns
from engine.runtimes.torch.generate import ChunkedPrefill, default_prefill_chunk, torch_vocabulary
from engine.runtimes.torch.loader import LoadedModel
from engine.runtimes.torch.prefix_cache import (
    LayerKV,
    PrefixCache,
    attention_only,
    build_cache,
    crop_to,
    layer_kv,
    new_cache,
)
from engine.runtimes.torch.side_prefill import SidePrefill, can_prefill_beside

if TYPE_CHECKING:  # transformers is not imported at run time here: the llama.cpp batcher
    from transformers import DynamicCache  # imports this module and never needs it



def cache_supports_batching(loaded: LoadedModel) -> bool:
    """Only plain full-size attention layers (sliding-window ones included, see new_cache) can
    be padded and concatenated row-wise."""
    return attention_only(new_cache(loaded.model.config))


class Batcher(BatchCore):
    """The core's decode batch on torch: a joining prompt prefilled in chunks between the rows'
    steps (or beside them), the rows' KV one left-padded cache re-packed on join and leave."""

    def __init__(self, loaded: LoadedModel, prefix_cache: PrefixCache, emit: Emit,
                 done: Done, *, prefill_chunk: int | None = None, interleave: bool = True,
                 step_token_budget: int | None = None, beside: bool = True) -> None:
        super().__init__(prefix_cache, emit, done)
        self.loaded = loaded
        self.prefill_chunk = prefill_chunk or default_prefill_chunk(loaded.device)
        # While rows stream, a joining prompt is prefilled in chunks of the step's token budget
        # minus one per streaming row, with a decode step between chunks (interleave=False:
        # the whole prompt in prefill_chunk pieces first, the streams wait). A given budget
        # stays fixed; None adapts it to the measured step and chunk times.
        self.interleave = interleave
        self.adaptive_budget = step_token_budget is None
        self.step_token_budget = step_token_budget or STEP_TOKEN_BUDGET
        # A long prompt joining streaming rows on a CPU is prefilled beside them in a thread on
        # half the cores (engine/runtimes/torch/side_prefill.py); beside=False keeps it between the
        # steps.
        self.beside = beside
        self.vocab = torch_vocabulary(loaded)
        self._cache: DynamicCache | None = None
        self._pads: list[int] = []  # left padding of each row in the batched KV
        self.repacks = 0

    # ----- joining ---------------------------------------------------------------------------
    def _open(self, job: ReplyJob) -> Reply:
        return open_reply(self.loaded, self.prefix_cache, job, self.vocab,
                          partial(self._emit, job))

    def _read_prompt(self, reply: Reply, ids: list[int]) -> torch.Tensor | None:
        job, lease = reply.job, reply.lease
        if (self.beside and self.interleave and self.rows
                and can_prefill_beside(self.loaded, len(ids))):
            logits = self._prefill_beside(job, lease, ids)
        else:
            logits = self._prefill_between(job, lease, ids)
        return None if logits is None else logits[0]

    def _prefill_between(self, job: ReplyJob, lease: CacheLease,
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

    def _prefill_beside(self, job: ReplyJob, lease: CacheLease,
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

    def _sibling(self, job: ReplyJob, source: Reply, index: int) -> Reply:
        """An alternative of source's prompt: its prefill is source's (it shares source's KV
        until the batch is re-packed)."""
        conversation = alternative_cache_key(source.lease.conversation_id, index)
        ids = list(source.prompt_ids)
        lease = CacheLease(conversation, ids, None, len(ids), "none")
        return sibling_reply(job, source, lease, partial(self._emit, job))

    def _join(self, joining: list[Reply], ended: list[Reply], source: Reply) -> None:
        """Alternatives share source's prefill KV: each joins (or ends) with a view of it."""
        kv = layer_kv(source.lease.cache) if source.lease.cache.get_seq_length() else []
        for reply in ended:
            self._finish(reply, None if reply is source else kv)
        if joining:
            self._repack([(reply, kv) for reply in joining])

    # ----- decoding --------------------------------------------------------------------------
    def _forward_rows(self) -> torch.Tensor:
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

    # ----- leaving ---------------------------------------------------------------------------
    def _leave(self, leaving: list[Reply], reason: FinishReason | None) -> None:
        """Finished rows hand their KV back to the prefix cache; the rest are re-packed."""
        if not leaving:
            return
        gone = {id(r) for r in leaving}
        kept: list[tuple[Reply, LayerKV]] = []
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

    def _clear_batch(self) -> None:
        self._cache, self._pads = None, []

    def _drop(self, row: Reply) -> None:
        """Remove a failed row without returning its KV to the prefix cache."""
        i = self.rows.index(row)
        kept = [(r, self._row_kv(j)) for j, r in enumerate(self.rows) if j != i]
        self.rows, self._cache, self._pads = [], None, []
        if kept:
            self._repack(kept)

    def _finish(self, row: Reply, kv: LayerKV | None) -> None:
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
        self._report(row)

    # ----- the batched KV ----------------------------------------------------------------------
    def _row_kv(self, i: int) -> LayerKV:
        """Row i's KV with its left padding stripped (views into the batch)."""
        pad = self._pads[i]
        return [(k[i : i + 1, :, pad:], v[i : i + 1, :, pad:]) for k, v in layer_kv(self._cache)]

    def _repack(self, joining: list[tuple[Reply, LayerKV]]) -> None:
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


def _build_cache(loaded: LoadedModel, layers: LayerKV) -> DynamicCache:
    return build_cache(loaded.model.config, layers)


def _sync(t: torch.Tensor) -> None:
    """Stamps must mean 'the logits exist': wait for the GPU's queued work."""
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
