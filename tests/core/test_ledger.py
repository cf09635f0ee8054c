"""The prefix cache's ledger (engine/core/ledger.py) over a store that records what it is asked:
which handles it frees, what a loan carries, how few handles it has (llama.cpp's sequence ids),
and the forecast's `peek` against what a turn then finds. The same ledger runs under every
runtime; tests/runtimes/test_prefix_cache.py drives it through the torch store."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.core.ledger import CacheLease, KvFullError, KvLedger
from engine.core.snapshots import KvShelf

BAD_LAYOUT = b"\xff"  # a payload RecordingStore.restore refuses


@dataclass(frozen=True)
class Mark:
    """A checkpoint: the length it was taken at."""

    length: int


@dataclass(eq=False)
class Seq:
    """One handle: the ids it holds."""

    ids: list[int] = field(default_factory=list)


class RecordingStore:
    """A KvStore with `slots` handles at most, recording frees and loans."""

    takes_checkpoints = False

    def __init__(self, slots: int = 8, can_lend: bool = True) -> None:
        self.slots = slots
        self.can_lend = can_lend
        self.live: list[Seq] = []
        self.freed: list[Seq | None] = []
        self.loans: list[tuple[Seq, Mark | None, int]] = []

    def fresh(self) -> Seq | None:
        return self._new([])

    def lend(self, donor: Seq, checkpoint: Mark | None, length: int) -> Seq | None:
        self.loans.append((donor, checkpoint, length))
        return self._new(donor.ids[:length])

    def _new(self, ids: list[int]) -> Seq | None:
        if len(self.live) >= self.slots:
            return None
        seq = Seq(list(ids))
        self.live.append(seq)
        return seq

    def cut(self, handle: Seq, checkpoint: Mark | None, length: int) -> None:
        del handle.ids[length:]

    def blocker(self, handle: Seq) -> str | None:
        return None

    def length(self, handle: Seq) -> int:
        return len(handle.ids)

    def nbytes(self, handle: Seq, tokens: int, checkpoint: Mark | None) -> int:
        return tokens

    def free(self, handle: Seq) -> None:
        self.freed.append(handle)
        if handle in self.live:
            self.live.remove(handle)

    def export(self, handle: Seq, checkpoint: Mark | None):
        ids = list(handle.ids)
        return lambda: bytes(ids)

    def restore(self, data: bytes) -> tuple[Seq, Mark | None] | None:
        if data == BAD_LAYOUT:
            raise ValueError("laid out for another model")
        seq = self._new(list(data))
        return None if seq is None else (seq, None)


def ledger(slots: int = 8, can_lend: bool = True, budget: int = 1 << 20
           ) -> tuple[KvLedger[Seq], RecordingStore]:
    store = RecordingStore(slots, can_lend)
    return KvLedger(store, budget), store  # type: ignore[arg-type]  # structural, Mark for KvCheckpoint


def turn(pool: KvLedger[Seq], conv: str, prompt: list[int], reply: Sequence[int] = ()) -> Seq:
    """acquire, feed the uncached prompt and the reply, release; the handle kept."""
    lease = pool.acquire(conv, prompt)
    lease.cache.ids.extend(prompt[lease.cached_tokens :] + list(reply))
    lease.ids = prompt + list(reply)
    pool.release(lease)
    return lease.cache


def test_drop_frees_the_chats_handle_and_nothing_else() -> None:
    pool, store = ledger()
    a, b = turn(pool, "a", [1, 2, 3]), turn(pool, "b", [4, 5])
    pool.drop("a")
    pool.drop("missing")
    assert store.freed == [a] and store.live == [b]
    assert pool.peek("a", [1, 2, 3, 9]) == (0, False)


def test_adopt_frees_the_targets_old_handle() -> None:
    pool, store = ledger()
    old = turn(pool, "c", [1, 2])
    alt = turn(pool, "c~alt1", [1, 2, 3])
    pool.adopt("c~alt1", "c")
    assert store.freed == [old] and store.live == [alt]
    assert pool.peek("c", [1, 2, 3, 4]) == (3, False)


def test_discard_frees_the_lease_once_and_the_next_turn_says_evicted() -> None:
    pool, store = ledger()
    lease = pool.acquire("c", [1, 2, 3])
    handle = lease.cache
    pool.discard(lease)
    assert lease.cache is None and store.freed == [handle]
    pool.discard(lease)  # a second discard of the same lease frees nothing more
    assert store.freed == [handle]
    assert pool.acquire("c", [1, 2, 3]).miss_reason == "evicted"


def test_lease_for_an_alternative_holds_the_rows_ids_and_is_owed_back() -> None:
    pool, _ = ledger()
    lease = pool.lease_for("c~alt1", [1, 2, 3])
    assert (lease.conversation_id, lease.ids, lease.cached_tokens, lease.miss_reason) == \
        ("c~alt1", [1, 2, 3], 3, "none")
    assert lease.cache is not None and lease.cache.ids == []  # the runtime copies the row in
    pool.evict_all()  # while it is out: its chat is counted as having lost its cache
    assert pool.acquire("c~alt1", [1, 2]).miss_reason == "evicted"


def test_lease_for_evicts_the_oldest_when_no_handle_is_free() -> None:
    pool, store = ledger(slots=2)
    first, second = turn(pool, "a", [1]), turn(pool, "b", [2])
    lease = pool.lease_for("b~alt1", [2])
    assert store.freed == [first] and lease.cache in store.live and second in store.live


def test_a_loan_carries_the_donors_checkpoint_and_keeps_the_donor() -> None:
    pool, store = ledger(slots=2)
    donor = turn(pool, "a", [1, 2, 3, 4])
    entry = pool._entries["a"]
    entry.checkpoint = Mark(3)  # type: ignore[assignment]
    turn(pool, "x", [9])  # the store is full: lending to "b" must evict, but never the donor
    lease = pool.acquire("b", [1, 2, 3, 7])
    assert len(store.loans) == 2  # the first found no handle free, the second after evicting
    assert all(loan == (donor, Mark(3), 3) for loan in store.loans)
    assert lease.cached_tokens == 3 and lease.checkpoint == Mark(3)
    assert donor in store.live and pool.conversations()[-1] == "a"


def test_a_chats_own_entry_is_freed_when_another_chat_lends_it_more() -> None:
    pool, store = ledger()
    own = turn(pool, "c", [1, 5])  # shares 1 token with the next prompt
    donor = turn(pool, "a", [1, 2, 3, 4])  # shares 3
    lease = pool.acquire("c", [1, 2, 3, 8])
    assert store.loans[-1] == (donor, None, 3) and lease.cached_tokens == 3
    assert store.freed == [own] and own not in store.live


def test_a_loan_with_no_handle_left_to_free_is_kv_full() -> None:
    pool, _ = ledger(slots=1)
    turn(pool, "a", [1, 2, 3])
    with pytest.raises(KvFullError):
        pool.acquire("b", [1, 2, 9])


@pytest.mark.parametrize("can_lend", [True, False])
def test_peek_forecasts_what_the_turn_then_finds(can_lend: bool) -> None:
    """peek's count is acquire's: the chat's own entry, another chat's where the store can
    lend, at most all but the prompt's last token."""
    pool, _ = ledger(can_lend=can_lend)
    turn(pool, "own", [1, 2, 3])
    turn(pool, "donor", [1, 2, 3, 4, 5, 6])
    prompts = {"own": [1, 2, 3, 4, 5, 9], "new": [1, 2, 3, 4, 5, 9], "short": [1, 2, 3],
               "whole": [1, 2, 3, 4, 5, 6]}
    for conv, prompt in prompts.items():
        forecast = pool.peek(conv if conv != "whole" else "donor", prompt)
        lease = pool.acquire(conv if conv != "whole" else "donor", prompt)
        assert forecast == (lease.cached_tokens, False), conv
        pool.discard(lease)
    if can_lend:
        assert pool.peek(None, [1, 2, 3, 4, 5, 6, 7]) == (6, False)
    else:
        assert pool.peek(None, [1, 2, 3, 4, 5, 6, 7]) == (0, False)


