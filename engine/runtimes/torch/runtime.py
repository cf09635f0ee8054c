"""The torch runtime behind the core's `Runtime` seam (engine/core/runtime.py): a Hugging Face
model loaded with its decode path chosen, and the session, batcher, prefix cache and draft
model the engine thread asks of it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import transformers

from engine.core.batch import BatchCore, Done, Emit
from engine.core.ledger import KvLedger
from engine.core.runtime import ENGINE_SCHEDULE, BatchSchedule, Progress
from engine.core.solo import SoloSession
from engine.core.speculative import TokenProposer
from engine.events import ModelInfo
from engine.runtimes.torch.batching import Batcher, cache_supports_batching
from engine.runtimes.torch.draft import DraftModel
from engine.runtimes.torch.draft import load_draft as load_torch_draft
from engine.runtimes.torch.generate import DecodeSession, warm_up
from engine.runtimes.torch.kernels import allowed_cpus, select_kernel
from engine.runtimes.torch.loader import LoadedModel, load_model
from engine.runtimes.torch.prefix_cache import PrefixCache
from engine.runtimes.torch.side_prefill import side_threads

ONE_PASS = 1 << 30  # a prefill chunk no prompt reaches: the whole prompt in one forward


class TorchRuntime:
    """A Hugging Face model on torch (CPU, CUDA or MPS): the core's Runtime."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self._batching = cache_supports_batching(loaded)

    @property
    def info(self) -> ModelInfo:
        return self.loaded.info

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def build(self) -> str:
        return f"torch {torch.__version__} transformers {transformers.__version__}"

    @property
    def system_info(self) -> str:
        from engine.runtimes.torch.kernels import torch_build

        return torch_build()

    @property
    def cpu_threads(self) -> int:
        return torch.get_num_threads()

    @property
    def supports_batching(self) -> bool:
        return self._batching

    @property
    def drafts_in_batch(self) -> bool:
        return False  # the rows share one left-padded cache and step in lockstep

    @property
    def can_prefill_beside(self) -> bool:
        return self.loaded.device.type == "cpu" and side_threads() >= 1

    def new_prefix_cache(self, budget_bytes: int) -> KvLedger[Any]:
        return PrefixCache(self.loaded.model.config, budget_bytes, self.loaded.device)

    def new_session(self, prefix_cache: KvLedger[Any],
                    draft: TokenProposer | None = None) -> SoloSession:
        return DecodeSession(self.loaded, _own(prefix_cache), draft=draft)

    def new_batcher(self, prefix_cache: KvLedger[Any], emit: Emit, done: Done,
                    schedule: BatchSchedule = ENGINE_SCHEDULE) -> BatchCore:
        return Batcher(self.loaded, _own(prefix_cache), emit, done,
                       interleave=schedule.interleave, beside=schedule.beside,
                       prefill_chunk=ONE_PASS if schedule.one_pass else None)

    def load_draft(self, spec: str, *, kernel: str = "auto", progress: Progress | None = None,
                   **options: Any) -> DraftModel:
        return load_torch_draft(spec, self.loaded, kernel=kernel, progress=progress, **options)

    def idle_work(self) -> bool:
        # Nothing to do: torch's weights moved to 2 MiB pages decoded no faster (SmolLM2 on the
        # CPU, its ~16 ms step is not bound by page walks; docs/benchmarks.md).
        return False

    @property
    def memory_pages(self) -> str:
        return ""

    def close(self) -> None:
        """Nothing native to free: the garbage collector frees torch's tensors."""


def load_torch(spec: str, *, kernel: str, device: str, progress: Progress | None,
               context_length: int | None, **options: Any) -> TorchRuntime:
    """Load spec on torch with its decode path chosen (kernel: "auto" measures) and warmed up."""
    torch.set_num_threads(allowed_cpus())  # a llama.cpp model before may have left 1
    loaded = load_model(spec, device=device, progress=progress, **options)
    loaded = select_kernel(loaded, kernel, progress=progress)
    if progress:
        progress("warming up")
    warm_up(loaded)
    if context_length and context_length < loaded.info.context_length:
        loaded.info = dataclasses.replace(loaded.info, context_length=context_length)
    return TorchRuntime(loaded)


def _own(prefix_cache: KvLedger[Any]) -> PrefixCache:
    """The prefix cache must be this runtime's: another runtime's KV cannot feed this model."""
    if not isinstance(prefix_cache, PrefixCache):
        raise TypeError("a torch model was handed another runtime's prefix cache")
    return prefix_cache
