"""One llama_decode over a batch of (token, position, sequence) rows, with KV-full recovery.

The batch is allocated once per model (llama_batch_init) and written through numpy views of
its arrays. When llama.cpp finds no free KV cell (return code 1; the memory is left as it
was) the least recently used cached prefix is evicted and the decode retried.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from engine.core.ledger import CacheLease
from engine.core.prefill_progress import PrefillReporter
from engine.core.schedule import FIRST_LONE_CHUNK
from engine.errors import PhasewiseError
from engine.runtimes.llamacpp.graph_meter import GraphMeter
from engine.runtimes.llamacpp.model import LlamaCppModel
from engine.runtimes.llamacpp.prefix_pool import KvFullError, SeqPrefixCache

NO_KV_SLOT = 1
ABORTED = 2  # a GraphMeter stopped the graph: the batch's positions left the KV memory


def lone_chunk(loaded: LlamaCppModel) -> int:
    """A lone prefill chunk: the whole batch once a meter can say how far one has gone."""
    return loaded.n_batch if loaded.graph_nodes else min(FIRST_LONE_CHUNK, loaded.n_batch)


def prefill_meter(loaded: LlamaCppModel, ctx: Any, within: Callable[[int, int, float], None],
                  begin: int, size: int, should_stop: Callable[[], bool]) -> GraphMeter:
    """A meter for the prefill chunk of `size` tokens from `begin` on ctx: within(begin, size,
    share of the graph done) as it goes (PrefillReporter.within), and Stop."""
    return GraphMeter(loaded, ctx, lambda fraction: within(begin, size, fraction), should_stop)


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
        if n == 1:  # a decode step: item by item, not a list converted to an array (~10 us)
            self.token[0], self.pos[0], self.n_seq_id[0] = tokens[0], positions[0], 1
            self.logits[0] = outputs[0]
            self._seq_rows[0][0] = seqs[0]
            self.batch.n_tokens = 1
            return
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
           positions: Sequence[int], seqs: Sequence[int], outputs: Sequence[bool],
           meter: GraphMeter | None = None) -> bool:
    """Run one batch (at most loaded.n_batch tokens) through the model, under `meter` if
    given. False if the meter stopped it: the batch's positions are gone from the KV memory
    (one batch is one ubatch: n_ubatch = n_batch)."""
    writer_for(loaded).fill(tokens, positions, seqs, outputs)
    lib = loaded.llama_cpp
    while True:
        code = (lib.llama_decode(loaded.ctx, loaded.batch) if meter is None
                else meter.decode(loaded.batch))
        if code == 0:
            return True
        if code == ABORTED and meter is not None:
            return False
        if code == NO_KV_SLOT and pool.evict_oldest():
            continue
        if code == NO_KV_SLOT:
            raise KvFullError(
                f"the KV cache is full ({loaded.info.context_length} tokens shared by the "
                "running replies): wait for one to finish, or load a larger context")
        raise PhasewiseError(f"llama.cpp failed to decode a batch (code {code})")


def feed(loaded: LlamaCppModel, pool: SeqPrefixCache, lease: CacheLease, ids: Sequence[int],
         rows: int = 1, cancel: threading.Event | None = None,
         progress: PrefillReporter | None = None) -> bool:
    """Append ids to the lease's sequence, in batches from the first token (as
    llama-cpp-python's Llama.eval splits them), with logits for the last `rows` tokens; the
    lease's ids follow each batch. With `progress`, a prefill: lone chunks (lone_chunk), each
    reported as it goes and stopped by cancel inside it. False if cancel stopped it."""
    n = len(ids)
    if not 1 <= rows <= n:
        raise ValueError(f"need 1 <= rows <= {n}")
    if n == 1 and progress is None:  # a decode step
        decode(loaded, pool, ids, (len(lease.ids),), (lease.cache,), (True,))
        lease.ids.append(ids[0])
        return True
    begin = 0
    while begin < n:
        if begin and cancel is not None and cancel.is_set():
            return False
        step = loaded.n_batch if progress is None else lone_chunk(loaded)
        chunk = list(ids[begin : begin + step])
        end = begin + len(chunk)
        if end == n and len(chunk) < rows:
            raise ValueError("the logits rows straddle two batches")
        start = len(lease.ids)
        outputs = [i >= n - rows for i in range(begin, end)]
        meter = None
        if progress is not None:
            meter = prefill_meter(loaded, loaded.ctx, progress.within, begin, len(chunk),
                                  cancel.is_set if cancel is not None else lambda: False)
        if not decode(loaded, pool, chunk, range(start, start + len(chunk)),
                      [lease.cache] * len(chunk), outputs, meter):
            return False
        lease.ids.extend(chunk)
        if progress is not None:
            progress.chunk_done(end)
        begin = end
    return True
