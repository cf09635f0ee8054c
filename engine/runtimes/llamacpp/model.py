"""Load a GGUF file into llama.cpp through llama-cpp-python's low-level API.

One model, one context whose KV memory is unified across `n_seq_max` sequences: the prefix
pool and the batch rows are sequences in it, so sharing a prefix is `seq_cp` (cells shared,
nothing copied) and rolling back is `seq_rm`. Only the engine thread touches a LlamaCppModel.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.core import host_logits, huge_pages
from engine.core.memory import free_memory
from engine.errors import ModelLoadError
from engine.events import ModelInfo, SamplingDefaults
from engine.gguf_header import read_gguf, read_gguf_model
from engine.runtimes.llamacpp.cpu_backend import BUILT_IN, CpuBackend, ensure_cpu_backend
from engine.runtimes.llamacpp.tokenizer import LlamaCppTokenizer

LLAMA_CPP = "llama.cpp"
DEFAULT_CONTEXT = 8192  # tokens, shared by every cached and running sequence
BATCH_TOKENS = 512  # tokens per llama_decode (llama-cpp-python's Llama default n_batch)
N_SEQ_MAX = 32  # sequences: the prefix pool's entries plus the running rows
LOG_LINES = 20  # llama.cpp log lines kept to explain a failure

Progress = Callable[[str], None]
log = logging.getLogger(__name__)
_log_tail: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
# What llama.cpp said last when it made a context: whether flash attention ("auto") came on.
FLASH_ATTN_LOG = re.compile(r"Flash Attention (enabled|disabled)")
_flash_attn_said: list[str] = []
_log_callback: Any = None  # keeps the ctypes callback alive while llama.cpp may call it
_backend_ready = False


def import_llama_cpp() -> Any:
    """The llama_cpp module, or ModelLoadError saying how to get it."""
    try:
        import llama_cpp
    except ImportError:
        raise ModelLoadError(
            "the llama.cpp engine needs llama-cpp-python: run `make llama-cpp`, or use "
            "--engine torch") from None
    return llama_cpp


def _init_backend(llama_cpp: Any, smoke_model: Path | None = None,
                  progress: Progress | None = None) -> CpuBackend:
    """Once per process: route llama.cpp's log into ours (kept for error messages), and load
    the CPU backend variant this CPU runs best (cpu_backend.py; smoke_model: the GGUF its smoke
    runs decode when the choice is not cached yet)."""
    global _backend_ready, _log_callback
    if _backend_ready:
        return ensure_cpu_backend(llama_cpp, smoke_model, progress=progress)

    # llama-cpp-python's ctypes callback decorator carries no annotations
    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def on_log(level: int, text: bytes, _user: Any) -> None:
        line = text.decode("utf-8", "replace").strip()
        if line:
            _log_tail.append(line)
            said = FLASH_ATTN_LOG.search(line)
            if said:
                _flash_attn_said.append(said.group(1))
            log.debug("llama.cpp: %s", line)

    _log_callback = on_log
    llama_cpp.llama_log_set(on_log, ctypes.c_void_p(0))
    backend = ensure_cpu_backend(llama_cpp, smoke_model, progress=progress)
    llama_cpp.llama_backend_init()
    _backend_ready = True
    return backend


def physical_cores() -> int:
    """Threads for llama.cpp: one per physical core (hyper-threads only contend for the
    same memory bandwidth)."""
    try:
        import psutil

        cores = psutil.cpu_count(logical=False)
    except ImportError:
        cores = None
    return max(1, cores or os.cpu_count() or 1)


@dataclass
class LlamaCppModel:
    """A GGUF loaded into llama.cpp: model, context (KV memory), a reusable batch, and the
    tokenizer adapter. Looks like engine.runtimes.torch.loader.LoadedModel to the engine (info,
    tokenizer, device)."""

    llama_cpp: Any
    model: Any
    ctx: Any
    memory: Any
    vocab: Any
    tokenizer: LlamaCppTokenizer
    info: ModelInfo
    n_vocab: int
    n_batch: int
    n_seq_max: int
    n_threads: int
    kv_bytes_per_token: int
    batch: Any = None
    batch_writer: Any = None  # decode.BatchWriter over `batch`, made on first use
    eog_ids: set[int] | None = None  # end-of-generation tokens, filled on first use
    can_roll_back: bool = True  # False for recurrent/hybrid memory: no partial seq_rm
    context_params: Any = None  # the llama_context_params ctx was made with (a side context's)
    graph_nodes: int = 0  # nodes in a decode's graph, once a graph_meter.GraphMeter saw one
    fresh_memory: list[huge_pages.Range] = field(default_factory=list)  # mapped by the load
    _views: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def logits(self, rows: int) -> torch.Tensor:
        """The last decode's output logits, shape (rows, vocab), a view of llama.cpp's buffer
        (no copy): valid until the next decode."""
        pointer = self.llama_cpp.llama_get_logits(self.ctx)
        address = ctypes.addressof(pointer.contents)
        view = self._views.get((address, rows))
        if view is None:
            array = np.ctypeslib.as_array(pointer, shape=(rows, self.n_vocab))
            view = self._views[(address, rows)] = torch.from_numpy(array)
            host_logits.register(view, array)
        return view

    def close(self) -> None:
        """Free the batch, context and model (the engine drops the object afterwards)."""
        lib = self.llama_cpp
        if self.batch is not None:
            lib.llama_batch_free(self.batch)
            self.batch = self.batch_writer = None
        if self.ctx is not None:
            lib.llama_free(self.ctx)
            self.ctx = None
        if self.model is not None:
            lib.llama_model_free(self.model)
            self.model = None
        for view in self._views.values():
            host_logits.forget(view)
        self._views.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at shutdown the library may be gone already
            self.close()


def load_gguf(
    path: Path,
    *,
    name: str,
    source: str,
    context_length: int | None = None,
    n_threads: int | None = None,
    progress: Progress | None = None,
    flash_attn: bool | None = None,
) -> LlamaCppModel:
    """Load a GGUF into llama.cpp; ModelLoadError with one actionable line on failure.
    flash_attn: None chooses by a timing cached per model and CPU (attention.py); True / False
    force it (benchmarks; False runs attention as llama-cpp-python's Llama does by
    default)."""
    notify = progress or (lambda _m: None)
    llama_cpp = import_llama_cpp()
    _check_readable(path)
    backend = _init_backend(llama_cpp, path, progress)
    notify("loading GGUF into llama.cpp")
    _log_tail.clear()
    params = llama_cpp.llama_model_default_params()
    paged = _weights_in_own_memory(path)
    if paged:
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
    before = huge_pages.anonymous_ranges() if paged else []
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ModelLoadError(_load_failure(path))
    try:
        loaded = _with_context(llama_cpp, model, path, name, source, context_length,
                               n_threads, flash_attn, backend, progress)
    except BaseException:
        llama_cpp.llama_model_free(model)
        raise
    if paged:
        loaded.fresh_memory = huge_pages.new_ranges(before, huge_pages.anonymous_ranges())
    return loaded


def _weights_in_own_memory(path: Path) -> bool:
    """Whether to read the weights into the process's memory (which can move to huge pages
    once loaded: core/huge_pages.py) rather than map the file (which here cannot). Only where
    huge pages are on and the file fits twice in what is free: a mapped file's pages can be
    dropped and read again under memory pressure, the process's own cannot."""
    if not huge_pages.supported():
        return False
    free = free_memory()
    return free is not None and 2 * path.stat().st_size <= free


