"""The prefix cache's ledger: which chat holds which cached prefix, and why a turn missed.

Each conversation keeps the token ids and KV of what it last computed. A new prompt reuses the
longest common prefix with its own conversation's entry, or, when another entry shares a longer
prefix (a new chat with the same system prompt), a copy of that one's prefix. All entries form
one pool, evicted least-recently-used under a byte budget.

The ledger is written once for every runtime. Where the KV lives is a runtime's `KvStore`: torch
keeps a transformers cache per entry (engine/runtimes/torch/prefix_cache.py), llama.cpp a sequence
id in its context's KV memory (engine/runtimes/llamacpp/prefix_pool.py). Only the engine thread
touches a ledger.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from engine.core.snapshots import KvShelf, Payload, Restored
from engine.errors import PhasewiseError
from engine.metrics import now_ns

MISS_REASONS = (
    "none",
    "first_turn",
    "edited_history",
    "system_prompt_changed",
    "evicted",
    "model_changed",
    "template_mismatch",  # a reply's text re-tokenized unlike the ids its model produced
    "edited_reply",  # a reply's text was changed after its model produced it
    "dropped_old_turns",
    "disabled",
    "sliding_window",  # a rolling sliding-window layer no longer holds the shared prefix
    "recurrent_state",  # a recurrent (linear-attention) state cannot go back to the prefix
    "restored_from_disk",  # nothing in memory: the chat's snapshot on disk was read back
)
ANONYMOUS_PREFIX = "anon-"
ALT_CACHE_SUFFIX = "~alt"  # prefix-cache key of alternative i >= 1: f"{conversation}~alt{i}"
_anonymous = itertools.count(1)

Handle = TypeVar("Handle")


class KvFullError(PhasewiseError):
    """No KV memory is left for a request, even with every cached prefix evicted."""


def _conversation(conversation_id: str | None) -> str:
    """The cache key of a request's chat; a request outside any chat gets one of its own."""
    return conversation_id or f"{ANONYMOUS_PREFIX}{next(_anonymous)}"


def _is_chat(conv: str) -> bool:
    """A chat's own key: worth a snapshot (not a one-off request or an alternative)."""
    return not conv.startswith(ANONYMOUS_PREFIX) and ALT_CACHE_SUFFIX not in conv


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a cache that holds all it shares), at C speed
        return n
    i = 0
    while i < n and a[i] == b[i]:  # bounded: a list and a tuple never compare equal above
        i += 1
    return i


