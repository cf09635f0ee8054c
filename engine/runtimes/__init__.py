"""The runtimes, and the one door to them: `load` puts a model on the runtime
engine/runtime_choice.py picks and returns it as the core's `Runtime` (engine/core/runtime.py).

Two runtimes share the engine thread, the events and the metrics: torch (any Hugging Face
folder, GPU first; engine/runtimes/torch/) and llama.cpp (GGUF files, quantized, on CPU;
engine/runtimes/llamacpp/). `auto` runs a .gguf (and the bundled default GGUF) on llama.cpp
when no CUDA device is present and llama-cpp-python is installed, torch otherwise; a folder or
hub id always runs on torch. Each runtime is imported only when a model is loaded on it, so a
process that never loads a GGUF never loads llama.cpp's native library, and the other way
round.
"""

from __future__ import annotations

from typing import Any

from engine.core.ledger import KvLedger
from engine.core.runtime import Progress, Runtime
from engine.runtime_choice import AUTO as AUTO
from engine.runtime_choice import ENGINES as ENGINES
from engine.runtime_choice import LLAMA_CPP as LLAMA_CPP
from engine.runtime_choice import TORCH as TORCH
from engine.runtime_choice import cuda_present as cuda_present
from engine.runtime_choice import engine_reason as engine_reason
from engine.runtime_choice import gguf_path as gguf_path
from engine.runtime_choice import llama_cpp_installed as llama_cpp_installed
from engine.runtime_choice import resolve_engine as resolve_engine


def load(spec: str, engine: str = AUTO, *, kernel: str = AUTO, device: str = AUTO,
         progress: Progress | None = None, context_length: int | None = None,
         **torch_options: Any) -> Runtime:
    """Load a model on the runtime `engine` resolves to, with its decode path chosen and
    warmed up; ModelLoadError with one line on failure, and before loading anything when
    it would not fit in memory at context_length (fit.check)."""
    from engine.errors import ModelLoadError
    from engine.tools import fit

    fit.check(spec, engine, device=device, dtype=torch_options.get("dtype", AUTO),
              context_length=context_length)
    if resolve_engine(spec, engine, device) == TORCH:
        from engine.runtimes.torch.runtime import load_torch

        return load_torch(spec, kernel=kernel, device=device, progress=progress,
                          context_length=context_length, **torch_options)
    if kernel != AUTO:
        raise ModelLoadError("--kernel chooses a torch decode path; the llama.cpp engine runs "
                             "the GGUF's own quantization (or use --engine torch)")
    from engine.runtimes.llamacpp.runtime import load_llama

    path, name, source = gguf_path(spec)
    return load_llama(path, name=name, source=source, progress=progress,
                      context_length=context_length)


def switch_prefix_cache(previous: KvLedger[Any] | None, runtime: Runtime,
                        budget_bytes: int) -> KvLedger[Any]:
    """The prefix cache for a newly loaded model: a fresh one over its runtime's KV store that
    takes over the previous one's ledger (its entries go; each chat's next turn says
    "model_changed")."""
    fresh = runtime.new_prefix_cache(budget_bytes)
    if previous is not None:
        fresh.take_over(previous)
    return fresh


def snapshot_key(runtime: Runtime) -> str:
    """What a KV snapshot must match to be restored: the model's content, the runtime and its
    build, and how the model runs (dtype, kernel, device)."""
    from pathlib import Path

    from engine.core.snapshots import shelf_key
    from engine.model_files import content_fingerprint

    info = runtime.info
    return shelf_key(info.identity, info.dtype, info.kernel, info.device, runtime.build,
                     content_fingerprint(Path(info.path)))
