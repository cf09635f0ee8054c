"""A GGUF file's header, read without the gguf package (whose reader parses every value into
numpy and took seconds for a large vocabulary): metadata, tensor shapes, where the data starts.

fit.py reads the model's shape from it; the llama.cpp engine, the sampling settings a GGUF may
carry (llama.cpp's general.sampling.* keys).
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.events import SamplingDefaults

Buffer = bytes | mmap.mmap  # what the parser reads from: a mapped file or bytes

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# general.file_type: llama.cpp's llama_ftype (llama.h), named as quantize and file names name
# them. llama_model_desc says "Q4_K - Medium" for 15, whose last word alone read "Medium".
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
    38: "MXFP4_MOE",
}

# ggml's tensor types by id (ggml.h's ggml_type): a prompt's matmuls run at each type's own
# speed (engine/tools/speed.py prices them apart).
TENSOR_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}


@dataclass(frozen=True)
class Shape:
    """What the KV cache and the working buffers depend on (engine/tools/fit.py's estimate; here,
    below fit, because a GGUF's header is one of the two places it is read from)."""

    kv_values_per_token: int  # sum over layers with KV of kv_heads x (key + value dims)
    heads: int
    hidden: int
    vocab: int
    context_length: int  # what the model was trained for
    # Sum over the layers that attend (those with KV) of query heads x (key + value dims): a
    # pair of positions costs 2 x this in FLOPs (scores and weighted sum; engine/tools/speed.py).
    attention_width: int = 0


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]  # scalars and numeric arrays; a string array is its length
    tensor_dims: dict[str, tuple[int, ...]]
    data_start: int
    # Where each tensor's bytes start, from data_start (in the file's order of tensor infos).
    tensor_offsets: dict[str, int] = field(default_factory=dict)
    tensor_types: dict[str, int] = field(default_factory=dict)  # ggml type ids

    def type_name(self, tensor: str) -> str:
        """A tensor's ggml type ("Q4_K"; "type 99" for one this reader does not name)."""
        kind = self.tensor_types.get(tensor, -1)
        return TENSOR_TYPES.get(kind, f"type {kind}")

    def field(self, key: str, default: Any = None) -> Any:
        arch = self.metadata.get("general.architecture", "")
        return self.metadata.get(f"{arch}.{key}", default)

    def file_type(self) -> str | None:
        """The quantization the file says it has ("Q4_K_M"); None when it does not say or
        says a type not in FILE_TYPES."""
        value = self.metadata.get("general.file_type")
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        return FILE_TYPES.get(value)

    def elements(self) -> int:
        return sum(math.prod(dims) for dims in self.tensor_dims.values())

    def tensor_bytes(self, file_size: int) -> dict[str, int]:
        """Each tensor's bytes as stored (quantized), from its offset to the next tensor's,
        the last one's to the end of a file of `file_size` bytes (alignment padding included,
        under 32 bytes a tensor): a local file or a remote one whose header alone was read."""
        ordered = sorted((offset, name) for name, offset in self.tensor_offsets.items())
        end = file_size - self.data_start
        return {name: max(0, (ordered[i + 1][0] if i + 1 < len(ordered) else end) - offset)
                for i, (offset, name) in enumerate(ordered)}

    def step_bytes(self, file_size: int) -> int:
        """Quantized bytes one decode step reads: every tensor once, except an input
        embedding table separate from the output head, of which a step reads a single row."""
        total = file_size - self.data_start
        extents = self.tensor_bytes(file_size)
        if "token_embd.weight" not in extents or "output.weight" not in extents:
            return total  # tied: the table is also the output head and is read in full
        dims = self.tensor_dims["token_embd.weight"]
        rows = dims[-1] if len(dims) > 1 else 1
        embed = extents["token_embd.weight"]
        return total - embed + embed // max(rows, 1)

    def sampling_defaults(self) -> SamplingDefaults:
        """The sampling settings the file suggests (general.sampling.*; None where absent)."""

        def number(key: str) -> float | None:
            value = self.metadata.get(f"general.sampling.{key}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                return None
            return float(value)

        top_k = number("top_k")
        return SamplingDefaults(temperature=number("temp"), top_p=number("top_p"),
                                top_k=int(top_k) if top_k is not None else None,
                                repetition_penalty=number("penalty_repeat") or None)

    def shape(self) -> Shape:
        layers = int(self.field("block_count", 0))
        heads = _per_layer(self.field("attention.head_count", 1), layers)
        kv_heads = _per_layer(self.field("attention.head_count_kv", heads), layers)
        hidden = int(self.field("embedding_length", 0))
        head_dim = hidden // max(1, max(heads))
        key = int(self.field("attention.key_length", head_dim))
        value = int(self.field("attention.value_length", head_dim))
        vocab = self.field("vocab_size") or self.metadata.get("tokenizer.ggml.tokens", 0)
        attention = sum(h * (key + value) for h, kv in zip(heads, kv_heads, strict=False)
                        if kv > 0)
        return Shape(kv_values_per_token=sum(kv_heads) * (key + value), heads=max(heads),
                     hidden=hidden, vocab=int(vocab),
                     context_length=int(self.field("context_length", 2048)),
                     attention_width=attention)


def _per_layer(value: Any, layers: int) -> list[int]:
    """A per-layer count (a GGUF array for hybrid models, 0 where a layer has no KV)."""
    if isinstance(value, list):
        return [int(v) for v in value[:layers]]
    return [int(value)] * layers


class TruncatedHeader(ValueError):
    """The bytes given end inside the header: `needed` is at least how many it takes."""

    def __init__(self, needed: int) -> None:
        super().__init__(f"the GGUF header needs more than the {needed:,} bytes read")
        self.needed = needed


_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def split_name(name: str) -> tuple[str, int, int] | None:
    """(stem, part, parts) of a shard of a model split over several files, numbered from 1
    ('m-00002-of-00003.gguf': ('m', 2, 3)); None for any other name."""
    match = _SPLIT.match(name)
    if match is None or not 1 <= int(match["no"]) <= int(match["count"]):
        return None
    return match["stem"], int(match["no"]), int(match["count"])


def split_parts(path: Path) -> list[Path] | None:
    """Every shard of the split model `path` is a shard of, in order (those on this disk
    and those missing alike); None when `path` is no shard."""
    split = split_name(path.name)
    if split is None:
        return None
    stem, _no, count = split
    return [path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def merge_split(parts: list[tuple[GGUFHeader, int]]) -> GGUFHeader:
    """One header for a model split over several files, from each shard's (header, file
    size), in order: the first shard's metadata, every shard's tensors, as if their data were
    one run after all the headers: data_start is the headers' sum, so the shards' total size
    minus data_start is the weights (what fit and speed read), and each tensor's offset is
    shifted by the weights of the shards before it."""
    first = parts[0][0]
    dims: dict[str, tuple[int, ...]] = {}
    offsets: dict[str, int] = {}
    types: dict[str, int] = {}
    shift = 0
    for header, size in parts:
        dims.update(header.tensor_dims)
        types.update(header.tensor_types)
        offsets.update({name: shift + offset for name, offset in header.tensor_offsets.items()})
        shift += size - header.data_start
    return GGUFHeader(first.metadata, dims, sum(h.data_start for h, _ in parts), offsets,
                      types)


def read_gguf_model(path: Path) -> tuple[GGUFHeader, int]:
    """The header and size of the model `path` holds: a single file's, or for a shard of a
    split model every shard's merged (merge_split) and their total size. OSError when a
    shard is missing."""
    shards = split_parts(path) or [path]
    parts = [(read_gguf(p), p.stat().st_size) for p in shards]
    if len(parts) == 1:
        return parts[0]
    return merge_split(parts), sum(size for _, size in parts)


def read_gguf(path: Path) -> GGUFHeader:
    """Metadata and tensor shapes of a GGUF, from its header alone (milliseconds)."""
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        return parse_gguf(data)


def parse_gguf(data: Buffer) -> GGUFHeader:
    """The header from a GGUF's first bytes (a whole file mapped, or only its start, as read
    from a remote file with an HTTP range request): TruncatedHeader when they end too soon."""
    if data[:4] != b"GGUF":
        raise ValueError("not a GGUF file")
    try:
        n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = _string(data, pos)
            (kind,) = struct.unpack_from("<I", data, pos)
            metadata[key], pos = _value(data, pos + 4, kind)
        dims: dict[str, tuple[int, ...]] = {}
        offsets: dict[str, int] = {}
        types: dict[str, int] = {}
        for _ in range(n_tensors):
            name, pos = _string(data, pos)
            (n_dims,) = struct.unpack_from("<I", data, pos)
            dims[name] = struct.unpack_from(f"<{n_dims}Q", data, pos + 4)
            pos += 4 + 8 * n_dims
            types[name], offsets[name] = struct.unpack_from("<IQ", data, pos)
            pos += 12
    except struct.error:
        raise TruncatedHeader(len(data)) from None
    if pos > len(data):  # a skipped string array ran past the end without reading it
        raise TruncatedHeader(pos)
    alignment = int(metadata.get("general.alignment", 32))
    return GGUFHeader(metadata, dims, -(-pos // alignment) * alignment, offsets, types)


def _string(data: Buffer, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", data, pos)
    return data[pos + 8 : pos + 8 + n].decode("utf-8", "replace"), pos + 8 + n


def _value(data: Buffer, pos: int, kind: int) -> tuple[Any, int]:
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, data, pos)[0], pos + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(data, pos)
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF value type {kind}")
    item, count = struct.unpack_from("<IQ", data, pos)
    pos += 12
    if item in _SCALARS:
        fmt = _SCALARS[item]
        end = pos + count * struct.calcsize(fmt)
        values = list(struct.unpack_from(f"<{count}{fmt[1]}", data, pos)) if count < 4096 else []
        return values, end
    for _ in range(count):  # strings (the vocabulary) or nested arrays: only their count
        if item == _STRING:
            pos += 8 + struct.unpack_from("<Q", data, pos)[0]
        else:
            pos = _value(data, pos, item)[1]
    return count, pos
