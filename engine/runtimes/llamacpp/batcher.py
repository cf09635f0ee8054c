"""Continuous batching on llama.cpp: each row is a KV sequence, one llama_batch per step.

A joining request is prefilled on its own lease's sequence in chunks. While rows stream, a
long prompt is prefilled beside them, on a side context in a thread of its own with part of
the cores (side_prefill), and joins when its KV is copied over; a short one (or one without
the cores or memory for that) rides in their decode steps (Sarathi-Serve's stall-free
batching): one llama_decode holds every row's next token and a chunk of the prompt, sized by
the clock so the step takes about STEP_STALL plain decode steps. Once joined, each step puts every
row's last token, at its own position on its own sequence, into one llama_decode. Nothing is
re-packed when rows join or leave: a leaving row's sequence goes back to the prefix cache as it
is. N alternatives of one prompt share one prefill: the others' sequences are seq_cp copies of
the first (cells shared), each samples with its own generator. Runs only on the engine thread;
the worker drives it like engine/runtimes/torch/batching.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from engine.core.batch import Done, Emit, OwnKvBatch, alternative_cache_key
from engine.core.ledger import CacheLease
from engine.core.prefill_progress import PrefillReporter
from engine.core.reply import Reply, ReplyJob, open_reply, sibling_reply
from engine.core.schedule import FIRST_MIXED_CHUNK, STEP_STALL
from engine.core.side_thread import step_rows_beside
from engine.metrics import now_ns
from engine.runtimes.llamacpp.decode import decode, lone_chunk, prefill_meter
from engine.runtimes.llamacpp.graph_meter import GraphMeter
from engine.runtimes.llamacpp.model import LlamaCppModel
from engine.runtimes.llamacpp.prefix_pool import SeqPrefixCache
from engine.runtimes.llamacpp.session import llama_vocabulary
from engine.runtimes.llamacpp.side_prefill import SidePrefill, can_prefill_beside, set_threads


def _clamp(value: int, lowest: int, highest: int) -> int:
    return max(lowest, min(highest, value))


class LlamaBatcher(OwnKvBatch):
    """The core's decode batch on llama.cpp: each row a KV sequence, one llama_decode per step
    (a joining prompt's chunks riding in it, or beside it), nothing re-packed."""

    prefix_cache: SeqPrefixCache

    def __init__(self, loaded: LlamaCppModel, prefix_cache: SeqPrefixCache, emit: Emit,
                 done: Done, *, interleave: bool = True, beside: bool = True,
                 lone_chunk: int | None = None, mixed_chunk: int | None = None) -> None:
        super().__init__(prefix_cache, emit, done)
        self.loaded = loaded
        self.vocab = llama_vocabulary(loaded)
        self.drafts_in_batch = loaded.can_roll_back  # a rejected draft is cut with seq_rm
        self.mixed_steps = 0
        # interleave=False: a joining prompt is prefilled whole while the rows wait (the
        # baseline of bench --interference). Chunk sizes given here stay fixed (tests); else
        # a mixed chunk follows the clock and a lone one is decode.lone_chunk.
        self.interleave = interleave
        self.beside = beside  # False: long prompts ride in the rows' steps too (bench, tests)
        self._fixed_lone = None if lone_chunk is None else min(lone_chunk, loaded.n_batch)
        self._fixed_mixed = mixed_chunk is not None
        self._mixed_chunk = float(mixed_chunk or FIRST_MIXED_CHUNK)  # fractional: grows smoothly

    # ----- joining ---------------------------------------------------------------------------
    def _open(self, job: ReplyJob) -> Reply:
        return open_reply(self.loaded, self.prefix_cache, job, self.vocab, partial(self._emit, job))

    def _read_prompt(self, reply: Reply, ids: list[int]) -> torch.Tensor | None:
        report = PrefillReporter(reply.request.request_id, len(ids), reply.emit)
        return self._feed_prompt(reply.job, reply.lease, ids, report)

    def _feed_prompt(self, job: ReplyJob, lease: CacheLease, ids: list[int],
                     report: PrefillReporter) -> torch.Tensor | None:
        """Feed ids onto the lease's sequence a chunk per llama_decode, each riding in the
        streaming rows' step (with none streaming, a lone chunk: progress and Stop within it
        too); progress after each. The last position's logits (a copy), or None if Stop came.
        A long prompt while rows stream goes beside them instead (_feed_beside)."""
        if (self.interleave and self.beside and self.rows
                and can_prefill_beside(self.loaded, len(lease.ids) + len(ids), len(ids))):
            return self._feed_beside(job, lease, ids, report)
        done, logits = 0, None
        while done < len(ids):
            if job.cancel.is_set():
                return None
            self._leave([r for r in self.rows if r.job.cancel.is_set()], "cancelled")
            mixed = self.interleave and bool(self.rows)
            if mixed and not (self._decode_step_s or self._fixed_mixed):
                self.step()  # a timed plain step: what a mixed chunk is sized against
                continue
            room = self.loaded.n_batch - len(self.rows)
            size = _clamp(round(self._mixed_chunk) if mixed
                          else self._fixed_lone or lone_chunk(self.loaded), 1, room)
            chunk = ids[done : done + size]
            last = done + len(chunk) == len(ids)
            if not mixed:
                meter = prefill_meter(self.loaded, self.loaded.ctx, report.within, done, len(chunk),
                                      job.cancel.is_set)
                if not self._lone_step(chunk, lease, last, meter):
                    return None  # Stop, inside the chunk
                logits = self.loaded.logits(1)[0].clone() if last else None
            else:
                start = now_ns()
                logits = self._mixed_step(chunk, lease, last)
                if not last:  # a final, shorter chunk says little about the next prompt's
                    self._size_mixed_chunk(len(chunk), (now_ns() - start) * 1e-9)
            done += len(chunk)
            report.chunk_done(done)
        return logits

    def _lone_step(self, chunk: Sequence[int], lease: CacheLease, last: bool,
                   meter: GraphMeter) -> bool:
        """One lone chunk of a prompt on the lease's sequence (logits for its final token when
        `last`); False if the meter stopped it (the sequence is as it was)."""
        start = len(lease.ids)
        if not decode(self.loaded, self.prefix_cache, chunk,
                      range(start, start + len(chunk)), [lease.cache] * len(chunk),
                      [last and i == len(chunk) - 1 for i in range(len(chunk))], meter):
            return False
        lease.ids.extend(chunk)
        return True

    def _feed_beside(self, job: ReplyJob, lease: CacheLease, ids: list[int],
                     report: PrefillReporter) -> torch.Tensor | None:
        """Feed ids on a side context while the rows keep stepping here on the other cores;
        progress as its chunks go (and within each), every core to it once no row streams. The
        logits (a copy), or None if Stop came first."""
        side = SidePrefill(self.loaded, lease, ids, job.cancel)
        self.side_prefills += 1
        plain_step_s = self._decode_step_s  # steps on fewer threads say nothing of the usual
        main_threads = self.loaded.n_threads - side.threads
        set_threads(self.loaded, self.loaded.ctx, main_threads)
        # The sampler's torch ops too: their intra-op workers would take the side's cores.
        torch_threads = torch.get_num_threads()
        torch.set_num_threads(max(1, min(torch_threads, main_threads)))
        reported = 0

        def on_progress() -> None:
            nonlocal reported
            if side.done > reported:
                reported = side.done
                report.chunk_done(reported)
            else:
                report.within(*side.reading)

        try:
            step_rows_beside(side, lambda: bool(self.rows), self.step, self.loaded.n_threads,
                             on_progress)
            return side.finish(self.prefix_cache)
        finally:
            side.close()
            set_threads(self.loaded, self.loaded.ctx, self.loaded.n_threads)
            torch.set_num_threads(torch_threads)
            self._decode_step_s = plain_step_s

    def _size_mixed_chunk(self, tokens: int, step_s: float) -> None:
        """Scale the next mixed chunk so its step takes about STEP_STALL plain decode steps
        (halfway there each time in log scale, so one noisy step cannot swing it)."""
        if self._fixed_mixed or self._decode_step_s <= 0 or step_s <= 0:
            return
        scale = (STEP_STALL * self._decode_step_s / step_s) ** 0.5
        self._mixed_chunk = max(1.0, min(float(self.loaded.n_batch), tokens * scale))

    def _sibling(self, job: ReplyJob, source: Reply, index: int) -> Reply:
        """An alternative of source's prompt: its sequence is a copy of source's prefill."""
        key = alternative_cache_key(source.lease.conversation_id, index)
        lease = self.prefix_cache.lease_for(key, list(source.lease.ids))
        self.loaded.llama_cpp.llama_memory_seq_cp(self.loaded.memory, source.lease.cache,
                                                  lease.cache, -1, -1)
        return sibling_reply(job, source, lease, partial(self._emit, job))

    # ----- decoding --------------------------------------------------------------------------
    def _forward_rows(self) -> torch.Tensor:
        self._decode()
        return self.loaded.logits(sum(1 + len(r.draft) for r in self.rows))

    def _mixed_step(self, chunk: Sequence[int], lease: CacheLease, last: bool
                    ) -> torch.Tensor | None:
        """One llama_decode of the rows' tokens and a chunk of a joining prompt: the rows take
        their tokens; the prompt's final logits (a copy) when `last`. A decode error fails
        every row and is raised for the prompt."""
        try:
            self._decode(chunk, lease, last)
        except Exception as exc:
            self._fail_all(exc)
            raise
        logits = self.loaded.logits(len(self.rows) + (1 if last else 0))
        prompt_logits = logits[len(self.rows)].clone() if last else None
        self.steps += 1
        self.mixed_steps += 1
        self._settle(self._take_tokens(logits))
        return prompt_logits

    def _decode(self, chunk: Sequence[int] = (), lease: CacheLease | None = None,
                last: bool = False) -> None:
        """One llama_decode: each row's last token and its draft from its own position on its
        own sequence (logits for each), plus a chunk of a joining prompt on lease's sequence
        (logits for its final token when `last`)."""
        fed = [[r.generated[-1], *r.draft] for r in self.rows]
        tokens = [t for ids in fed for t in ids]
        positions = [p for r, ids in zip(self.rows, fed, strict=True)
                     for p in range(r.kv_len, r.kv_len + len(ids))]
        seqs = [r.lease.cache for r, ids in zip(self.rows, fed, strict=True) for _ in ids]
        start = len(lease.ids) if lease is not None else 0
        decode(self.loaded, self.prefix_cache, tokens + list(chunk),
               positions + list(range(start, start + len(chunk))),
               seqs + [lease.cache if lease else 0] * len(chunk),
               [True] * len(tokens) + [last and i == len(chunk) - 1 for i in range(len(chunk))])
        for row, ids in zip(self.rows, fed, strict=True):
            row.lease.ids.extend(ids)
        if lease is not None:
            lease.ids.extend(chunk)

    # ----- leaving ---------------------------------------------------------------------------
