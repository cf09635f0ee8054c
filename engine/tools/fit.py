"""Will it fit? Memory a model needs on its engine and device, estimated before loading.

needed = weights + KV cache at the chosen context + working buffers, against the memory free
now (MemAvailable, or the GPU's free memory). Read from the files alone, without transformers
or llama.cpp: a GGUF's header, a folder's config.json and safetensors headers.

- weights: llama.cpp maps the GGUF's tensor data as stored (quantized); torch holds every
  tensor in its load dtype (a GGUF dequantized, a folder's tensors converted).
- KV: for each layer that keeps one, kv_heads x (key dim + value dim) per token, x context x
  bytes (f16 in llama.cpp, the model dtype in torch). Sliding-window layers count at full size:
  both engines keep every position so a chat can roll back (llama.cpp's swa_full, and
  prefix_cache.new_cache); convolution and linear-attention layers keep no KV.
- working buffers: llama.cpp reserves its compute graph for a 512-token batch over the whole
  context (the attention mask in f32; flash attention keeps no per-head scores) and logits per
  sequence; torch needs the activations of one prefill chunk.

A model that cannot fit is refused before loading, in one line that offers the largest
context that does fit, instead of failing with an out-of-memory error half way through.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from engine.core.memory import free_memory
from engine.gguf_header import GGUFHeader, Shape, read_gguf_model

MIN_CONTEXT = 512  # a smaller context is not worth offering
TORCH_OVERHEAD = 0.05  # of the weights: allocator slack, embeddings' copies, small buffers
CONVERSION_PEAK = 1.3  # a GGUF converting for torch peaks at this x the converted weights
_SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2,
                      "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_TORCH_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Estimate:
    """Bytes a model needs at `context` tokens on `engine` / `device`, and bytes free there."""

    engine: str
    device: str
    context: int
    weight_bytes: int
    kv_bytes: int
    buffer_bytes: int
    free_bytes: int | None  # None: this platform does not say
    fitting_context: int | None = None  # the largest context that fits, when this one does not
    peak_bytes: int = 0  # a one-off peak while loading (a GGUF converting for torch)
    model_context: int = 0  # the longest context the model takes (trained); `context` <= it

    @property
    def needed_bytes(self) -> int:
        return max(self.weight_bytes + self.kv_bytes + self.buffer_bytes, self.peak_bytes)

    @property
    def fits(self) -> bool:
        return self.free_bytes is None or self.needed_bytes <= self.free_bytes

    def summary(self) -> str:
        """Every term that is added, e.g. 'needs ~3.1 GB (weights 2.0 GB + KV cache 900 MB at
        8,192 tokens + working buffers 200 MB), 11.2 GB free'; where loading peaks above that
        (a GGUF converting for torch), the peak and then the sum."""
        detail = (f"weights {size(self.weight_bytes)} + KV cache {size(self.kv_bytes)} at "
                  f"{self.context:,} tokens + working buffers {size(self.buffer_bytes)}")
        running = self.weight_bytes + self.kv_bytes + self.buffer_bytes
        if self.peak_bytes > running:
            detail = (f"converting the GGUF for torch peaks at {size(self.peak_bytes)}; then "
                      f"{detail} = {size(running)}")
        free = f"{size(self.free_bytes)} free" if self.free_bytes is not None else "free unknown"
        return f"needs ~{size(self.needed_bytes)} ({detail}), {free}"

    def refusal(self, name: str) -> str:
        """One line: why it does not fit, and what would."""
        where = "GPU memory" if self.device.startswith("cuda") else "memory"
        line = (f"{name} does not fit in {where}: it needs ~{size(self.needed_bytes)} at "
                f"{self.context:,} tokens of context, {size(self.free_bytes)} is free")
        if self.fitting_context:
            return f"{line}; it fits with a context of {self.fitting_context:,} tokens"
        return f"{line}; close other programs or choose a smaller model"


def size(n: int | None) -> str:
    """Bytes for people: '470 MB', '3.1 GB'."""
    n = n or 0
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:,.0f} MB"


# ----- the estimate ------------------------------------------------------------------------
def estimate(spec: str, engine: str = "auto", *, device: str = "auto", dtype: str = "auto",
             context_length: int | None = None) -> Estimate | None:
    """The memory `spec` needs on the engine and device it would load on; None where the
    files do not tell (a hub model not downloaded yet, a folder without safetensors)."""
    from engine.runtime_choice import LLAMA_CPP, gguf_path, resolve_engine

    if resolve_engine(spec, engine, device) == LLAMA_CPP:
        path, _name, _source = gguf_path(spec)
        return llama_cpp_estimate(path, context_length)
    return torch_estimate(spec, device=device, dtype=dtype, context_length=context_length)


def llama_cpp_estimate(path: Path, context_length: int | None = None,
                       free: int | None = -1) -> Estimate:
    """As engine.runtimes.llamacpp.model.load_gguf allocates: tensors mapped as stored, an f16 KV
    cache of n_ctx cells shared by all sequences, and the compute and output buffers (a
    split model: every shard's tensors)."""
    header, file_size = read_gguf_model(path)
    return gguf_estimate(header, file_size, context_length, free)


def gguf_estimate(header: GGUFHeader, file_size: int, context_length: int | None = None,
                  free: int | None = -1) -> Estimate:
    """llama_cpp_estimate from a header and the file's size: a local file, or a remote one
    whose header alone was read (engine/tools/hub.py)."""
    from engine.runtimes.llamacpp.model import BATCH_TOKENS, DEFAULT_CONTEXT, N_SEQ_MAX

    shape = header.shape()
    n_ctx = min(shape.context_length, context_length or DEFAULT_CONTEXT)
    weights = file_size - header.data_start

    def buffers(ctx: int) -> int:
        batch = min(BATCH_TOKENS, ctx)
        mask = batch * ctx * 4  # flash attention materializes no per-head scores: the mask
        logits = batch * shape.vocab * 4
        compute = max(mask, logits) + batch * shape.hidden * 4 * 8
        return compute + N_SEQ_MAX * shape.vocab * 4  # + the output (logits) buffer

    def kv(ctx: int) -> int:
        return shape.kv_values_per_token * ctx * 2

    return _with_free(Estimate("llama.cpp", "cpu", n_ctx, weights, kv(n_ctx), buffers(n_ctx),
                               free_memory("cpu") if free == -1 else free,
                               model_context=shape.context_length),
                      lambda ctx: weights + kv(ctx) + buffers(ctx))


def torch_estimate(spec: str, *, device: str = "auto", dtype: str = "auto",
                   context_length: int | None = None, free: int | None = -1,
                   ) -> Estimate | None:
    """As engine.runtimes.torch.loader loads it: every tensor in the load dtype, a KV cache in
    that dtype (sliding layers full size), one prefill chunk's activations."""
    found = _torch_sources(spec)
    if found is None:
        return None
    elements, shape, converting = found
    return torch_sources_estimate(elements, shape, converting, device=device, dtype=dtype,
                                  context_length=context_length, free=free)


def torch_sources_estimate(elements: int, shape: Shape, converting: bool = False, *,
                           device: str = "auto", dtype: str = "auto",
                           context_length: int | None = None, free: int | None = -1,
                           ) -> Estimate:
    """torch_estimate from what the files hold: a local folder's, or a hub folder's whose
    config and safetensors headers alone were read (engine/tools/hub.py)."""
    from engine.runtimes.torch import loader
    from engine.runtimes.torch.generate import default_prefill_chunk

    torch_device = loader.pick_device(device)
    dtype_name = str(loader.pick_dtype(torch_device, dtype)).removeprefix("torch.")
    size = _TORCH_BYTES.get(dtype_name, 4)
    weights = elements * size
    n_ctx = min(shape.context_length, context_length or shape.context_length)
    chunk = default_prefill_chunk(torch_device)

    def kv(ctx: int) -> int:
        return shape.kv_values_per_token * ctx * size

    def buffers(ctx: int) -> int:
        scores = min(chunk, ctx) * ctx * shape.heads * size
        return int(weights * TORCH_OVERHEAD) + scores + min(chunk, ctx) * shape.hidden * size * 16

    peak = int(weights * CONVERSION_PEAK) if converting else 0
    name = "cuda" if torch_device.type == "cuda" else torch_device.type
    estimate_ = Estimate("torch", str(torch_device), n_ctx, weights, kv(n_ctx), buffers(n_ctx),
                         free_memory(name) if free == -1 else free, peak_bytes=peak,
                         model_context=shape.context_length)
    return _with_free(estimate_, lambda ctx: max(weights + kv(ctx) + buffers(ctx), peak))


def _with_free(est: Estimate, needed_at: Any) -> Estimate:
    """est, with the largest context that fits (in steps of 256) when its own does not."""
    if est.fits or est.free_bytes is None:
        return est
    low, high = MIN_CONTEXT // 256, est.context // 256
    if high < low or needed_at(low * 256) > est.free_bytes:
        return est
    while low < high:  # the largest multiple of 256 that fits
        mid = (low + high + 1) // 2
        low, high = (mid, high) if needed_at(mid * 256) <= est.free_bytes else (low, mid - 1)
    return Estimate(**{**est.__dict__, "fitting_context": low * 256})


def check(spec: str, engine: str = "auto", *, device: str = "auto", dtype: str = "auto",
          context_length: int | None = None, name: str | None = None) -> Estimate | None:
    """The estimate; ModelLoadError with one line (and a context that fits) if it does not
    fit. A model whose files do not tell passes (None)."""
    from engine.errors import ModelLoadError
    from engine.model_files import DEFAULT_MODEL_NAME, classify

    try:
        est = estimate(spec, engine, device=device, dtype=dtype, context_length=context_length)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None  # files it cannot read: the loader says what is wrong with them
    if est is not None and not est.fits:
        default = classify(spec) == "default"
        raise ModelLoadError(est.refusal(name or (DEFAULT_MODEL_NAME if default
                                                  else Path(spec).name)))
    return est


# ----- torch: what the weights hold --------------------------------------------------------
def _torch_sources(spec: str) -> tuple[int, Shape, bool] | None:
    """(elements, shape, still to be converted) of a spec the torch engine loads."""
    from engine import model_files

    kind = model_files.classify(spec)
    if kind in ("default", "gguf"):  # the default is a GGUF too (an installer's bundled copy)
        path = model_files.default_gguf_path() if kind == "default" else Path(spec).expanduser()
        if not path.is_file():
            return None
        header, _size = read_gguf_model(path)
        return header.elements(), header.shape(), not _converted(path)
    if kind == "folder":
        return _folder_sources(Path(spec).expanduser())
    if kind == "hub":
        folder = _hub_folder(spec)
        return _folder_sources(folder) if folder else None
    return None


def _converted(gguf: Path) -> bool:
    """A converted copy of this GGUF is in the cache (in any dtype: the marker's size)."""
    from engine.runtimes.torch.converted import converted_models

    size = gguf.stat().st_size
    return any(m.source == gguf.name and m.source_size == size for m in converted_models())


def _hub_folder(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True,
                                      allow_patterns=["*.json", "*.safetensors"]))
    except Exception:
        return None  # not downloaded yet: the size is not known here


