"""One llama_decode over a batch of (token, position, sequence) rows, with KV-full recovery.

The batch is allocated once per model (llama_batch_init) and written through numpy views of
its arrays. When llama.cpp finds no free KV cell (return code 1; the memory is left as it
was) the least recently used cached prefix is evicted and the decode retried.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from engine.errors import PhasewiseError
from engine.events import PrefillProgress
from engine.llamacpp.model import LlamaCppModel
from engine.llamacpp.prefix_pool import KvFullError, SeqPrefixCache
from engine.prefill_eta import PrefillClock
from engine.prefix_cache import CacheLease
from engine.side_thread import chunk_for

NO_KV_SLOT = 1
# A prompt prefilled with no other row in its batches: chunks sized so progress and Stop come
# at least this often (an n_batch of 512 took 2.5-5 s on the Xeon VM), from FIRST_LONE_CHUNK
# tokens, then as many as the last chunk's rate runs in that time, never under MIN_LONE_CHUNK.
LONE_CHUNK_S = 0.4
FIRST_LONE_CHUNK = 128
MIN_LONE_CHUNK = 64


def next_lone_chunk(loaded: LlamaCppModel, tokens: int, seconds: float) -> int:
    """The next lone prefill chunk after one of `tokens` took `seconds`."""
    if seconds <= 0:
        return min(FIRST_LONE_CHUNK, loaded.n_batch)
    return chunk_for(tokens, seconds, LONE_CHUNK_S, MIN_LONE_CHUNK, loaded.n_batch)


class BatchWriter:
    """Numpy views over a llama_batch's arrays (no per-token ctypes calls except seq ids)."""

    def __init__(self, batch: Any, n: int) -> None:
        """batch: a llama_batch from llama_batch_init(n, 0, seqs)."""
        self.batch = batch
        self.capacity = n
        self.token = np.ctypeslib.as_array(batch.token, shape=(n,))
        self.pos = np.ctypeslib.as_array(batch.pos, shape=(n,))
        self.n_seq_id = np.ctypeslib.as_array(batch.n_seq_id, shape=(n,))
        self.logits = np.ctypeslib.as_array(batch.logits, shape=(n,))
        self._seq_rows = [batch.seq_id[i] for i in range(n)]

    def fill(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int],
             outputs: Sequence[bool]) -> None:
        n = len(tokens)
        if n > self.capacity:
            raise ValueError(f"{n} tokens exceed the batch of {self.capacity}")
        self.token[:n] = tokens
        self.pos[:n] = positions
        self.n_seq_id[:n] = 1
        self.logits[:n] = outputs
        rows = self._seq_rows
        for i, seq in enumerate(seqs):
            rows[i][0] = seq
        self.batch.n_tokens = n


def writer_for(loaded: LlamaCppModel) -> BatchWriter:
    """The model's batch writer, kept on the model (freed with its batch)."""
    if loaded.batch_writer is None:
        loaded.batch_writer = BatchWriter(loaded.batch, loaded.n_batch)
    writer: BatchWriter = loaded.batch_writer
    return writer


def decode(loaded: LlamaCppModel, pool: SeqPrefixCache, tokens: Sequence[int],
           positions: Sequence[int], seqs: Sequence[int], outputs: Sequence[bool]) -> None:
    """Run one batch (at most loaded.n_batch tokens) through the model."""
    writer_for(loaded).fill(tokens, positions, seqs, outputs)
    lib = loaded.llama_cpp
    while True:
        code = lib.llama_decode(loaded.ctx, loaded.batch)
        if code == 0:
            return
        if code == NO_KV_SLOT and pool.evict_oldest():
            continue
        if code == NO_KV_SLOT:
            raise KvFullError(
                f"the KV cache is full ({loaded.info.context_length} tokens shared by the "
                "running replies): wait for one to finish, or load a larger context")
        raise PhasewiseError(f"llama.cpp failed to decode a batch (code {code})")


def feed(loaded: LlamaCppModel, pool: SeqPrefixCache, lease: CacheLease, ids: Sequence[int],
         rows: int = 1, cancel: threading.Event | None = None,
         on_batch: Callable[[int], None] | None = None) -> bool:
    """Append ids to the lease's sequence, in batches from the first token (as
    llama-cpp-python's Llama.eval splits them; a prefill that reports progress, in lone chunks
    of about LONE_CHUNK_S), with logits for the last `rows` tokens; the lease's ids follow each
    batch, on_batch hears how many ids are in. False if cancel was set between two batches."""
    n = len(ids)
    if not 1 <= rows <= n:
        raise ValueError(f"need 1 <= rows <= {n}")
    step = loaded.n_batch if on_batch is None else next_lone_chunk(loaded, 0, 0.0)
    begin = 0
    while begin < n:
        if begin and cancel is not None and cancel.is_set():
            return False
        chunk = list(ids[begin : begin + step])
        end = begin + len(chunk)
        if end == n and len(chunk) < rows:
            raise ValueError("the logits rows straddle two batches")
        start, began = len(lease.ids), time.perf_counter()
        outputs = [i >= n - rows for i in range(begin, end)]
        decode(loaded, pool, chunk, range(start, start + len(chunk)),
               [lease.cache] * len(chunk), outputs)
        lease.ids.extend(chunk)
        if on_batch is not None:
            step = next_lone_chunk(loaded, len(chunk), time.perf_counter() - began)
            on_batch(end)
        begin = end
    return True


def prefill_reporter(request_id: str, total: int, emit: Callable[[PrefillProgress], None]
                     ) -> Callable[[int], None]:
    """An on_batch for feed that emits PrefillProgress (rate so far, time left: see
    engine.prefill_eta)."""
    clock = PrefillClock(total, time.perf_counter_ns())

    def report(done: int) -> None:
        t = time.perf_counter_ns()
        rate, left_s = clock.tick(done, t)
        emit(PrefillProgress(request_id, t, done, total, rate, left_s))

    return report