def test_peek_takes_the_shelf_only_for_a_chat_not_in_memory(tmp_path: Path) -> None:
    pool, _ = ledger(can_lend=False)
    shelf = KvShelf(tmp_path, "model")
    pool.shelf = shelf
    try:
        shelf.put("c", [1, 2, 3, 4], lambda: bytes([1, 2, 3, 4]))
        assert shelf.flush(30)
        assert pool.peek("c", [1, 2, 3, 4, 5]) == (4, True)
        assert pool.peek("c", [1, 2, 3, 4]) == (3, True)  # never the prompt's last token
        assert pool.peek("c", [7, 8]) == (0, False)  # nothing shared: not "from disk"
        assert pool.peek("other", [1, 2, 3, 4, 5]) == (0, False)  # another chat's snapshot
        assert pool.peek(None, [1, 2, 3, 4, 5]) == (0, False)
        turn(pool, "c", [1, 2])  # in memory now: what memory holds, even if the disk has more
        assert pool.peek("c", [1, 2, 3, 4, 5]) == (2, False)
    finally:
        shelf.close(10)


def test_peek_prefers_memory_when_it_holds_as_much_as_the_shelf(tmp_path: Path) -> None:
    pool, _ = ledger(can_lend=True)
    shelf = KvShelf(tmp_path, "model")
    pool.shelf = shelf
    try:
        shelf.put("c", [1, 2, 3], lambda: bytes([1, 2, 3]))
        assert shelf.flush(30)
        turn(pool, "donor", [1, 2, 3, 8])
        assert pool.peek("c", [1, 2, 3, 4]) == (3, False)  # a tie: memory, no disk read
        turn(pool, "donor", [1, 2, 8])
        assert pool.peek("c", [1, 2, 3, 4]) == (3, True)
    finally:
        shelf.close(10)


