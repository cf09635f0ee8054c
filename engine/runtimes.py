"""Which runtime runs a model, and the few things that differ between them.

Two local runtimes share the engine thread, the events and the metrics: torch (any Hugging
Face folder, GPU first) and llama.cpp (GGUF files, quantized, on CPU). `auto` runs a .gguf
(and the bundled default GGUF) on llama.cpp when no CUDA device is present and
llama-cpp-python is installed, torch otherwise; a folder or hub id always runs on torch
(that choice: engine/runtime_choice.py, re-exported here). The engine thread and the
benchmarks ask this module for a model's session, batcher and prefix cache instead of
building the torch ones directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.core.ledger import KvLedger
from engine.errors import ModelLoadError
from engine.loader import classify, load_model
from engine.prefix_cache import PrefixCache
from engine.runtime_choice import AUTO as AUTO
from engine.runtime_choice import ENGINES as ENGINES
from engine.runtime_choice import LLAMA_CPP as LLAMA_CPP
from engine.runtime_choice import TORCH as TORCH
from engine.runtime_choice import cuda_present as cuda_present
from engine.runtime_choice import engine_reason as engine_reason
from engine.runtime_choice import gguf_path as gguf_path
from engine.runtime_choice import llama_cpp_installed as llama_cpp_installed
from engine.runtime_choice import resolve_engine as resolve_engine

if TYPE_CHECKING:
    from engine.draft import DraftModel
    from engine.llamacpp.draft import LlamaDraftModel

Progress = Callable[[str], None]
Model = Any  # LoadedModel (torch) or engine.llamacpp.model.LlamaCppModel


def load(spec: str, engine: str = AUTO, *, kernel: str = AUTO, device: str = AUTO,
         progress: Progress | None = None, context_length: int | None = None,
         **torch_options: Any) -> Model:
    """Load a model on the runtime `engine` resolves to, with its decode path chosen and
    warmed up; ModelLoadError with one line on failure, and before loading anything when
    it would not fit in memory at context_length (fit.check)."""
    import dataclasses

    import torch

    from engine import fit
    from engine.kernels import allowed_cpus

    fit.check(spec, engine, device=device, dtype=torch_options.get("dtype", AUTO),
              context_length=context_length)
    if resolve_engine(spec, engine, device) == TORCH:
        from engine.generate import warm_up
        from engine.kernels import select_kernel

        torch.set_num_threads(allowed_cpus())  # a llama.cpp model before may have left 1
        loaded = load_model(spec, device=device, progress=progress, **torch_options)
        loaded = select_kernel(loaded, kernel, progress=progress)
        if progress:
            progress("warming up")
        warm_up(loaded)
        if context_length and context_length < loaded.info.context_length:
            loaded.info = dataclasses.replace(loaded.info, context_length=context_length)
        return loaded
    if kernel != AUTO:
        raise ModelLoadError("--kernel chooses a torch decode path; the llama.cpp engine runs "
                             "the GGUF's own quantization (or use --engine torch)")
    from engine.llamacpp.model import load_gguf, warm_up_llama

    path, name, source = gguf_path(spec)
    gguf_model = load_gguf(path, name=name, source=source, context_length=context_length,
                           progress=progress)
    if progress:
        progress("warming up")
    warm_up_llama(gguf_model)
    from engine.llamacpp.session import eos_ids

    eos_ids(gguf_model)  # a vocabulary scan (~30 ms): at load, not in the first reply's queue
    # torch only samples here, on vectors; with more threads its idle OpenMP workers spin on
    # the cores llama.cpp decodes on (measured: decode x2 on the 2-core VM with one thread).
    torch.set_num_threads(1)
    return gguf_model


def cpu_threads(loaded: Model) -> int:
    """The CPU threads a model's forward passes run on (a peer gets as many)."""
    if is_llama_cpp(loaded):
        return int(loaded.n_threads)
    import torch

    return torch.get_num_threads()


def is_llama_cpp(loaded: Model) -> bool:
    return bool(loaded.info.engine == LLAMA_CPP)


def new_prefix_cache(loaded: Model, budget_bytes: int) -> KvLedger[Any]:
    """The prefix cache for this model: KV tensors (torch) or KV sequences (llama.cpp)."""
    if is_llama_cpp(loaded):
        from engine.llamacpp.prefix_pool import SeqPrefixCache

        return SeqPrefixCache(loaded, budget_bytes)
    return PrefixCache(loaded.model.config, budget_bytes, loaded.device)


