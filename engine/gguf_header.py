"""A GGUF file's header, read without the gguf package (whose reader parses every value into
numpy and took seconds for a large vocabulary): metadata, tensor shapes, where the data starts.

fit.py reads the model's shape from it; the llama.cpp engine, the sampling settings a GGUF may
carry (llama.cpp's general.sampling.* keys).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Shape:
    """What the KV cache and the working buffers depend on (engine/tools/fit.py's estimate; here,
    below fit, because a GGUF's header is one of the two places it is read from)."""

    kv_values_per_token: int  # sum over layers with KV of kv_heads x (key + value dims)
    heads: int
    hidden: int
    vocab: int
    context_length: int  # what the model was trained for


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]  # scalars and numeric arrays; a string array is its length
    tensor_dims: dict[str, tuple[int, ...]]
    data_start: int

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
        return Shape(kv_values_per_token=sum(kv_heads) * (key + value), heads=max(heads),
                     hidden=hidden, vocab=int(vocab),
                     context_length=int(self.field("context_length", 2048)))


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
        for _ in range(n_tensors):
            name, pos = _string(data, pos)
            (n_dims,) = struct.unpack_from("<I", data, pos)
            dims[name] = struct.unpack_from(f"<{n_dims}Q", data, pos + 4)
            pos += 4 + 8 * n_dims + 4 + 8  # dims, type, offset
    except struct.error:
        raise TruncatedHeader(len(data)) from None
    if pos > len(data):  # a skipped string array ran past the end without reading it
        raise TruncatedHeader(pos)
    alignment = int(metadata.get("general.alignment", 32))
    return GGUFHeader(metadata, dims, -(-pos // alignment) * alignment)


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