def test_reset_and_evict_all_free_every_handle_the_ledger_holds() -> None:
    pool, store = ledger()
    a, b = turn(pool, "a", [1, 2]), turn(pool, "b", [3])
    pool.reset()
    assert store.freed == [a, b] and store.live == []
    c = turn(pool, "c", [4])
    pool.evict_all()
    assert store.freed == [a, b, c] and store.live == []


def test_a_plain_reset_is_no_model_change() -> None:
    """Only a model switch makes the next turn say "model_changed"; a reset (Clear caches)
    says the chat starts again."""
    pool, _ = ledger()
    turn(pool, "a", [1, 2])
    pool.reset()
    assert pool.acquire("a", [1, 2, 3]).miss_reason == "first_turn"
    switched, _ = ledger()
    turn(switched, "b", [1, 2])
    switched.reset(model_changed=True)
    assert switched.acquire("b", [1, 2, 3]).miss_reason == "model_changed"


def test_an_idle_step_shelves_a_chats_newer_entry_once(tmp_path: Path) -> None:
    pool, _ = ledger()
    shelf = KvShelf(tmp_path, "model")
    pool.shelf = shelf
    try:
        turn(pool, "c", [1, 2, 3], [4])
        assert pool.shelve_one() is True
        assert pool.shelve_one() is False  # nothing newer than its snapshot is left
        assert shelf.flush(30)
        found = shelf.find("c")
        assert found is not None and found.ids == [1, 2, 3, 4]
        assert shelf.load(found) == bytes([1, 2, 3, 4])  # the store's export of that handle
        turn(pool, "c", [1, 2, 3, 4])  # the same length: what is on the shelf still holds
        assert pool.shelve_one() is False
        turn(pool, "c", [1, 2, 3, 4, 5], [6])
        assert pool.shelve_one() is True
        assert shelf.flush(30)
        found = shelf.find("c")
        assert found is not None and found.ids == [1, 2, 3, 4, 5, 6]
    finally:
        shelf.close(10)


@pytest.mark.parametrize("conv", ["c~alt1", "anon-7"])
def test_alternatives_and_one_off_requests_are_never_shelved(tmp_path: Path, conv: str) -> None:
    pool, _ = ledger()
    shelf = KvShelf(tmp_path, "model")
    pool.shelf = shelf
    try:
        turn(pool, conv, [1, 2, 3])
        assert pool.shelve_one() is False
        assert shelf.flush(30) and shelf.find(conv) is None
    finally:
        shelf.close(10)


def test_a_chat_dropped_before_the_idle_step_is_not_shelved(tmp_path: Path) -> None:
    pool, _ = ledger()
    shelf = KvShelf(tmp_path, "model")
    pool.shelf = shelf
    try:
        turn(pool, "a", [1, 2])
        dropped = [f"b{i}" for i in range(9)]
        for conv in dropped:
            turn(pool, conv, [3, 4])
            pool.drop(conv)
        assert pool.shelve_one() is True  # those dropped are passed over, a is shelved
        assert pool.shelve_one() is False
        assert shelf.flush(30)
        assert shelf.find("a") is not None
        assert all(shelf.find(conv) is None for conv in dropped)
    finally:
        shelf.close(10)


def test_a_lease_whose_kv_does_not_match_its_ids_is_freed_not_kept() -> None:
    pool, store = ledger()
    lease = pool.acquire("c", [1, 2, 3])
    handle = lease.cache
    handle.ids.extend([1, 2])  # one prompt token short of what the lease says it holds
    pool.release(lease)
    assert store.freed == [handle]
    assert pool.peek("c", [1, 2, 3, 4]) == (0, False)
    empty = pool.acquire("d", [5])
    empty.ids = []
    pool.release(empty)
    assert store.freed == [handle, empty.cache]


