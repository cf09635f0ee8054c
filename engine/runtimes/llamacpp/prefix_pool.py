"""The llama.cpp runtime's prefix-cache store: each entry's KV is a sequence of the context.

The ledger is the core's KvLedger (engine/core/ledger.py: the same miss reasons, LRU order and
budget as torch); here an entry's handle is a sequence id in the context's unified KV memory:
cropping to the common prefix is `seq_rm`, borrowing another chat's prefix is `seq_cp` (the
cells are shared, not copied), and freeing is `seq_rm` of the whole sequence.

Sequence ids are few (the context's n_seq_max), so taking one may evict the least recently
used entry (the ledger does, when `fresh` finds none free). Only the engine thread touches
this object.
"""

from __future__ import annotations

import ctypes

from engine.core.ledger import KvCheckpoint, KvFullError, KvLedger
from engine.core.snapshots import Payload
from engine.errors import PhasewiseError
from engine.runtimes.llamacpp.model import LlamaCppModel

__all__ = ["KvFullError", "LlamaKvStore", "SeqPrefixCache"]


class LlamaKvStore:
    """KvStore over llama.cpp's KV sequences: a handle is a sequence id."""

    takes_checkpoints = False  # llama.cpp keeps no recurrent checkpoints: such models miss

    def __init__(self, loaded: LlamaCppModel) -> None:
        self.loaded = loaded
        self._lib = loaded.llama_cpp
        self._memory = loaded.memory
        self._taken: set[int] = set()  # sequences held by an entry or a lease
        # A new store owns every sequence of the context: nothing older may hold cells.
        self._lib.llama_memory_clear(self._memory, False)

    @property
    def can_lend(self) -> bool:
        return bool(self.loaded.can_roll_back)  # a recurrent state holds only its last position

    def fresh(self) -> int | None:
        for seq in range(self.loaded.n_seq_max):
            if seq not in self._taken:
                self._clear(seq)
                self._taken.add(seq)
                return seq
        return None

    def lend(self, donor: int, checkpoint: KvCheckpoint | None, length: int) -> int | None:
        seq = self.fresh()
        if seq is not None:
            self._lib.llama_memory_seq_cp(self._memory, donor, seq, 0, length)
        return seq

    def cut(self, handle: int, checkpoint: KvCheckpoint | None, length: int) -> None:
        if not self._lib.llama_memory_seq_rm(self._memory, handle, length, -1):
            raise PhasewiseError("llama.cpp cannot roll this model's KV cache back "
                                 "(recurrent or sliding-window memory)")

    def blocker(self, handle: int) -> str | None:
        return None if self.loaded.can_roll_back else "recurrent_state"

    def length(self, handle: int) -> int:
        return int(self._lib.llama_memory_seq_pos_max(self._memory, handle)) + 1

    def nbytes(self, handle: int, tokens: int, checkpoint: KvCheckpoint | None) -> int:
        return tokens * self.loaded.kv_bytes_per_token

    def free(self, handle: int) -> None:
        self._clear(handle)
        self._taken.discard(handle)

    def export(self, handle: int, checkpoint: KvCheckpoint | None) -> Payload | None:
        """A copy of the sequence's state, taken now (the context is the engine thread's
        alone); the shelf's writer thread only hands the bytes on. (No checkpoints here.)"""
        ctx = self.loaded.ctx
        size = int(self._lib.llama_state_seq_get_size(ctx, handle))
        data = bytearray(size)  # one copy, straight from llama.cpp's cells
        view = (ctypes.c_uint8 * size).from_buffer(data)
        written = int(self._lib.llama_state_seq_get_data(ctx, view, size, handle))
        del view
        if written <= 0:
            return None
        del data[written:]
        return lambda: data

    def restore(self, data: bytes) -> tuple[int, KvCheckpoint | None] | None:
        """A sequence holding a snapshot's state; None when no sequence is free."""
        seq = self.fresh()
        if seq is None:
            return None
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if int(self._lib.llama_state_seq_set_data(self.loaded.ctx, buffer, len(data), seq)) <= 0:
            self.free(seq)
            raise ValueError("llama.cpp could not read the snapshot")
        return seq, None

    def _clear(self, seq: int) -> None:
        self._lib.llama_memory_seq_rm(self._memory, seq, -1, -1)


class SeqPrefixCache(KvLedger[int]):
    """The llama.cpp engine's prefix cache: the core's ledger over KV sequences."""

    store: LlamaKvStore

    def __init__(self, loaded: LlamaCppModel, budget_bytes: int) -> None:
        super().__init__(LlamaKvStore(loaded), budget_bytes)