def _folder_sources(folder: Path) -> tuple[int, Shape, bool] | None:
    files = sorted(folder.glob("*.safetensors"))
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not files or not isinstance(config, dict):
        return None
    return sum(safetensors_elements(f) for f in files), config_shape(config), False


def safetensors_elements(path: Path) -> int:
    """Elements of every tensor in a .safetensors file, from its header."""
    return sum(math.prod(shape) for shape, _dtype in safetensors_tensors(path).values())


def safetensors_tensors(path: Path) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, dtype) of each tensor in a .safetensors file, from its header."""
    with path.open("rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    return {k: (list(v["shape"]), str(v["dtype"])) for k, v in header.items()
            if k != "__metadata__"}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a safetensors dtype ("BF16": 2); 4 when unknown."""
    return _SAFETENSORS_BYTES.get(dtype, 4)


def config_shape(config: dict[str, Any]) -> Shape:
    """A Hugging Face config.json's KV shape (a multimodal model's text_config)."""
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else config
    layers = int(text.get("num_hidden_layers") or 0)
    heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    hidden = int(text.get("hidden_size") or 0)
    head_dim = int(text.get("head_dim") or hidden // heads)
    types = text.get("layer_types")
    with_kv = layers
    if isinstance(types, list) and types:  # conv / linear-attention layers keep no KV
        with_kv = sum(1 for t in types if "attention" in str(t) and "linear" not in str(t))
    from engine.runtimes.torch.loader import context_length

    return Shape(kv_values_per_token=with_kv * kv_heads * head_dim * 2, heads=heads,
                 hidden=hidden, vocab=int(text.get("vocab_size") or 0),
                 context_length=context_length(SimpleNamespace(**text)),
                 attention_width=with_kv * heads * head_dim * 2)