def test_releasing_an_alternatives_handle_under_the_chat_frees_the_old_one() -> None:
    pool, store = ledger()
    old = turn(pool, "c", [1, 2])
    lease = pool.lease_for("c", [1, 2, 3])
    lease.cache.ids.extend([1, 2, 3])
    pool.release(lease)
    assert store.freed == [old]
    assert pool.peek("c", [1, 2, 3, 4]) == (3, False)


def test_a_cold_lease_frees_the_chats_own_entry() -> None:
    pool, store = ledger()
    old = turn(pool, "c", [1, 2, 3])
    lease = pool.cold_lease("c")
    assert (lease.ids, lease.cached_tokens, lease.miss_reason) == ([], 0, "disabled")
    assert store.freed == [old]


@pytest.mark.parametrize(("due_in", "chunk"), [(1, 1), (4, 4), (10, 10), (0, 10), (12, 10)])
def test_a_prefill_chunk_ends_where_a_checkpoint_is_due(due_in: int, chunk: int) -> None:
    lease = CacheLease("c", [1, 2, 3], None, 3, "none", checkpoint_at=3 + due_in)
    assert lease.chunk_limit(10) == chunk


def shelved(tmp_path: Path, ids: list[int], payload: bytes) -> KvShelf:
    """A shelf holding chat c's snapshot, as a restarted app finds it."""
    shelf = KvShelf(tmp_path, "model")
    shelf.put("c", ids, lambda: payload)
    assert shelf.flush(30)
    return shelf


@pytest.mark.parametrize(("prompt", "cached"), [([1, 2, 3, 4, 5], 4), ([1, 2, 3, 4], 3),
                                                ([1, 2, 9, 9, 9], 2)])
def test_a_turn_after_a_restart_restores_what_the_prompt_shares_from_disk(
        tmp_path: Path, prompt: list[int], cached: int) -> None:
    pool, _ = ledger()
    pool.shelf = shelved(tmp_path, [1, 2, 3, 4], bytes([1, 2, 3, 4]))
    try:
        lease = pool.acquire("c", prompt)
        assert (lease.ids, lease.cached_tokens, lease.miss_reason) == \
            (prompt[:cached], cached, "restored_from_disk")
        assert lease.cache.ids == prompt[:cached]  # cut to what the prompt shares
        assert lease.restored is not None
        assert (lease.restored.tokens, lease.restored.nbytes) == (cached, 4)
    finally:
        pool.shelf.close(10)


@pytest.mark.parametrize(("payload", "why"), [
    (bytes([1, 2, 3]), "it holds another length than its header says"),
    (BAD_LAYOUT, "laid out for another model")])
def test_a_snapshot_the_store_cannot_take_is_dropped_and_the_turn_runs_cold(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, payload: bytes, why: str) -> None:
    pool, store = ledger()
    shelf = pool.shelf = shelved(tmp_path, [1, 2, 3, 4], payload)
    try:
        with caplog.at_level(logging.WARNING, logger="phasewise.snapshots"):
            lease = pool.acquire("c", [1, 2, 3, 4, 5])
        assert (lease.cached_tokens, lease.restored) == (0, None)
        assert lease.miss_reason != "restored_from_disk"
        assert shelf.find("c") is None
        assert any(m.endswith(f"dropped: {why}") for m in caplog.messages)
        assert store.live == [lease.cache]  # a handle restored and refused was freed
    finally:
        shelf.close(10)


def test_restoring_evicts_the_oldest_entry_when_no_handle_is_free(tmp_path: Path) -> None:
    pool, store = ledger(slots=1)
    other = turn(pool, "o", [7, 8])
    pool.shelf = shelved(tmp_path, [1, 2, 3], bytes([1, 2, 3]))
    try:
        lease = pool.acquire("c", [1, 2, 3, 4])
        assert (lease.cached_tokens, lease.miss_reason) == (3, "restored_from_disk")
        assert store.freed == [other]
    finally:
        pool.shelf.close(10)


def test_memory_is_preferred_when_it_holds_as_much_as_the_disk(tmp_path: Path) -> None:
    pool, _ = ledger()
    turn(pool, "donor", [1, 2, 3, 8])
    pool.shelf = shelved(tmp_path, [1, 2, 3], bytes([1, 2, 3]))
    try:
        lease = pool.acquire("c", [1, 2, 3, 4])
        assert (lease.cached_tokens, lease.restored) == (3, None)
    finally:
        pool.shelf.close(10)
