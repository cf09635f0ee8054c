"""The torch runtime's prefix-cache store: each entry's KV is a transformers cache.

The ledger (which chat holds what, LRU under a byte budget, why a turn missed) is the core's
KvLedger (engine/core/ledger.py); this module is what only torch does under it.

Every cache comes from new_cache(), whose layers can be cut back to any earlier length
(sliding-window layers keep every position; short-convolution layers record their input).
Layers with a recurrent state cannot be cut back. For them each prefill stops one token short
of the prompt's end and keeps a Checkpoint of the states there: a regenerate, or a next turn
whose reply re-tokenized differently, restores it and recomputes only what follows; a prompt
that shares less than that is computed cold, and the ledger says why ("recurrent_state").

A snapshot on disk (the core's KvShelf) is safetensors bytes of every layer's tensors: the
attention layers' keys and values, a convolution layer's recorded input, a recurrent layer's
states, and the checkpoint's states; its metadata says the format, each layer's kind, the
length and the checkpoint's, so a file that does not fit this model is refused whole before
any tensor is used. A restored cache is cut back by the same rules as one kept in memory.

Only the engine thread touches this object. transformers is imported inside the functions
that touch its caches: the llama.cpp engine never loads it (start-up time).
"""

from __future__ import annotations

import copy
import itertools
import json
import struct
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
    row-wise; a recurrent or convolution state cannot."""
    from transformers.cache_utils import DynamicLayer

    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


# ----- snapshots on disk ---------------------------------------------------------------------
SNAPSHOT_FORMAT = "phasewise-torch-kv/2"  # in the safetensors metadata; /1 held only K and V
ATTENTION, CONV, RECURRENT = "attention", "conv", "recurrent"


def cache_kinds(cache: Any) -> list[str] | None:
    """Each layer's kind in a snapshot: "attention" (keys and values, one row per position),
    "conv" (a short convolution's recorded input, one column per position) or "recurrent"
    (a linear-attention layer's conv and recurrent states: the last position's only); None
    when a layer is none of these (such a cache has no snapshot format)."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

    kinds = []
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            kinds.append(ATTENTION)
        elif type(layer) is LinearAttentionLayer:
            kinds.append(CONV if layer.record_past else RECURRENT)
        else:
            return None
    return kinds or None


def snapshot_parts(cache: Any, checkpoint: Checkpoint | None,
                   ) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """A snapshot's tensors and metadata, on the engine thread: references to the tensors a
    cache never writes in place (an update concatenates, a cut slices), copies of the states
    a recurrent layer updates in place (fixed-size: a chat's length does not grow them).
    None when the cache has no snapshot format."""
    kinds = cache_kinds(cache)
    if kinds is None:
        return None
    tensors: dict[str, torch.Tensor] = {}
    kernels: dict[str, int] = {}
    for i, (kind, layer) in enumerate(zip(kinds, cache.layers, strict=True)):
        if kind == ATTENTION:
            if layer.keys is None:
                return None
            tensors[f"{i}.k"], tensors[f"{i}.v"] = layer.keys, layer.values
            continue
        for j in range(layer.number_of_states):
            conv, recurrent = layer.conv_states[j], layer.recurrent_states[j]
            if conv is None or (recurrent is None) == (kind == RECURRENT):
                return None
            tensors[f"{i}.conv{j}"] = conv if kind == CONV else conv.clone()
            if recurrent is not None:
                tensors[f"{i}.rec{j}"] = recurrent.clone()
            kernels[f"{i}.{j}"] = int(layer.conv_kernel_size[j])
    if checkpoint is not None:  # its states are copies no layer writes into (cut_to copies)
        for i, conv_states, recurrent_states in checkpoint.states:
            for name, states in (("conv", conv_states), ("rec", recurrent_states)):
                tensors |= {f"checkpoint.{i}.{name}{j}": t for j, t in states.items()
                            if t is not None}
    meta = {"format": SNAPSHOT_FORMAT, "layers": json.dumps(kinds),
            "length": str(cache.get_seq_length()),
            "checkpoint": str(checkpoint.length) if checkpoint is not None else "",
            "conv_kernels": json.dumps(kernels)}
    return tensors, meta


def snapshot_bytes(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    """safetensors bytes of a snapshot's tensors (no pickle), on the shelf's writer thread."""
    from safetensors.torch import save

    return save({name: t.contiguous().cpu() for name, t in tensors.items()}, metadata=meta)


def snapshot_meta(data: bytes) -> dict[str, str]:
    """A snapshot's metadata (safetensors: a little-endian u64 header size, a JSON header)."""
    try:
        (size,) = struct.unpack_from("<Q", data)
        header = json.loads(bytes(data[8 : 8 + size]))
    except (struct.error, ValueError) as exc:
        raise ValueError("not a KV snapshot of this runtime") from exc
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != SNAPSHOT_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"not this runtime's snapshot format ({found or 'none'})")
    return meta


class _Snapshot:
    """A snapshot's bytes read back and checked against this model's layers: every tensor it
    must hold, of the length its metadata says, and nothing else (ValueError, in one line)."""

    def __init__(self, data: bytes, kinds: list[str], states: list[int]) -> None:
        from safetensors import SafetensorError
        from safetensors.torch import load

        meta = snapshot_meta(data)
        try:
            found = json.loads(meta["layers"])
            self.length = int(meta["length"])
            self.checkpoint = int(meta["checkpoint"]) if meta["checkpoint"] else None
            self.kernels = {k: int(v) for k, v in json.loads(meta["conv_kernels"]).items()}
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"its metadata is unreadable ({exc})") from exc
        if found != kinds:
            raise ValueError(f"made for other layers ({_kinds_line(found)}; this model: "
                             f"{_kinds_line(kinds)})")
        if self.length < 1 or (self.checkpoint is not None
                                and not 0 < self.checkpoint <= self.length):
            raise ValueError(f"its lengths do not fit ({self.length}, {self.checkpoint})")
        try:
            self.tensors = load(bytes(data))
        except SafetensorError as exc:
            raise ValueError(f"its tensors are unreadable ({exc})") from exc
        state_names = [f"{i}.{name}{j}" for i, kind in enumerate(kinds) if kind != ATTENTION
                       for j in range(states[i])
                       for name in (("conv", "rec") if kind == RECURRENT else ("conv",))]
        expected = {f"{i}.{kv}" for i, kind in enumerate(kinds) if kind == ATTENTION
                    for kv in "kv"} | set(state_names)
        if self.checkpoint is not None:
            expected |= {f"checkpoint.{name}" for name in state_names}
        if set(self.tensors) != expected:
            odd = ", ".join(sorted(set(self.tensors) ^ expected)[:4])
            raise ValueError(f"it holds other tensors than this model's cache ({odd})")
        for i, kind in enumerate(kinds):
            for j in range(1 if kind == ATTENTION else states[i]):
                self._check(i, j, kind)

    def _check(self, i: int, j: int, kind: str) -> None:
        t = self.tensors
        if kind == ATTENTION:
            k, v = t[f"{i}.k"], t[f"{i}.v"]
            fits = (k.dim() == v.dim() == 4 and k.shape[:3] == v.shape[:3]
                    and k.shape[0] == 1 and k.shape[2] == self.length and k.dtype == v.dtype)
        else:
            kernel = self.kernels.get(f"{i}.{j}", 0)
            conv = t[f"{i}.conv{j}"]
            width = self.length if kind == CONV else kernel
            fits = kernel > 0 and conv.dim() == 3 and conv.shape[0] == 1 and conv.shape[2] == width
            if self.checkpoint is not None:
                if kind == CONV:
                    cp = t[f"checkpoint.{i}.conv{j}"]
                    fits &= (cp.shape == (*conv.shape[:2], self.checkpoint)
                             and cp.dtype == conv.dtype)
                else:
                    fits &= all(t[f"checkpoint.{i}.{n}{j}"].shape == t[f"{i}.{n}{j}"].shape
                                and t[f"checkpoint.{i}.{n}{j}"].dtype == t[f"{i}.{n}{j}"].dtype
                                for n in ("conv", "rec"))
            if kind == RECURRENT:
                fits &= t[f"{i}.rec{j}"].dim() >= 1 and t[f"{i}.rec{j}"].shape[0] == 1
        if not fits:
            raise ValueError(f"its layer {i} ({kind}) has shapes that do not fit "
                             f"{self.length} positions")

    def cache(self, config: Any, device: Any) -> tuple[DynamicCache, Checkpoint | None]:
        """The cache (and checkpoint) it holds, built as a prefill builds one: through the
        layers' own updates."""
        from transformers.cache_utils import LinearAttentionLayer

        cache = new_cache(config)
        t = {name: tensor.to(device) for name, tensor in self.tensors.items()}
        states: list[tuple[int, dict[int, Any], dict[int, Any]]] = []
        for i, layer in enumerate(cache.layers):
            if not isinstance(layer, LinearAttentionLayer):
                cache.update(t[f"{i}.k"], t[f"{i}.v"], i)
                continue
            for j in range(layer.number_of_states):
                layer.update_conv_state(t[f"{i}.conv{j}"], j,
                                        conv_kernel_size=self.kernels[f"{i}.{j}"])
                if f"{i}.rec{j}" in t:
                    layer.update_recurrent_state(t[f"{i}.rec{j}"], j)
            at = range(layer.number_of_states)
            states.append((i, {j: t.get(f"checkpoint.{i}.conv{j}") for j in at},
                           {j: t.get(f"checkpoint.{i}.rec{j}") for j in at}))
        if self.checkpoint is None:
            return cache, None
        return cache, Checkpoint(self.checkpoint, states)