class KvCheckpoint(Protocol):
    """A recurrent state saved at `length` positions: where a cache that cannot be cut back
    can still return to."""

    @property
    def length(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class KvStore(Protocol[Handle]):
    """Where a runtime keeps KV. A handle is one cached sequence (a cache object, a sequence
    id); the ledger decides which to keep, cut, copy or free, and never looks inside one."""

    @property
    def takes_checkpoints(self) -> bool:
        """Whether a prefill must stop one token short of the prompt to keep a checkpoint."""
        ...

    @property
    def can_lend(self) -> bool:
        """Whether one entry's prefix can be copied into another chat's lease."""
        ...

    def fresh(self) -> Handle | None:
        """An empty handle, or None when none is free (the ledger evicts and asks again)."""
        ...

    def lend(self, donor: Handle, checkpoint: KvCheckpoint | None, length: int) -> Handle | None:
        """A new handle holding donor's first `length` positions, or None when none is free."""
        ...

    def cut(self, handle: Handle, checkpoint: KvCheckpoint | None, length: int) -> None:
        """Keep the first `length` positions (from the checkpoint taken there, if any)."""
        ...

    def blocker(self, handle: Handle) -> str | None:
        """Why this handle cannot be cut back to an earlier length (a MISS_REASONS entry)."""
        ...

    def length(self, handle: Handle) -> int:
        """How many positions the handle holds."""
        ...

    def nbytes(self, handle: Handle, tokens: int, checkpoint: KvCheckpoint | None) -> int:
        """The memory an entry of `tokens` positions on this handle takes."""
        ...

    def free(self, handle: Handle) -> None:
        """The ledger will not use this handle again."""
        ...

    def export(self, handle: Handle, checkpoint: KvCheckpoint | None) -> Payload | None:
        """What a snapshot of this handle and its checkpoint will hold (made into bytes off
        the engine thread), or None when this KV has no snapshot format."""
        ...

    def restore(self, data: bytes) -> tuple[Handle, KvCheckpoint | None] | None:
        """A handle holding a snapshot's KV, and the checkpoint it was written with; None when
        no handle is free; ValueError if the bytes are not this runtime's for this model."""
        ...


@dataclass
class CacheEntry(Generic[Handle]):
    ids: list[int]
    cache: Handle
    nbytes: int
    checkpoint: KvCheckpoint | None = None  # recurrent caches: where they can go back to


@dataclass
class CacheLease:
    """A KV handle lent to one request. ids always mirrors what the handle holds."""

    conversation_id: str
    ids: list[int]
    cache: Any  # the runtime's handle: a cache object (torch) or a sequence id (llama.cpp)
    cached_tokens: int
    miss_reason: str
    checkpoint: KvCheckpoint | None = None
    checkpoint_at: int | None = None  # recurrent caches: take a checkpoint at this length
    restored: Restored | None = None  # the prefix came from a snapshot on disk

    def chunk_limit(self, tokens: int) -> int:
        """A prefill chunk's size: at most `tokens`, ending where a checkpoint is due."""
        due = self.checkpoint_at - len(self.ids) if self.checkpoint_at is not None else 0
        return due if 0 < due < tokens else tokens


@dataclass(frozen=True)
class PromptLayout:
    """Token spans of the prompt's messages, to explain a miss: (role, start, end)."""

    spans: tuple[tuple[str, int, int], ...] = ()
    generated_span: tuple[int, int] | None = None  # the last reply we generated, if in prompt
    dropped_messages: int = 0  # oldest turns dropped to fit the context
    # Indices into spans of replies whose text was changed since their model produced it.
    edited_replies: tuple[int, ...] = ()


class KvLedger(Generic[Handle]):
    def __init__(self, store: KvStore[Handle], budget_bytes: int) -> None:
        self.store = store
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, CacheEntry[Handle]] = OrderedDict()  # oldest first
        self._evicted: set[str] = set()
        self._model_changed: set[str] = set()
        self._leased: set[str] = set()  # handed out and not yet back (lost if a request failed)
        self.evictions = 0
        self.shelf: KvShelf | None = None  # snapshots on disk, when the engine keeps them
        # What each entry holds, replaced whole on every change: read from any thread (peek).
        self._index: dict[str, list[int]] = {}
        self._on_shelf: dict[str, int] = {}  # tokens of each chat's last snapshot put
        self._unshelved: set[str] = set()  # chats whose entry is newer than their snapshot

    @property
    def used_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def conversations(self) -> list[str]:
        return list(self._entries)

    # ----- the pool ------------------------------------------------------------------------
    def reset(self, *, model_changed: bool = False) -> None:
        """Drop every entry (on a model switch the next turn of each chat says why)."""
        if model_changed:
            self._model_changed |= set(self._entries) | self._evicted
        self._free_entries()
        self._evicted.clear()
        self._publish()

    def take_over(self, previous: KvLedger[Any]) -> None:
        """Replace `previous` (a model switch): its entries go, and which chats lost their cache
        there carries over, so each one's next turn still says why ("model_changed")."""
        previous.reset(model_changed=True)
        self._model_changed |= previous._model_changed
        self._evicted |= previous._evicted

    def evict_all(self) -> None:
        """Free every entry (after an out-of-memory error); each chat's next turn says
        "evicted"."""
        self.evictions += len(self._entries)
        self._evicted |= set(self._entries) | self._leased
        self._free_entries()
        self._publish()

    def evict_oldest(self, keep: str | None = None) -> bool:
        """Evict the least recently used entry (not chat `keep`'s); False if there is none.
        A runtime calls this when its KV memory is full."""
        for conv, entry in self._entries.items():
            if conv != keep:
                del self._entries[conv]
                self.store.free(entry.cache)
                self._evicted.add(conv)
                self.evictions += 1
                self._publish()
                return True
        return False

    def drop(self, conversation_id: str) -> None:
        entry = self._entries.pop(conversation_id, None)
        if entry is not None:
            self.store.free(entry.cache)
            self._publish()

    def adopt(self, source: str, target: str) -> None:
        """Make source's entry target's own (a kept alternative becomes its chat's cache, so
        the next turn is that chat's own hit, not a donor borrowed under a wrong reason)."""
        entry = self._entries.pop(source, None)
        if entry is None:
            return
        self.drop(target)
        self._entries[target] = entry
        self._evicted.discard(target)
        self._model_changed.discard(target)
        self._publish()

    def peek(self, conversation_id: str | None,
             prompt_ids: Sequence[int]) -> tuple[int, bool]:
        """How many leading tokens of prompt_ids a turn now would find cached, and whether
        they would come from disk. Safe from any thread (a forecast: an entry may go before
        the turn runs; a lease running now is counted as its last entry)."""
        index, limit = self._index, len(prompt_ids) - 1
        lenders = [ids for conv, ids in index.items()
                   if conv == conversation_id or self.store.can_lend]
        best = max((min(common_prefix_len(ids, prompt_ids), limit) for ids in lenders),
                   default=0)
        shelf = self.shelf
        if conversation_id is None or conversation_id in index or shelf is None:
            return best, False
        shelved = shelf.find(conversation_id)
        shared = min(common_prefix_len(shelved.ids, prompt_ids), limit) if shelved else 0
        return (shared, True) if shared > best else (best, False)

    def _publish(self) -> None:
        """Replace the index `peek` reads (entries' id lists are never changed in place)."""
        self._index = {conv: entry.ids for conv, entry in self._entries.items()}

    # ----- leases --------------------------------------------------------------------------
    def acquire(
        self,
        conversation_id: str | None,
        prompt_ids: Sequence[int],
        layout: PromptLayout | None = None,
    ) -> CacheLease:
        """A lease holding the longest reusable prefix of prompt_ids (at most len - 1 tokens,
        so the model always runs at least one token for fresh logits)."""
        conv, own = self._take_turn(conversation_id)
        limit = len(prompt_ids) - 1
        shared = min(common_prefix_len(own.ids, prompt_ids), limit) if own else 0
        own_len = self._reach(own, shared) if own else 0
        donor_id, donor_len = self._best_donor(prompt_ids, limit)
        own_blocker = self.store.blocker(own.cache) if own is not None else None
        checkpoint, restored = None, None
        shelved, shelf_blocker = (self._from_shelf(conv, prompt_ids, limit, donor_len)
                                  if own is None else (None, None))
        if shelved is not None:
            handle, ids, checkpoint, restored = shelved
        elif own is not None and own_len > 0 and own_len >= donor_len:
            handle, ids, checkpoint = own.cache, own.ids[:own_len], own.checkpoint
            self.store.cut(handle, checkpoint, own_len)
        else:
            if own is not None:
                self.store.free(own.cache)
            if donor_id is not None and donor_len > 0:
                handle, checkpoint = self._lend(donor_id, donor_len)
                ids = list(prompt_ids[:donor_len])
            else:
                handle, ids = self._fresh(), []
        # what its own entry (or snapshot) shares, out of reach
        blocked = own_blocker if len(ids) < shared else shelf_blocker
        reason = self._miss_reason(conv, own, prompt_ids, shared, limit, layout, blocked)
        if restored is not None:
            reason = "restored_from_disk"
        if checkpoint is not None and checkpoint.length > len(ids):
            checkpoint = None
        due = limit if self.store.takes_checkpoints and limit > len(ids) else None
        return CacheLease(conv, ids, handle, len(ids), reason, checkpoint, due, restored)

    def cold_lease(self, conversation_id: str | None) -> CacheLease:
        """An empty cache for a request that must not reuse anything."""
        conv, own = self._take_turn(conversation_id)
        if own is not None:
            self.store.free(own.cache)
        return CacheLease(conv, [], self._fresh(), 0, "disabled")

    def lease_for(self, conversation_id: str, ids: list[int]) -> CacheLease:
        """A fresh handle for an alternative of a running row (the runtime copies the row's
        KV into it)."""
        self._leased.add(conversation_id)
        return CacheLease(conversation_id, list(ids), self._fresh(), len(ids), "none")

    def release(self, lease: CacheLease) -> None:
        """Keep the lease's KV as its conversation's entry, then evict down to the budget."""
        conv = lease.conversation_id
        self._leased.discard(conv)
        if not lease.ids or self.store.length(lease.cache) != len(lease.ids):
            self.store.free(lease.cache)
            return
        checkpoint = lease.checkpoint
        if checkpoint is not None and checkpoint.length > len(lease.ids):
            checkpoint = None
        old = self._entries.pop(conv, None)
        if old is not None and old.cache != lease.cache:
            self.store.free(old.cache)
        nbytes = self.store.nbytes(lease.cache, len(lease.ids), checkpoint)
        self._entries[conv] = CacheEntry(list(lease.ids), lease.cache, nbytes, checkpoint)
        self._evicted.discard(conv)
        self._model_changed.discard(conv)
        if self.shelf is not None and _is_chat(conv) and self._on_shelf.get(conv) != len(lease.ids):
            self._unshelved.add(conv)
        self._evict_to_budget()
        self._publish()

    def discard(self, lease: CacheLease) -> None:
        """A failed request's lease: its KV is in an unknown state and goes; its chat's next
        turn says "evicted"."""
        if lease.cache is not None:
            self.store.free(lease.cache)
        lease.cache = None
        self._leased.discard(lease.conversation_id)
        self._evicted.add(lease.conversation_id)

    # ----- snapshots on disk ---------------------------------------------------------------
    def shelve_one(self) -> bool:
        """Put one chat's entry, newer than its snapshot, on the shelf; False when none is
        left. The engine calls this only while idle: copying a long chat's KV out takes tens
        of milliseconds on llama.cpp, which no streaming reply should wait for."""
        shelf = self.shelf
        while self._unshelved and shelf is not None:
            conv = self._unshelved.pop()
            entry = self._entries.get(conv)
            if entry is None:  # evicted or leased again since
                continue
            payload = self.store.export(entry.cache, entry.checkpoint)
            if payload is not None:
                shelf.put(conv, entry.ids, payload)
                self._on_shelf[conv] = len(entry.ids)
            return True
        return False

    def _from_shelf(
        self, conv: str, prompt_ids: Sequence[int], limit: int, better_than: int,
    ) -> tuple[tuple[Handle, list[int], KvCheckpoint | None, Restored] | None, str | None]:
        """The chat's snapshot read back and cut to what the prompt shares with it, by an
        entry's rules (`_reach`: a recurrent state goes back only to its checkpoint), when that
        is more than memory can lend; else None, with the blocker when the snapshot shared more
        than its KV could go back to. A bad snapshot is dropped: the turn runs as if there
        were none."""
        if self.shelf is None or not _is_chat(conv):
            return None, None
        shelved = self.shelf.find(conv)
        shared = min(common_prefix_len(shelved.ids, prompt_ids), limit) if shelved else 0
        if shelved is None or shared <= better_than:
            return None, None
        start = now_ns()
        data = self.shelf.load(shelved)
        if data is None:
            return None, None
        try:
            while (kv := self.store.restore(data)) is None:
                if not self.evict_oldest():
                    return None, None
        except ValueError as exc:
            self.shelf.drop(shelved, str(exc))
            return None, None
        handle, checkpoint = kv
        if self.store.length(handle) != len(shelved.ids):
            self.store.free(handle)
            self.shelf.drop(shelved, "it holds another length than its header says")
            return None, None
        reach = self._reach(CacheEntry(shelved.ids, handle, 0, checkpoint), shared)
        if reach <= better_than:  # its state cannot go back far enough (kept for a later turn)
            blocker = self.store.blocker(handle)
            self.store.free(handle)
            return None, blocker
        self.store.cut(handle, checkpoint, reach)
        self._on_shelf[conv] = len(shelved.ids)
        restored = Restored(reach, len(data), (now_ns() - start) / 1e9)
        return (handle, list(prompt_ids[:reach]), checkpoint, restored), None

    # ----- inside --------------------------------------------------------------------------
    def _fresh(self, keep: str | None = None) -> Handle:
        while (handle := self.store.fresh()) is None:
            if not self.evict_oldest(keep=keep):
                raise KvFullError("no KV memory is free for this request")
        return handle

    def _lend(self, donor_id: str, length: int) -> tuple[Handle, KvCheckpoint | None]:
        self._entries.move_to_end(donor_id)
        donor = self._entries[donor_id]
        while (handle := self.store.lend(donor.cache, donor.checkpoint, length)) is None:
            if not self.evict_oldest(keep=donor_id):
                raise KvFullError("no KV memory is free for this request")
        return handle, donor.checkpoint

    def _free_entries(self) -> None:
        for entry in self._entries.values():
            self.store.free(entry.cache)
        self._entries.clear()

    def _evict_to_budget(self) -> None:
        while self.used_bytes > self.budget_bytes and self.evict_oldest():
            pass

    def _reach(self, entry: CacheEntry[Handle], shared: int) -> int:
        """How many of the `shared` leading tokens an entry can lend: all of them, where its
        KV can be cut back there (or needs no cut), else its checkpoint's, else none."""
        if shared >= len(entry.ids) or self.store.blocker(entry.cache) is None:
            return shared
        cp = entry.checkpoint
        return cp.length if cp is not None and cp.length <= shared else 0

    def _best_donor(self, prompt_ids: Sequence[int], limit: int) -> tuple[str | None, int]:
        best_id, best_len = None, 0
        if not self.store.can_lend:
            return best_id, best_len
        for conv, entry in self._entries.items():
            n = self._reach(entry, min(common_prefix_len(entry.ids, prompt_ids), limit))
            if n > best_len:
                best_id, best_len = conv, n
        return best_id, best_len

    def _take_turn(self, conversation_id: str | None) -> tuple[str, CacheEntry[Handle] | None]:
        """A lease starts: the chat's key (a fresh anonymous one if none), marked leased, and
        its own entry, taken out of the pool (it comes back with the lease)."""
        conv = _conversation(conversation_id)
        if conv in self._leased:  # the last request of this chat failed and lost its cache
            self._evicted.add(conv)
        self._leased.add(conv)
        return conv, self._entries.pop(conv, None)

    def _miss_reason(self, conv: str, own: CacheEntry[Handle] | None,
                     prompt_ids: Sequence[int], matched: int, limit: int,
                     layout: PromptLayout | None, blocked: str | None = None) -> str:
        """Why the lease holds less than the prompt: the ledger's one answer. `blocked`: the
        cache (or the chat's snapshot) could not be cut back to what the prompt shares
        (recurrent state)."""
        if own is None:
            reason = blocked or self._fresh_reason(conv)
        else:
            reason = blocked or _own_reason(own.ids, prompt_ids, matched, limit, layout)
        if layout is not None and layout.dropped_messages and reason != "first_turn":
            reason = "dropped_old_turns"
        return reason

    def _fresh_reason(self, conv: str) -> str:
        if conv in self._model_changed:
            return "model_changed"
        if conv in self._evicted:
            return "evicted"
        return "first_turn"


def _own_reason(old_ids: Sequence[int], prompt_ids: Sequence[int], matched: int, limit: int,
                layout: PromptLayout | None) -> str:
    if matched >= min(len(old_ids), limit):
        return "none"
    if layout is None:
        return "edited_history"
    for i in layout.edited_replies:
        if layout.spans[i][1] <= matched < layout.spans[i][2]:
            return "edited_reply"
    if layout.generated_span and layout.generated_span[0] <= matched < layout.generated_span[1]:
        # Replies carry the ids their model produced (ChatMessage.token_ids), so this is a
        # reply without them: from before a restart, another model or a remote server.
        return "template_mismatch"
    for role, start, end in layout.spans:
        if start <= matched < end:
            return "system_prompt_changed" if role == "system" else "edited_history"
    return "edited_history"