def _context_params(llama_cpp: Any, n_ctx: int, n_seq: int, threads: int,
                    flash_attn: bool | None) -> Any:
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = cparams.n_ubatch = min(BATCH_TOKENS, n_ctx)
    cparams.n_seq_max = min(n_seq, llama_cpp.llama_max_parallel_sequences())
    cparams.n_threads = cparams.n_threads_batch = threads
    # Flash attention "auto" lets llama.cpp decide per model and device (it may not be able
    # to run it); off runs attention as a masked product over every used cell.
    cparams.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED if flash_attn is False
                               else llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO)
    cparams.kv_unified = True  # one cell pool: seq_cp shares cells, sequences vary in length
    cparams.swa_full = True  # sliding-window layers keep what a rollback to a prefix needs
    cparams.no_perf = True
    return cparams


def _with_context(llama_cpp: Any, model: Any, path: Path, name: str, source: str,
                  context_length: int | None, n_threads: int | None,
                  flash_attn: bool | None, backend: CpuBackend,
                  progress: Progress | None) -> LlamaCppModel:
    trained = llama_cpp.llama_model_n_ctx_train(model)
    n_ctx = min(trained, context_length or DEFAULT_CONTEXT)
    threads = n_threads or physical_cores()
    if flash_attn is None and not llama_cpp.llama_model_is_recurrent(model):
        from engine.runtimes.llamacpp.attention import choose_flash_attention

        def probe_context(flash: bool, probe_ctx: int, n_seq: int) -> Any:
            return _new_context(llama_cpp, model, _context_params(
                llama_cpp, min(probe_ctx, trained), n_seq, threads, flash), flash)

        flash_attn = choose_flash_attention(llama_cpp, model, path, probe_context, n_ctx,
                                            threads, backend, progress)
    # The engine's sequences (the prefix pool's entries plus the running rows) share the KV
    # memory; flash attention skips the cells a row's mask hides (attention.py: chosen by
    # measurement).
    cparams = _context_params(llama_cpp, n_ctx, N_SEQ_MAX, threads, flash_attn)
    kv_per_token = _kv_bytes_per_token(llama_cpp, model)
    _log_tail.clear()
    _flash_attn_said.clear()
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        need = kv_per_token * n_ctx / 2**20
        raise ModelLoadError(
            f"llama.cpp could not allocate a {n_ctx}-token context for {path.name} (about "
            f"{need:.0f} MiB of KV cache; {_last_error() or 'out of memory'}): try a smaller "
            "context (context_length)")
    try:
        loaded = _assemble(llama_cpp, model, ctx, path, name, source, n_ctx, threads,
                           kv_per_token, backend.variant)
    except BaseException:
        llama_cpp.llama_free(ctx)
        raise
    loaded.context_params = cparams
    return loaded


