"""Prefix KV cache: reuse what was computed for the shared start of a prompt.

Each conversation keeps the token ids and KV cache of what it last computed. A new prompt
reuses the longest common prefix with its own conversation's entry, or, when another entry
shares a longer prefix (a new chat with the same system prompt), a cropped copy of that one.
All entries form one pool, evicted least-recently-used under a byte budget.

Every cache comes from new_cache(), whose layers can be cut back to any earlier length
(sliding-window layers keep every position; short-convolution layers record their input).
Layers with a recurrent state cannot be cut back. For them each prefill stops one token short
of the prompt's end and keeps a Checkpoint of the states there: a regenerate, or a next turn
whose reply re-tokenized differently, restores it and recomputes only what follows; a prompt
that shares less than that is computed cold, and the ledger says why ("recurrent_state").

Only the engine thread touches this object. transformers is imported inside the functions
that touch its caches: the llama.cpp engine's pool (engine/llamacpp/prefix_pool.py) shares the
ledger and never loads it (start-up time).
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import DynamicCache

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
)
_anonymous = itertools.count(1)


def _conversation(conversation_id: str | None) -> str:
    """The cache key of a request's chat; a request outside any chat gets one of its own."""
    return conversation_id or f"anon-{next(_anonymous)}"


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a cache that holds all it shares), at C speed
        return n
    i = 0
    while i < n and a[i] == b[i]:  # bounded: a list and a tuple never compare equal above
        i += 1
    return i


class RollbackError(RuntimeError):
    """A cache cannot be cut back to an earlier length; reason is one of MISS_REASONS."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the KV cache cannot be cut back ({reason})")
        self.reason = reason


def new_cache(config: Any) -> DynamicCache:
    """An empty KV cache for this model that can be cut back to any earlier length.

    transformers' sliding-window layers keep only the last window, so they cannot roll back
    past it (a regenerate, an edit, a rejected draft): here they keep every position, as
    full-attention layers do, and the attention mask still applies the window (the same
    logits). Short-convolution layers ("conv", LFM2) record their whole input for the same
    reason. Layers with a recurrent state stay as they are (rollback_blocker says so)."""
    from transformers import DynamicCache
    from transformers.cache_utils import (
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionCacheLayerMixin,
        get_layer_types_and_kwargs,
    )

    cache = DynamicCache(config=config)
    if config is None:
        return cache
    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    for i, (layer, kind) in enumerate(zip(cache.layers, types, strict=False)):
        if type(layer) is DynamicSlidingWindowLayer:
            cache.layers[i] = DynamicLayer()
        elif kind == "conv" and isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.activate_past_recording()
    return cache


def rollback_blocker(cache: Any) -> str | None:
    """Why this cache cannot be cut back to an earlier length (a MISS_REASONS entry), or None."""
    from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

    for layer in cache.layers:
        recurrent = isinstance(layer, LinearAttentionCacheLayerMixin) and (
            any(layer.is_recurrent_states_initialized.values()) or not layer.record_past)
        if recurrent:
            return "recurrent_state"
        rolled = isinstance(layer, DynamicSlidingWindowLayer) and (
            not layer.record_past and layer.get_seq_length() >= layer.sliding_window)
        if rolled:
            return "sliding_window"
    return None


def model_rollback_blocker(config: Any) -> str | None:
    """Why this model's caches cannot be cut back once used (speculation needs it), or None.
    A pool without a config (the llama.cpp engine's) has no layers to ask."""
    if config is None:
        return None
    from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

    for layer in new_cache(config).layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin) and not layer.record_past:
            return "recurrent_state"
        if isinstance(layer, DynamicSlidingWindowLayer):
            return "sliding_window"
    return None


