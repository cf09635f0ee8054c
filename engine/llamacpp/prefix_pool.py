"""The prefix cache on llama.cpp's KV sequences.

Same ledger as engine/prefix_cache.py (it subclasses PrefixCache: the same miss reasons, LRU
order and budget), but an entry's "cache" is a sequence id in the context's unified KV memory:
cropping to the common prefix is `seq_rm`, borrowing another chat's prefix is `seq_cp` (the
cells are shared, not copied), and evicting is `seq_rm` of the whole sequence.

Sequence ids are few (the context's n_seq_max), so taking one may evict the least recently
used entry. Only the engine thread touches this object.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.errors import PhasewiseError
from engine.llamacpp.model import LlamaCppModel
from engine.prefix_cache import (
    CacheEntry,
    CacheLease,
    PrefixCache,
    PromptLayout,
    common_prefix_len,
)


class KvFullError(PhasewiseError):
    """No KV cells or sequence ids are left, even with every cached prefix evicted."""


class SeqPrefixCache(PrefixCache):
    def __init__(self, loaded: LlamaCppModel, budget_bytes: int) -> None:
        super().__init__(None, budget_bytes)
        self.loaded = loaded
        self._lib = loaded.llama_cpp
        self._memory = loaded.memory
        self._in_use: set[int] = set()  # sequences held by leases (running requests)
        # A new pool owns every sequence of the context: nothing older may hold cells.
        self._lib.llama_memory_clear(self._memory, False)

    # ----- sequences ---------------------------------------------------------------------------
    def _entry_seqs(self) -> set[int]:
        return {entry.cache for entry in self._entries.values()}

    def take_seq(self, keep: int | None = None) -> int:
        """A free sequence id, evicting the least recently used entry if none is free (never
        the entry holding sequence `keep`)."""
        while True:
            busy = self._in_use | self._entry_seqs()
            for seq in range(self.loaded.n_seq_max):
                if seq not in busy:
                    self._clear(seq)
                    self._in_use.add(seq)
                    return seq
            if not self.evict_oldest(keep=keep):
                raise KvFullError(f"all {self.loaded.n_seq_max} KV sequences are in use")

    def free_seq(self, seq: int) -> None:
        """Forget a sequence's cells (a request that failed or was not kept)."""
        self._clear(seq)
        self._in_use.discard(seq)

    def evict_oldest(self, keep: int | None = None) -> bool:
        """Evict the least recently used entry (not the one on sequence `keep`); False if
        there is none. The engine calls this when llama.cpp finds no free KV cell."""
        for conv, entry in self._entries.items():
            if entry.cache != keep:
                del self._entries[conv]
                self._clear(entry.cache)
                self._evicted.add(conv)
                self.evictions += 1
                return True
        return False

    def _clear(self, seq: int) -> None:
        self._lib.llama_memory_seq_rm(self._memory, seq, -1, -1)

    def crop(self, seq: int, length: int) -> None:
        if not self._lib.llama_memory_seq_rm(self._memory, seq, length, -1):
            raise PhasewiseError("llama.cpp cannot roll this model's KV cache back "
                                 "(recurrent or sliding-window memory)")

    def seq_length(self, seq: int) -> int:
        return int(self._lib.llama_memory_seq_pos_max(self._memory, seq)) + 1

    # ----- PrefixCache's interface ----------------------------------------------------------
    def acquire(self, conversation_id: str | None, prompt_ids: Sequence[int],
                layout: PromptLayout | None = None) -> CacheLease:
        conv, own = self._take_turn(conversation_id)
        limit = len(prompt_ids) - 1
        own_len = min(common_prefix_len(own.ids, prompt_ids), limit) if own else 0
        donor_id, donor_len = self._best_donor(prompt_ids, limit)
        blocked = None
        if not self.loaded.can_roll_back:  # a recurrent state holds only its last position
            donor_id, donor_len = None, 0
            if own is not None and own_len < len(own.ids):
                blocked, own_len = "recurrent_state", 0
        if own is not None and own_len >= donor_len:
            seq, ids = own.cache, own.ids[:own_len]
            self._in_use.add(seq)
            self.crop(seq, own_len)
        else:
            if own is not None:
                self._clear(own.cache)
            donor = self._entries[donor_id] if donor_id is not None and donor_len else None
            seq = self.take_seq(keep=donor.cache if donor else None)
            ids = []
            if donor is not None and donor_id is not None and donor_id in self._entries:
                self._entries.move_to_end(donor_id)
                self._lib.llama_memory_seq_cp(self._memory, donor.cache, seq, 0, donor_len)
                ids = list(prompt_ids[:donor_len])
        reason = self._miss_reason(conv, own, prompt_ids, own_len, limit, layout, blocked)
        return CacheLease(conv, ids, seq, len(ids), reason)

    def _best_donor(self, prompt_ids: Sequence[int], limit: int) -> tuple[str | None, int]:
        """The entry sharing the longest prefix with prompt_ids (any sequence can be cut)."""
        best_id, best_len = None, 0
        for conv, entry in self._entries.items():
            n = min(common_prefix_len(entry.ids, prompt_ids), limit)
            if n > best_len:
                best_id, best_len = conv, n
        return best_id, best_len

    def cold_lease(self, conversation_id: str | None) -> CacheLease:
        conv, old = self._take_turn(conversation_id)
        if old is not None:
            self._clear(old.cache)
        return CacheLease(conv, [], self.take_seq(), 0, "disabled")

    def lease_for(self, conversation_id: str, ids: list[int]) -> CacheLease:
        """A new sequence for an alternative of a running row (the caller seq_cp's into it)."""
        self._leased.add(conversation_id)
        return CacheLease(conversation_id, list(ids), self.take_seq(), len(ids), "none")

    def release(self, lease: CacheLease) -> None:
        """Keep the lease's sequence as its conversation's entry, then evict to the budget."""
        self._leased.discard(lease.conversation_id)
        seq = lease.cache
        self._in_use.discard(seq)
        if not lease.ids or self.seq_length(seq) != len(lease.ids):
            self._clear(seq)
            return
        old = self._entries.pop(lease.conversation_id, None)
        if old is not None and old.cache != seq:
            self._clear(old.cache)
        nbytes = len(lease.ids) * self.loaded.kv_bytes_per_token
        self._entries[lease.conversation_id] = CacheEntry(list(lease.ids), seq, nbytes)
        self._evicted.discard(lease.conversation_id)
        self._model_changed.discard(lease.conversation_id)
        self._evict_to_budget()

    def discard(self, lease: CacheLease) -> None:
        self.free_seq(lease.cache)  # its cells, then the record
        super().discard(lease)

    def drop(self, conversation_id: str) -> None:
        entry = self._entries.pop(conversation_id, None)
        if entry is not None:
            self._clear(entry.cache)

    def adopt(self, source: str, target: str) -> None:
        old = self._entries.get(target)
        super().adopt(source, target)
        if old is not None and self._entries.get(target) is not old:
            self._clear(old.cache)

    def reset(self, *, model_changed: bool = False, config: object = None) -> None:
        for entry in self._entries.values():
            self._clear(entry.cache)
        super().reset(model_changed=model_changed)

    def evict_all(self) -> None:
        for entry in self._entries.values():
            self._clear(entry.cache)
        super().evict_all()

    def _evict_to_budget(self) -> None:
        while self._entries and self.used_bytes > self.budget_bytes:
            self.evict_oldest()
