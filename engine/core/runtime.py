"""The seam between the engine and a runtime: what a model loaded on one runtime hands the engine
thread. Each runtime implements `Runtime` once (engine/runtimes/torch/runtime.py,
engine/runtimes/llamacpp/runtime.py); engine/runtimes/__init__.py loads a model on the runtime
engine/runtime_choice.py picks and returns it. The engine thread, the tools and the tests hold a
`Runtime` and never ask which runtime it is."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from engine.core.batch import BatchCore, Done, Emit
from engine.core.ledger import KvLedger
from engine.core.solo import SoloSession
from engine.core.speculative import TokenProposer
from engine.events import ModelInfo

Progress = Callable[[str], None]


@dataclass(frozen=True)
class BatchSchedule:
    """How a batch reads a joining prompt. The default is the engine's own schedule; the other
    values exist for the benchmark that compares schedules (`bench --interference`).

    interleave: while rows stream, a prompt is read in chunks between (or inside) their steps;
    beside: a long prompt is read on its own cores (a side thread or context) when one is free;
    one_pass: a prompt read alone goes through in one pass (the schedule before chunking)."""

    interleave: bool = True
    beside: bool = True
    one_pass: bool = False


ENGINE_SCHEDULE = BatchSchedule()


class Runtime(Protocol):
    """A model loaded on one runtime, and what only that runtime can build for it. Only the
    engine thread may use the model and what this builds; info and tokenizer are safe to read
    from any thread."""

    @property
    def info(self) -> ModelInfo: ...

    @property
    def tokenizer(self) -> Any:
        """A Hugging Face tokenizer, or one that behaves like it (engine/core/prompt.py)."""
        ...

    @property
    def build(self) -> str:
        """The runtime and its version ("torch 2.13.0 transformers 5.24.0"): part of a KV
        snapshot's key, since another build may lay KV out differently."""
        ...

    @property
    def system_info(self) -> str:
        """What runs its kernels on this machine: llama.cpp's CPU features as its loaded CPU
        backend variant reports them, or torch's build and CPU capability (`bench --json`)."""
        ...

    @property
    def cpu_threads(self) -> int:
        """The CPU threads its forward passes run on (a peer in a benchmark gets as many)."""
        ...

    @property
    def supports_batching(self) -> bool:
        """Whether requests may share a decode batch (a cache of plain attention layers)."""
        ...

    @property
    def drafts_in_batch(self) -> bool:
        """Whether a batch row can verify a prompt-lookup draft in the batch's step (its KV
        takes several positions a step and gives a rejected tail back); if not, speculative
        requests run alone."""
        ...

    @property
    def can_prefill_beside(self) -> bool:
        """Whether a long prompt can be read on its own cores beside streaming rows."""
        ...

    def new_prefix_cache(self, budget_bytes: int) -> KvLedger[Any]:
        """An empty prefix cache over this runtime's KV store."""
        ...

    def new_session(self, prefix_cache: KvLedger[Any],
                    draft: TokenProposer | None = None) -> SoloSession:
        """The core's loop for one request alone, on this runtime's runner."""
        ...

    def new_batcher(self, prefix_cache: KvLedger[Any], emit: Emit, done: Done,
                    schedule: BatchSchedule = ENGINE_SCHEDULE) -> BatchCore:
        """The core's continuous batch on this runtime's rows."""
        ...

    def load_draft(self, spec: str, *, kernel: str = "auto", progress: Progress | None = None,
                   **options: Any) -> TokenProposer:
        """A draft model for speculative="draft" requests, on this runtime, its vocabulary
        checked against this model's; ModelLoadError with one line on failure."""
        ...

    def idle_work(self) -> bool:
        """One short piece (a few ms) of work that makes later steps faster, for the engine
        thread to do while nothing waits; False once none is left. llama.cpp: a 2 MiB piece of
        the model's memory moved to a huge page (core/huge_pages.py)."""
        ...

    @property
    def memory_pages(self) -> str:
        """How the model's memory is paged, for `bench --json` ("160 of 162 MiB in 2 MiB
        pages"); "" where the runtime leaves it to the system."""
        ...

    def close(self) -> None:
        """Free native memory now (the garbage collector frees the rest)."""
        ...