def _kinds_line(kinds: object) -> str:
    """[conv, conv, attention] -> "2 conv, 1 attention": a model's layers in a few words."""
    if not isinstance(kinds, list):
        return "unknown"
    return ", ".join(f"{len(list(run))} {kind}" for kind, run in itertools.groupby(kinds))


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
        from transformers.cache_utils import LinearAttentionCacheLayerMixin

        fresh = new_cache(config)
        self._kinds = cache_kinds(fresh)  # what a snapshot of this model's cache holds
        self._states = [layer.number_of_states
                        if isinstance(layer, LinearAttentionCacheLayerMixin) else 0
                        for layer in fresh.layers]

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
        """The cache's bytes, made on the shelf's writer thread from what snapshot_parts takes
        here (references, and copies of the few states updated in place), so the engine goes
        on while they are written."""
        parts = snapshot_parts(handle, _torch_checkpoint(checkpoint))
        if parts is None:
            return None
        tensors, meta = parts
        return lambda: snapshot_bytes(tensors, meta)

    def restore(self, data: bytes) -> tuple[DynamicCache, Checkpoint | None]:
        if self._kinds is None:
            raise ValueError("this model's cache has no snapshot format")
        return _Snapshot(data, self._kinds, self._states).cache(self.config, self.device)


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