def _new_context(llama_cpp: Any, model: Any, cparams: Any, flash: bool) -> Any:
    """A context, or None where llama.cpp could not make one, or would not turn flash
    attention on when asked (its "auto" said disabled)."""
    _flash_attn_said.clear()
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if ctx and flash and _flash_attn_said[-1:] != ["enabled"]:
        llama_cpp.llama_free(ctx)
        return None
    return ctx or None


def _assemble(llama_cpp: Any, model: Any, ctx: Any, path: Path, name: str, source: str,
              n_ctx: int, threads: int, kv_per_token: int, variant: str) -> LlamaCppModel:
    vocab = llama_cpp.llama_model_get_vocab(model)
    tokenizer = LlamaCppTokenizer(llama_cpp, model, vocab)
    info = ModelInfo(
        name=name,
        source=source,
        path=str(path),
        device="cpu",
        dtype=_file_type(llama_cpp, model, path),
        context_length=n_ctx,
        parameters=int(llama_cpp.llama_model_n_params(model)),
        weight_bytes_per_step=weight_bytes_per_step(path, int(llama_cpp.llama_model_size(model))),
        kernel=kernel_label(threads, _flash_attn_said[-1:] == ["enabled"], variant),
        template_fallback=tokenizer.chat_template is None,
        engine=LLAMA_CPP,
        sampling_defaults=_sampling_defaults(path),
    )
    loaded = LlamaCppModel(
        llama_cpp=llama_cpp, model=model, ctx=ctx, memory=llama_cpp.llama_get_memory(ctx),
        vocab=vocab, tokenizer=tokenizer, info=info,
        n_vocab=int(llama_cpp.llama_vocab_n_tokens(vocab)),
        n_batch=int(llama_cpp.llama_n_batch(ctx)),
        n_seq_max=int(llama_cpp.llama_n_seq_max(ctx)), n_threads=threads,
        kv_bytes_per_token=kv_per_token,
        can_roll_back=not (llama_cpp.llama_model_is_recurrent(model)
                           or llama_cpp.llama_model_is_hybrid(model)),
    )
    loaded.batch = llama_cpp.llama_batch_init(loaded.n_batch, 0, loaded.n_seq_max)
    return loaded


