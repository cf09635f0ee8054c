"""The torch runtime's prefix-cache store: each entry's KV is a transformers cache.

The ledger (which chat holds what, LRU under a byte budget, why a turn missed) is the core's
KvLedger (engine/core/ledger.py); this module is what only torch does under it.

Every cache comes from new_cache(), whose layers can be cut back to any earlier length
(sliding-window layers keep every position; short-convolution layers record their input).
Layers with a recurrent state cannot be cut back. For them each prefill stops one token short
of the prompt's end and keeps a Checkpoint of the states there: a regenerate, or a next turn
whose reply re-tokenized differently, restores it and recomputes only what follows; a prompt
that shares less than that is computed cold, and the ledger says why ("recurrent_state").

Only the engine thread touches this object. transformers is imported inside the functions
that touch its caches: the llama.cpp engine never loads it (start-up time).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.core.ledger import CacheLease, KvCheckpoint, KvLedger
from engine.core.snapshots import Payload

if TYPE_CHECKING:
    import torch
    from transformers import DynamicCache


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


LayerKV = list[tuple["torch.Tensor", "torch.Tensor"]]  # per layer: keys, values (B, H, T, D)


def layer_kv(cache: Any) -> LayerKV:
    return [(layer.keys, layer.values) for layer in cache.layers]


def build_cache(config: Any, layers: LayerKV) -> DynamicCache:
    """A cache for this model holding these layers' keys and values."""
    cache = new_cache(config)
    for i, (keys, values) in enumerate(layers):
        cache.update(keys, values, i)
    return cache


def attention_only(cache: Any) -> bool:
    """Whether every layer is plain attention (keys and values): such a cache can be batched
    row-wise and written to a snapshot; a recurrent or convolution state cannot (yet)."""
    from transformers.cache_utils import DynamicLayer

    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


def kv_to_bytes(layers: LayerKV) -> bytes:
    """safetensors bytes of a cache's keys and values (no pickle)."""
    from safetensors.torch import save

    tensors = {}
    for i, (keys, values) in enumerate(layers):
        tensors[f"{i}.k"], tensors[f"{i}.v"] = keys.contiguous().cpu(), values.contiguous().cpu()
    return save(tensors)


def kv_from_bytes(data: bytes, device: Any) -> LayerKV:
    from safetensors.torch import load

    tensors = load(data)
    count = len(tensors) // 2
    if set(tensors) != {f"{i}.{kind}" for i in range(count) for kind in "kv"}:
        raise ValueError("not a KV snapshot of this runtime")
    return [(tensors[f"{i}.k"].to(device), tensors[f"{i}.v"].to(device)) for i in range(count)]


def checkpoint_if_due(lease: CacheLease) -> None:
    """After each prefill forward: take the checkpoint if the cache has reached it."""
    if lease.checkpoint_at is not None and len(lease.ids) == lease.checkpoint_at:
        lease.checkpoint = take_checkpoint(lease.cache, lease.checkpoint_at)


def _torch_checkpoint(checkpoint: KvCheckpoint | None) -> Checkpoint | None:
    assert checkpoint is None or isinstance(checkpoint, Checkpoint)
    return checkpoint


class TorchKvStore:
    """KvStore over transformers caches: a handle is the cache object itself."""

    can_lend = True

    def __init__(self, config: Any, device: Any = "cpu") -> None:
        self.config = config
        self.device = device
        self.takes_checkpoints = model_rollback_blocker(config) == "recurrent_state"

    def fresh(self) -> DynamicCache:
        return new_cache(self.config)

    def lend(self, donor: Any, checkpoint: KvCheckpoint | None, length: int) -> Any:
        cache = copy.deepcopy(donor)
        cut_to(cache, _torch_checkpoint(checkpoint), length)
        return cache

    def cut(self, handle: Any, checkpoint: KvCheckpoint | None, length: int) -> None:
        cut_to(handle, _torch_checkpoint(checkpoint), length)

    def blocker(self, handle: Any) -> str | None:
        return rollback_blocker(handle)

    def length(self, handle: Any) -> int:
        return int(handle.get_seq_length())

    def nbytes(self, handle: Any, tokens: int, checkpoint: KvCheckpoint | None) -> int:
        return cache_nbytes(handle) + (checkpoint.nbytes if checkpoint else 0)

    def free(self, handle: Any) -> None:
        """Nothing to do: the garbage collector frees a cache no one holds."""

    def export(self, handle: Any, checkpoint: KvCheckpoint | None) -> Payload | None:
        """The cache's bytes, made on the shelf's writer thread: a cache's tensors are never
        written in place (an update concatenates, a cut slices), so the references taken here
        keep this moment's KV while the engine goes on."""
        if not attention_only(handle):
            return None
        layers = layer_kv(handle)
        return lambda: kv_to_bytes(layers)

    def restore(self, data: bytes) -> tuple[DynamicCache, Checkpoint | None]:
        layers = kv_from_bytes(data, self.device)
        cache = build_cache(self.config, layers)
        if len(cache.layers) != len(layers) or not attention_only(cache):
            raise ValueError("the snapshot does not fit this model's layers")
        return cache, None


class PrefixCache(KvLedger[Any]):
    """The torch engine's prefix cache: the core's ledger over transformers caches."""

    store: TorchKvStore

    def __init__(self, config: Any, budget_bytes: int, device: Any = "cpu") -> None:
        super().__init__(TorchKvStore(config, device), budget_bytes)

    def reset(self, *, model_changed: bool = False, config: Any = None,
              device: Any = "cpu") -> None:
        """Drop every entry; with `config`, new caches are made for that model."""
        if config is not None:
            self.store = TorchKvStore(config, device)
        super().reset(model_changed=model_changed)
