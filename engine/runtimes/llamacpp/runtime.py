"""The llama.cpp runtime behind the core's `Runtime` seam (engine/core/runtime.py): a GGUF in
one llama.cpp context, and the session, batcher, prefix cache and draft model the engine
thread asks of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llama_cpp
import torch

from engine.core.batch import BatchCore, Done, Emit
from engine.core.huge_pages import HugePages
from engine.core.ledger import KvLedger
from engine.core.runtime import ENGINE_SCHEDULE, BatchSchedule, Progress
from engine.core.solo import SoloSession
from engine.core.speculative import TokenProposer
from engine.errors import ModelLoadError
from engine.events import ModelInfo
from engine.model_files import classify
from engine.runtime_choice import gguf_path
from engine.runtimes.llamacpp.batcher import LlamaBatcher
from engine.runtimes.llamacpp.cpu_backend import system_info
from engine.runtimes.llamacpp.draft import LlamaDraftModel, load_llama_draft
from engine.runtimes.llamacpp.model import LlamaCppModel, load_gguf, warm_up_llama
from engine.runtimes.llamacpp.prefix_pool import SeqPrefixCache
from engine.runtimes.llamacpp.session import LlamaSession, eos_ids
from engine.runtimes.llamacpp.side_prefill import side_threads


class LlamaRuntime:
    """A GGUF on llama.cpp's kernels under the core's loop: the core's Runtime."""

    def __init__(self, model: LlamaCppModel) -> None:
        self.model = model
        self._pages = HugePages(model.fresh_memory)

    @property
    def info(self) -> ModelInfo:
        return self.model.info

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def build(self) -> str:
        return f"llama-cpp-python {llama_cpp.__version__}"

    @property
    def system_info(self) -> str:
        return system_info(llama_cpp)

    @property
    def cpu_threads(self) -> int:
        return self.model.n_threads

    @property
    def supports_batching(self) -> bool:
        return True  # every row is a KV sequence of its own in one context

    @property
    def drafts_in_batch(self) -> bool:
        return self.model.can_roll_back  # each row's sequence takes a draft, seq_rm its tail

    @property
    def can_prefill_beside(self) -> bool:
        return side_threads(self.model) >= 1

    def new_prefix_cache(self, budget_bytes: int) -> KvLedger[Any]:
        return SeqPrefixCache(self.model, budget_bytes)

    def new_session(self, prefix_cache: KvLedger[Any],
                    draft: TokenProposer | None = None) -> SoloSession:
        return LlamaSession(self.model, _own(prefix_cache), draft)

    def new_batcher(self, prefix_cache: KvLedger[Any], emit: Emit, done: Done,
                    schedule: BatchSchedule = ENGINE_SCHEDULE) -> BatchCore:
        return LlamaBatcher(self.model, _own(prefix_cache), emit, done,
                            interleave=schedule.interleave, beside=schedule.beside,
                            lone_chunk=self.model.n_batch if schedule.one_pass else None)

    def load_draft(self, spec: str, *, kernel: str = "auto", progress: Progress | None = None,
                   **options: Any) -> LlamaDraftModel:
        """A draft GGUF in a second context; torch's options (dtype, device) do not apply."""
        if kernel != "auto":
            raise ModelLoadError("--draft-kernel chooses a torch decode path; a llama.cpp draft "
                                 "runs its GGUF's own quantization")
        if classify(spec) not in ("default", "gguf"):
            raise ModelLoadError(f"a llama.cpp model's draft must be a .gguf file too; {spec} "
                                 "is not one (or load the model with --engine torch)")
        path, name, source = gguf_path(spec)
        draft = load_llama_draft(path, self.model, name=name, source=source, progress=progress)
        self._pages.add(draft.loaded.fresh_memory)
        return draft

    def idle_work(self) -> bool:
        return self._pages.step()

    @property
    def memory_pages(self) -> str:
        return self._pages.describe()

    def close(self) -> None:
        self.model.close()


def load_llama(path: Path, *, name: str, source: str, progress: Progress | None,
               context_length: int | None, flash_attn: bool | None = None) -> LlamaRuntime:
    """Load a GGUF into one context and warm it up (flash_attn: load_gguf's)."""
    model = load_gguf(path, name=name, source=source, context_length=context_length,
                      progress=progress, flash_attn=flash_attn)
    if progress:
        progress("warming up")
    warm_up_llama(model)
    eos_ids(model)  # a vocabulary scan (~30 ms): at load, not in the first reply's queue
    # torch only samples here, on vectors; with more threads its idle OpenMP workers spin on
    # the cores llama.cpp decodes on (measured: decode x2 on the 2-core VM with one thread).
    torch.set_num_threads(1)
    return LlamaRuntime(model)


def _own(prefix_cache: KvLedger[Any]) -> SeqPrefixCache:
    """The prefix cache must be this runtime's: another runtime's KV cannot feed this model."""
    if not isinstance(prefix_cache, SeqPrefixCache):
        raise TypeError("a llama.cpp model was handed another runtime's prefix cache")
    return prefix_cache