def _sampling_defaults(path: Path) -> SamplingDefaults:
    """What the file suggests for sampling (general.sampling.*); none where it cannot say."""
    try:
        return read_gguf(path).sampling_defaults()
    except (OSError, ValueError, struct.error):
        return SamplingDefaults()


def _check_readable(path: Path) -> None:
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (bad magic bytes)")


def kernel_label(threads: int, flash_attn: bool, variant: str = BUILT_IN) -> str:
    """"llama.cpp-zen4-2t-fa": the CPU backend variant running (none named for a build with
    the backend linked in), the threads, and "-fa" where llama.cpp said it turned flash
    attention on (it decides "auto" per model and device as it makes the context)."""
    named = "" if variant == BUILT_IN else f"-{variant}"
    return f"llama.cpp{named}-{threads}t" + ("-fa" if flash_attn else "")


def _last_error() -> str:
    for line in reversed(_log_tail):
        if "error" in line.lower() or "failed" in line.lower():
            return line
    return _log_tail[-1] if _log_tail else ""


def _load_failure(path: Path) -> str:
    """One line for a file llama.cpp refused, from what its log said."""
    text = "\n".join(_log_tail)
    marker = "unknown model architecture:"
    if marker in text:
        arch = text.split(marker, 1)[1].split("\n", 1)[0].strip().strip("'\"")
        return (f"llama.cpp does not support the architecture {arch!r} of {path.name}: "
                "try --engine torch")
    detail = _last_error()
    return f"{path} is corrupt or truncated, or a GGUF llama.cpp cannot read" + (
        f" ({detail})" if detail else "")


def _file_type(llama_cpp: Any, model: Any, path: Path) -> str:
    """The file's quantization: its header's general.file_type ("Q4_K_M"), else llama.cpp's
    description of the model without its architecture and size ("llama 1B Q4_K - Medium" ->
    "Q4_K - Medium": its last word alone was "Medium")."""
    try:
        named = read_gguf(path).file_type()
    except (OSError, ValueError, struct.error):
        named = None
    if named:
        return named
    buf = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(model, buf, len(buf))
    words = buf.value.decode("utf-8", "replace").split()
    return " ".join(words[2:]) or (words[-1] if words else "gguf")


def _kv_bytes_per_token(llama_cpp: Any, model: Any) -> int:
    """f16 keys and values of every layer for one position."""
    n_head = max(1, llama_cpp.llama_model_n_head(model))
    head_dim = llama_cpp.llama_model_n_embd(model) // n_head
    kv_heads = llama_cpp.llama_model_n_head_kv(model)
    return int(llama_cpp.llama_model_n_layer(model) * 2 * kv_heads * head_dim * 2)


def weight_bytes_per_step(path: Path, total: int) -> int:
    """Quantized bytes one decode step reads (GGUFHeader.step_bytes: every tensor once, one
    row of an untied input embedding table); `total`, llama.cpp's own size of the weights,
    when the header cannot be read."""
    try:
        header, size = read_gguf_model(path)  # a split model: all its shards
    except (OSError, ValueError, struct.error):
        return total
    return header.step_bytes(size)


def warm_up_llama(loaded: LlamaCppModel) -> None:
    """Decode a few tokens on a scratch sequence, then clear the memory, so the first reply
    does not pay llama.cpp's one-time graph and buffer set-up inside its measured prefill."""
    lib = loaded.llama_cpp
    tokens = lib.llama_token * 4
    token = loaded.tokenizer.bos_token_id or loaded.tokenizer.eos_token_id or 0
    batch = lib.llama_batch_get_one(tokens(*([token] * 4)), 4)
    lib.llama_decode(loaded.ctx, batch)
    lib.llama_memory_clear(loaded.memory, True)