@dataclass
class Checkpoint:
    """A recurrent cache's layer states after `length` positions: what a rollback restores
    (the attention layers' KV is cropped instead)."""

    length: int
    states: list[tuple[int, dict[int, Any], dict[int, Any]]]  # layer, conv, recurrent states

    @property
    def nbytes(self) -> int:
        tensors = [t for _, conv, rec in self.states for t in (*conv.values(), *rec.values())]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def take_checkpoint(cache: Any, length: int) -> Checkpoint:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    states = [(i, _cloned(layer.conv_states), _cloned(layer.recurrent_states))
              for i, layer in enumerate(cache.layers)
              if isinstance(layer, LinearAttentionCacheLayerMixin)]
    return Checkpoint(length, states)


def _cloned(states: dict[int, Any]) -> dict[int, Any]:
    return {k: None if v is None else v.clone() for k, v in states.items()}


def cut_to(cache: Any, checkpoint: Checkpoint | None, length: int) -> None:
    """Cut the cache back to `length` positions: crop_to, or for a recurrent cache, restore
    the checkpoint taken there (its states are copied: the layers update theirs in place)."""
    from transformers.cache_utils import CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

    if cache.get_seq_length() <= length:
        return
    restorable = not any(isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers)
    if checkpoint is None or checkpoint.length != length or not restorable:
        crop_to(cache, length)
        return
    extra = cache.get_seq_length() - length
    for layer in cache.layers:
        if isinstance(layer, CacheLayerMixin):
            DynamicLayer.crop(layer, -extra)  # type: ignore[arg-type]  # any layer with keys
    for i, conv, recurrent in checkpoint.states:
        cache.layers[i].conv_states.update(_cloned(conv))
        cache.layers[i].recurrent_states.update(_cloned(recurrent))


def cache_nbytes(cache: Any) -> int:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    total = 0
    for layer in getattr(cache, "layers", []):
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            tensors += [*layer.conv_states.values(), *layer.recurrent_states.values()]
        for tensor in tensors:
            if tensor is not None and hasattr(tensor, "numel"):
                total += tensor.numel() * tensor.element_size()
    return total


def crop_to(cache: Any, length: int) -> None:
    """Keep the first `length` positions; RollbackError if the cache cannot go back."""
    from transformers.cache_utils import (
        CacheLayerMixin,
        DynamicLayer,
        LinearAttentionCacheLayerMixin,
    )

    extra = cache.get_seq_length() - length
    if extra <= 0:
        return
    reason = rollback_blocker(cache)
    if reason is not None:
        raise RollbackError(reason)
    if not any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers):
        cache.crop(-extra)  # transformers' crop takes a negative count
        return
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            # recorded conv input: one column per position (transformers' crop would also
            # shrink it to the kernel size, losing the next rollback)
            for i, state in layer.conv_states.items():
                if state is not None:
                    layer.conv_states[i] = state[..., :length]
        if isinstance(layer, CacheLayerMixin):
            DynamicLayer.crop(layer, -extra)  # type: ignore[arg-type]  # any layer with keys


@dataclass
class CacheEntry:
    ids: list[int]
    cache: Any
    nbytes: int
    checkpoint: Checkpoint | None = None  # recurrent caches: where they can go back to

    def reach(self, shared: int) -> int:
        """How many of the `shared` leading tokens this entry can lend: all of them, where
        its cache can be cut back there (or needs no cut), else its checkpoint, else none."""
        if shared >= len(self.ids) or rollback_blocker(self.cache) is None:
            return shared
        cp = self.checkpoint
        return cp.length if cp is not None and cp.length <= shared else 0


@dataclass
class CacheLease:
    """A KV cache handed to one request. ids always mirrors what the cache holds."""

    conversation_id: str
    ids: list[int]
    cache: Any
    cached_tokens: int
    miss_reason: str
    checkpoint: Checkpoint | None = None
    checkpoint_at: int | None = None  # recurrent caches: take a checkpoint at this length

    def chunk_limit(self, tokens: int) -> int:
        """A prefill chunk's size: at most `tokens`, ending where a checkpoint is due."""
        due = self.checkpoint_at - len(self.ids) if self.checkpoint_at is not None else 0
        return due if 0 < due < tokens else tokens

    def fed(self) -> None:
        """After each prefill forward: take the checkpoint if the cache has reached it."""
        if self.checkpoint_at is not None and len(self.ids) == self.checkpoint_at:
            self.checkpoint = take_checkpoint(self.cache, self.checkpoint_at)


