"""A long prompt prefilled beside the streaming rows: its own llama.cpp context and thread.

Fed in the rows' own steps, a prompt pays per token the cost of a step over a long context:
on the Xeon VM a 1-token chunk at 4,000 tokens of context cost about 2.5 decode steps, so the
rows' ITL tripled while the prompt crawled (24 tok/s against 116 alone). Here the prompt goes
in large chunks through a second context over the same weights (the llama_model is shared
read-only; each context has its own KV memory, batch and threads), in a thread of its own,
while the engine thread keeps decoding the rows on the other cores: prefill and decode
disaggregated (as in DistServe and Splitwise) across one machine's cores. ctypes releases the
GIL for each llama_decode, so the two run at once. When the prompt is in, its sequence's KV is
copied onto the lease's sequence of the main context (llama_state_seq_get/set_data) and the
request joins the batch. The engine thread owns the object, the main context and the prefix
cache (docs/architecture.md, "Threads"); the side thread (`work`) touches only its own context
and the model's read-only weights, and every event and clock stamp is still the engine thread's.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import numpy as np
import torch

from engine.core.ledger import CacheLease
from engine.core.memory import free_memory
from engine.core.schedule import FIRST_SIDE_CHUNK, SIDE_MIN_TOKENS, next_side_chunk
from engine.core.side_thread import SideWorker
from engine.errors import PhasewiseError
from engine.runtimes.llamacpp.decode import ABORTED, BatchWriter, prefill_meter
from engine.runtimes.llamacpp.model import LlamaCppModel
from engine.runtimes.llamacpp.prefix_pool import KvFullError, SeqPrefixCache

CONTEXT_PAD = 256  # the side context's tokens, rounded up (as llama.cpp pads n_ctx)
SIDE_SEQ = 0
WORK_BYTES = 64 << 20  # the side context's compute buffers and logits, roughly


def side_threads(loaded: LlamaCppModel) -> int:
    """Threads the side context gets (the rows keep the rest); 0 where there is one core."""
    return loaded.n_threads // 2


def side_context_bytes(loaded: LlamaCppModel, tokens: int) -> int:
    """Memory a side prefill of `tokens` (cached prefix included) takes at its peak: its KV
    memory, the copy of it on its way to the main context, and compute buffers."""
    return 2 * loaded.kv_bytes_per_token * _padded(tokens) + WORK_BYTES


def can_prefill_beside(loaded: LlamaCppModel, total_tokens: int, new_tokens: int) -> bool:
    """Whether a prompt of new_tokens (total_tokens with its cached prefix) should go beside:
    long enough to be worth a context, two cores or more, and memory to spare for it."""
    if new_tokens < SIDE_MIN_TOKENS or side_threads(loaded) < 1:
        return False
    free = free_memory("cpu")
    return free is None or side_context_bytes(loaded, total_tokens) <= free // 2


def set_threads(loaded: LlamaCppModel, ctx: Any, threads: int) -> None:
    loaded.llama_cpp.llama_set_n_threads(ctx, threads, threads)


def _padded(tokens: int) -> int:
    return -(-(tokens + 1) // CONTEXT_PAD) * CONTEXT_PAD


class SidePrefill(SideWorker):
    """Prefill `ids` after `lease`'s cached prefix on a side context, in a thread (see
    engine.core.side_thread); then `finish` moves the KV to the lease's sequence."""

    def __init__(self, loaded: LlamaCppModel, lease: CacheLease, ids: list[int],
                 cancel: threading.Event) -> None:
        super().__init__(side_threads(loaded), cancel)
        self.loaded, self.lease, self.ids = loaded, lease, ids
        self.done = 0  # tokens of ids in the side context (written by the side thread)
        # The chunk under way: (its first token, its size, how far through the model it is),
        # written by the side thread as it goes, for the engine thread's progress.
        self.reading: tuple[int, int, float] = (0, 0, 0.0)
        self._logits: torch.Tensor | None = None
        self._ctx = self._new_context(len(lease.ids) + len(ids))
        try:
            if lease.ids:
                self._copy_seq(loaded.ctx, lease.cache, self._ctx, SIDE_SEQ)
        except BaseException:
            self.close()
            raise

    # ----- the side thread -------------------------------------------------------------------
    def set_threads(self, threads: int) -> None:
        set_threads(self.loaded, self._ctx, threads)

    def work(self) -> None:
        lib, n_batch = self.loaded.llama_cpp, self.loaded.n_batch
        batch = lib.llama_batch_init(n_batch, 0, 1)
        try:
            self._feed(BatchWriter(batch, n_batch))
        finally:
            lib.llama_batch_free(batch)

    def _feed(self, writer: BatchWriter) -> None:
        lib, ids = self.loaded.llama_cpp, self.ids
        # A small first chunk on fewer threads: the first progress comes soon; then the clock.
        start, step = len(self.lease.ids), FIRST_SIDE_CHUNK
        while self.done < len(ids) and not self.stopped:
            self.before_chunk()
            begin, end = self.done, min(len(ids), self.done + step)
            last = end == len(ids)
            writer.fill(ids[begin:end], range(start + begin, start + end),
                        [SIDE_SEQ] * (end - begin),
                        [last and i == end - 1 for i in range(begin, end)])
            began = time.perf_counter()
            meter = prefill_meter(self.loaded, self._ctx, self._now_reading, begin, end - begin,
                                  lambda: self.stopped)
            code = meter.decode(writer.batch)
            if code == ABORTED:
                return  # Stop, or the engine gave up: inside the chunk
            if code != 0:
                raise PhasewiseError(f"llama.cpp failed to decode a batch (code {code})")
            if last:
                pointer = lib.llama_get_logits(self._ctx)
                row = np.ctypeslib.as_array(pointer, shape=(self.loaded.n_vocab,))
                self._logits = torch.from_numpy(row.copy())
            step = next_side_chunk(end - begin, time.perf_counter() - began, self.loaded.n_batch)
            self.done = end

    def _now_reading(self, begin: int, size: int, fraction: float) -> None:
        self.reading = (begin, size, fraction)  # one assignment: the engine thread reads it

    # ----- back on the engine thread ---------------------------------------------------------
    def finish(self, pool: SeqPrefixCache) -> torch.Tensor | None:
        """After the thread ended: move the prompt's KV onto the lease's sequence (the lease's
        ids follow) and return the last position's logits; None if Stop came first. A stopped
        prompt's whole chunks read so far move over too, so that the chat's prefix cache keeps
        them and a Regenerate reads only the rest (as a prompt stopped on the main context)."""
        self.check()
        stopped = self._logits is None
        read = self.done if stopped else len(self.ids)
        if not read:
            return None
        while not self._copy_seq(self._ctx, SIDE_SEQ, self.loaded.ctx, self.lease.cache,
                                 must_fit=False):
            if pool.evict_oldest(keep=self.lease.conversation_id):
                continue
            if stopped:  # keep nothing rather than fail a Stop; the failed copy emptied it
                self.lease.ids.clear()
                return None
            raise KvFullError(
                f"the KV cache is full ({self.loaded.info.context_length} tokens shared "
                "by the running replies): wait for one to finish, or load a larger context")
        self.lease.ids.extend(self.ids[:read])
        return self._logits

    def close(self) -> None:
        """Stop the thread (after its current chunk) and free the side context."""
        super().close()
        if self._ctx is not None:
            self.loaded.llama_cpp.llama_free(self._ctx)
            self._ctx = None

    def _new_context(self, tokens: int) -> Any:
        lib, main = self.loaded.llama_cpp, self.loaded.context_params
        params = type(main).from_buffer_copy(main)  # same kernels, KV types and attention
        params.n_ctx = _padded(tokens)
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = self.threads
        ctx = lib.llama_init_from_model(self.loaded.model, params)
        if not ctx:
            raise KvFullError(f"no memory for a {params.n_ctx}-token side context")
        return ctx

    def _copy_seq(self, src_ctx: Any, src: int, dst_ctx: Any, dst: int,
                  must_fit: bool = True) -> bool:
        """Copy sequence src of src_ctx onto sequence dst of dst_ctx (replacing it). False when
        dst_ctx has no room for it in one run of cells (unless must_fit: then it raises)."""
        lib = self.loaded.llama_cpp
        size = lib.llama_state_seq_get_size(src_ctx, src)
        buffer = np.empty(size, dtype=np.uint8)
        pointer = buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        written = lib.llama_state_seq_get_data(src_ctx, pointer, size, src)
        if lib.llama_state_seq_set_data(dst_ctx, pointer, written, dst):
            return True
        if must_fit:
            raise KvFullError(f"no room for {len(self.lease.ids)} cached tokens in a side "
                              "context")
        return False