def new_session(loaded: Model, prefix_cache: Any, draft: Any = None) -> Any:
    """The decode loop for one request (DecodeSession or LlamaSession: run(request,
    timeline, cancel, emit) -> GenerationResult)."""
    if is_llama_cpp(loaded):
        from engine.llamacpp.session import LlamaSession

        return LlamaSession(loaded, prefix_cache, draft)
    from engine.generate import DecodeSession

    return DecodeSession(loaded, prefix_cache, draft=draft)


def load_draft(spec: str, target: Model, *, kernel: str = AUTO,
               progress: Progress | None = None, **torch_options: Any
               ) -> DraftModel | LlamaDraftModel:
    """A draft model for target's speculative="draft" requests, on target's runtime: a GGUF
    in a second llama.cpp context for a llama.cpp model (engine/llamacpp/draft.py), else
    engine/draft.py's torch draft; ModelLoadError with one line on failure."""
    if not is_llama_cpp(target):
        from engine.draft import load_draft as load_torch_draft

        return load_torch_draft(spec, target, kernel=kernel, progress=progress,
                                **torch_options)
    if kernel != AUTO:
        raise ModelLoadError("--draft-kernel chooses a torch decode path; a llama.cpp draft "
                             "runs its GGUF's own quantization")
    if classify(spec) not in ("default", "gguf"):
        raise ModelLoadError(f"a llama.cpp model's draft must be a .gguf file too; {spec} is "
                             "not one (or load the model with --engine torch)")
    from engine.llamacpp.draft import load_llama_draft

    path, name, source = gguf_path(spec)
    return load_llama_draft(path, target, name=name, source=source, progress=progress)


def supports_batching(loaded: Model) -> bool:
    if is_llama_cpp(loaded):
        return True
    from engine.batching import cache_supports_batching

    return cache_supports_batching(loaded)


def new_batcher(loaded: Model, prefix_cache: Any, emit: Any, done: Any) -> Any:
    """The continuous batcher for this model (admit / step / rows / room)."""
    if is_llama_cpp(loaded):
        from engine.llamacpp.batcher import LlamaBatcher

        return LlamaBatcher(loaded, prefix_cache, emit, done)
    from engine.batching import Batcher

    return Batcher(loaded, prefix_cache, emit, done)


def close(loaded: Model | None) -> None:
    """Free a model's native memory now (llama.cpp); torch models are freed by the GC."""
    if loaded is not None and is_llama_cpp(loaded):
        loaded.close()


def snapshot_key(loaded: Model) -> str:
    """What a KV snapshot must match to be restored: the model's content, the runtime and its
    build, and how the model runs (dtype, kernel, device)."""
    from pathlib import Path

    from engine.core.snapshots import shelf_key
    from engine.loader import content_fingerprint

    info = loaded.info
    if is_llama_cpp(loaded):
        import llama_cpp

        build = f"llama-cpp-python {llama_cpp.__version__}"
    else:
        import torch
        import transformers

        build = f"torch {torch.__version__} transformers {transformers.__version__}"
    return shelf_key(info.identity, info.dtype, info.kernel, info.device, build,
                     content_fingerprint(Path(info.path)))


def switch_prefix_cache(pool: KvLedger[Any] | None, old: Model | None, loaded: Model,
                        budget_bytes: int) -> KvLedger[Any]:
    """The prefix cache for a newly loaded model. Every old entry goes (each chat's next turn
    says "model_changed"); a torch pool is reused for a torch model, any other switch gets a
    new pool that keeps the old one's ledger."""
    if pool is None:
        return new_prefix_cache(loaded, budget_bytes)
    if isinstance(pool, PrefixCache) and old is not None and not is_llama_cpp(loaded):
        pool.reset(model_changed=True, config=loaded.model.config, device=loaded.device)
        pool.budget_bytes = budget_bytes
        return pool
    pool.reset(model_changed=old is not None)  # frees an old llama.cpp pool's sequences
    fresh = new_prefix_cache(loaded, budget_bytes)
    fresh.inherit_ledger(pool)
    return fresh