@dataclass(frozen=True)
class PromptLayout:
    """Token spans of the prompt's messages, to explain a miss: (role, start, end)."""

    spans: tuple[tuple[str, int, int], ...] = ()
    generated_span: tuple[int, int] | None = None  # the last reply we generated, if in prompt
    dropped_messages: int = 0  # oldest turns dropped to fit the context
    # Indices into spans of replies whose text was changed since their model produced it.
    edited_replies: tuple[int, ...] = ()


class PrefixCache:
    def __init__(self, config: Any, budget_bytes: int) -> None:
        self._config = config
        self._checkpoints = model_rollback_blocker(config) == "recurrent_state"
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()  # LRU order: oldest first
        self._evicted: set[str] = set()
        self._model_changed: set[str] = set()
        self._leased: set[str] = set()  # handed out and not yet back (lost if a request failed)
        self.evictions = 0

    @property
    def used_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def conversations(self) -> list[str]:
        return list(self._entries)

    def reset(self, *, model_changed: bool = False, config: Any = None) -> None:
        """Drop every entry (on a model switch the next turn of each chat says why)."""
        if config is not None:
            self._config = config
            self._checkpoints = model_rollback_blocker(config) == "recurrent_state"
        if model_changed:
            self._model_changed |= set(self._entries) | self._evicted
        self._entries.clear()
        self._evicted.clear()

    def inherit_ledger(self, previous: PrefixCache) -> None:
        """Take over which chats lost their cache in `previous` (the pool this one replaces,
        e.g. on a switch between engines), so each one's next turn still says why."""
        self._model_changed |= previous._model_changed
        self._evicted |= previous._evicted

    def evict_all(self) -> None:
        """Free every entry (after an out-of-memory error); each chat's next turn says
        "evicted"."""
        self.evictions += len(self._entries)
        self._evicted |= set(self._entries) | self._leased
        self._entries.clear()

    def drop(self, conversation_id: str) -> None:
        self._entries.pop(conversation_id, None)

    def adopt(self, source: str, target: str) -> None:
        """Make source's entry target's own (a kept alternative becomes its chat's cache, so
        the next turn is that chat's own hit, not a donor borrowed under a wrong reason)."""
        entry = self._entries.pop(source, None)
        if entry is None:
            return
        self._entries[target] = entry
        self._entries.move_to_end(target)
        self._evicted.discard(target)
        self._model_changed.discard(target)

    def acquire(
        self,
        conversation_id: str | None,
        prompt_ids: Sequence[int],
        layout: PromptLayout | None = None,
    ) -> CacheLease:
        """A cache holding the longest reusable prefix of prompt_ids (at most len - 1 tokens,
        so the model always runs at least one token for fresh logits)."""
        conv, own = self._take_turn(conversation_id)
        limit = len(prompt_ids) - 1
        shared = min(common_prefix_len(own.ids, prompt_ids), limit) if own else 0
        own_len = own.reach(shared) if own else 0
        donor_id, donor_len = self._best_donor(prompt_ids, limit)
        checkpoint = None
        if own is not None and own_len > 0 and own_len >= donor_len:
            cache, ids, checkpoint = own.cache, own.ids[:own_len], own.checkpoint
            cut_to(cache, checkpoint, own_len)
        elif donor_id is not None and donor_len > 0:
            self._entries.move_to_end(donor_id)
            donor = self._entries[donor_id]
            cache, checkpoint = copy.deepcopy(donor.cache), donor.checkpoint
            cut_to(cache, checkpoint, donor_len)
            ids = list(prompt_ids[:donor_len])
        else:
            cache, ids = new_cache(self._config), []
        # what the prompt shares, the cache could not go back to
        blocked = rollback_blocker(own.cache) if own is not None and len(ids) < shared else None
        reason = self._miss_reason(conv, own, prompt_ids, shared, limit, layout, blocked)
        if checkpoint is not None and checkpoint.length > len(ids):
            checkpoint = None
        due = limit if self._checkpoints and limit > len(ids) else None
        return CacheLease(conv, ids, cache, len(ids), reason, checkpoint, due)

    def cold_lease(self, conversation_id: str | None) -> CacheLease:
        """An empty cache for a request that must not reuse anything."""
        conv, _ = self._take_turn(conversation_id)
        return CacheLease(conv, [], new_cache(self._config), 0, "disabled")

    def release(self, lease: CacheLease) -> None:
        """Give a lease's cache back to the pool, then evict down to the budget."""
        self._leased.discard(lease.conversation_id)
        if not lease.ids or lease.cache.get_seq_length() != len(lease.ids):
            return
        checkpoint = lease.checkpoint
        if checkpoint is not None and checkpoint.length > len(lease.ids):
            checkpoint = None
        nbytes = cache_nbytes(lease.cache) + (checkpoint.nbytes if checkpoint else 0)
        self._entries[lease.conversation_id] = CacheEntry(list(lease.ids), lease.cache, nbytes,
                                                          checkpoint)
        self._entries.move_to_end(lease.conversation_id)
        self._evicted.discard(lease.conversation_id)
        self._model_changed.discard(lease.conversation_id)
        self._evict_to_budget()

    def discard(self, lease: CacheLease) -> None:
        """A failed request's lease: its cache is in an unknown state and goes; its chat's
        next turn says "evicted"."""
        lease.cache = None
        self._leased.discard(lease.conversation_id)
        self._evicted.add(lease.conversation_id)

    def _evict_to_budget(self) -> None:
        while self._entries and self.used_bytes > self.budget_bytes:
            conv, _ = self._entries.popitem(last=False)
            self._evicted.add(conv)
            self.evictions += 1

    def _best_donor(self, prompt_ids: Sequence[int], limit: int) -> tuple[str | None, int]:
        best_id, best_len = None, 0
        for conv, entry in self._entries.items():
            n = entry.reach(min(common_prefix_len(entry.ids, prompt_ids), limit))
            if n > best_len:
                best_id, best_len = conv, n
        return best_id, best_len

    def _take_turn(self, conversation_id: str | None) -> tuple[str, CacheEntry | None]:
        """A lease starts: the chat's key (a fresh anonymous one if none), marked leased, and
        its own entry, taken out of the pool (it comes back with the lease)."""
        conv = _conversation(conversation_id)
        if conv in self._leased:  # the last request of this chat failed and lost its cache
            self._evicted.add(conv)
        self._leased.add(conv)
        return conv, self._entries.pop(conv, None)

    def _miss_reason(self, conv: str, own: CacheEntry | None, prompt_ids: Sequence[int],
                     matched: int, limit: int, layout: PromptLayout | None,
                     blocked: str | None = None) -> str:
        """Why the lease holds less than the prompt: the ledger's one answer. `blocked`: the
        cache could not be cut back to what the prompt shares (recurrent state)."""
        if own is None:
            reason = self._fresh_reason(conv)
        else:
            reason = blocked or self._own_reason(own.ids, prompt_ids, matched, limit, layout)
        if layout is not None and layout.dropped_messages and reason != "first_turn":
            reason = "dropped_old_turns"
        return reason

    def _fresh_reason(self, conv: str) -> str:
        if conv in self._model_changed:
            return "model_changed"
        if conv in self._evicted:
            return "evicted"
        return "first_turn"

    @staticmethod
    def _own_reason(
        old_ids: Sequence[int],
        prompt_ids: Sequence[int],
        matched: int,
        limit: int,
        layout: PromptLayout | None,
    ) -> str:
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
