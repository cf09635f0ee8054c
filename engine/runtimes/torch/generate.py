"""The torch runtime's decode pieces: its runner for the core's loop, its chunked prefill.

The loop itself is the core's (engine/core/solo.py for a request alone,
engine/runtimes/torch/batching.py's batch for the rest); this module feeds a Hugging Face model: a
prompt in chunks on top of a prefix-cache lease (ChunkedPrefill), a forward for a step, a crop to
take a draft back. Every token is stamped the moment it is emitted and the KV cache stays ours to
reuse on the next turn. Runs only in the engine thread.
"""

from __future__ import annotations

import os
import threading
from contextlib import AbstractContextManager, nullcontext

import torch

from engine.core.ledger import CacheLease
from engine.core.prefill_progress import PrefillReporter
from engine.core.prompt import template_stops
from engine.core.reply import EmitEvent, Reply, Vocabulary
from engine.core.schedule import CPU_PREFILL_CHUNK, GPU_PREFILL_CHUNK, PREFILL_CHUNK_ENV
from engine.core.solo import SoloSession
from engine.core.speculative import TokenProposer
from engine.runtimes.torch.layer_progress import LayerProgress, decoder_layers
from engine.runtimes.torch.loader import LoadedModel
from engine.runtimes.torch.prefix_cache import (
    PrefixCache,
    checkpoint_if_due,
    crop_to,
    model_rollback_blocker,
)


def default_prefill_chunk(device: torch.device) -> int:
    """Prompt tokens per prefill forward on this device (PHASEWISE_PREFILL_CHUNK overrides)."""
    override = os.environ.get(PREFILL_CHUNK_ENV, "")
    if override.isdigit() and int(override) > 0:
        return int(override)
    return GPU_PREFILL_CHUNK if device.type == "cuda" else CPU_PREFILL_CHUNK


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for source in (loaded.tokenizer.eos_token_id, loaded.model.generation_config.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return ids


@torch.inference_mode()
def warm_up(loaded: LoadedModel) -> None:
    """One short forward pass, so the first reply does not pay one-time kernel set-up
    (about 3 s on a small CPU) inside its measured prefill."""
    from transformers import DynamicCache

    ids = torch.tensor([[loaded.tokenizer.eos_token_id or 0] * 4], device=loaded.device)
    loaded.model(input_ids=ids, cache=DynamicCache(config=loaded.model.config), use_cache=True,
                 logits_to_keep=1)


def torch_vocabulary(loaded: LoadedModel) -> Vocabulary:
    return Vocabulary(loaded.tokenizer, frozenset(eos_token_ids(loaded)), template_stops(loaded))


class TorchRunner:
    """The core's SoloRunner on a Hugging Face model (engine/core/solo.py)."""

    def __init__(self, loaded: LoadedModel, prefill_chunk: int | None = None) -> None:
        self.loaded = loaded
        self.prefill_chunk = prefill_chunk or default_prefill_chunk(loaded.device)
        self.can_roll_back = model_rollback_blocker(loaded.model.config) is None

    def prefill(self, reply: Reply, ids: list[int]) -> torch.Tensor | None:
        prefill = ChunkedPrefill(self.loaded, reply.lease, ids, reply.request.request_id,
                                 reply.emit)
        return prefill.run(self.prefill_chunk, reply.job.cancel)

    def forward(self, lease: CacheLease, ids: list[int], rows: int) -> torch.Tensor:
        if not 1 <= rows <= len(ids):  # as llama.cpp's runner: rows are positions fed now
            raise ValueError(f"need 1 <= rows <= {len(ids)}")
        input_ids = torch.tensor([ids], device=self.loaded.device)
        out = self.loaded.model(input_ids=input_ids, cache=lease.cache, use_cache=True,
                                logits_to_keep=rows)
        lease.ids.extend(ids)
        logits: torch.Tensor = out.logits[0, -rows:]
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        return logits

    def trim(self, lease: CacheLease, length: int) -> None:
        if len(lease.ids) > length:
            crop_to(lease.cache, length)
            del lease.ids[length:]


class DecodeSession(SoloSession):
    """A request alone on torch: the core's loop over a TorchRunner."""

    def __init__(self, loaded: LoadedModel, prefix_cache: PrefixCache,
                 draft: TokenProposer | None = None, prefill_chunk: int | None = None) -> None:
        super().__init__(loaded, TorchRunner(loaded, prefill_chunk), prefix_cache,
                         torch_vocabulary(loaded), draft)


# ----- pieces shared with the batcher (batching.py) --------------------------------------------
class ChunkedPrefill:
    """Feeds a prompt's uncached tokens through the model a chunk at a time on top of a lease's
    cache, and reports PrefillProgress after each chunk (on a CPU, within it too).

    Chunks keep Stop and progress within one chunk's time and let the batcher run decode steps
    between them; attention over the cache makes the result the one-pass prefill's (within fp
    rounding)."""

    def __init__(self, loaded: LoadedModel, lease: CacheLease, ids: list[int], request_id: str,
                 emit: EmitEvent) -> None:
        self.loaded = loaded
        self.lease = lease
        self.ids = ids
        self.request_id = request_id
        self.done = 0
        self._reporter = PrefillReporter(request_id, len(ids), emit)
        # Progress from inside a chunk as its layers run: on a CPU, where a hook runs after
        # its layer's ops (engine.runtimes.torch.layer_progress); a GPU chunk is short anyway.
        self._layers = decoder_layers(loaded.model) if loaded.device.type == "cpu" else []

    @property
    def finished(self) -> bool:
        return self.done >= len(self.ids)

    def step(self, max_tokens: int) -> torch.Tensor | None:
        """Run the next chunk of at most max_tokens; return the last prompt position's logits,
        shape (1, vocab), once the whole prompt is in the cache, else None."""
        chunk = self.ids[self.done : self.done + self.lease.chunk_limit(max(1, max_tokens))]
        input_ids = torch.tensor([chunk], device=self.loaded.device)
        with self._progress_within(self.done, len(chunk)):
            out = self.loaded.model(input_ids=input_ids, cache=self.lease.cache,
                                    use_cache=True, logits_to_keep=1)
        self.lease.ids.extend(chunk)
        checkpoint_if_due(self.lease)  # a recurrent cache: a checkpoint one token before the end
        self.done += len(chunk)
        logits = out.logits[0, -1:]
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        self._reporter.chunk_done(self.done)
        return logits if self.finished else None

    def _progress_within(self, begin: int, size: int) -> AbstractContextManager[object]:
        if not self._layers:
            return nullcontext()
        return LayerProgress(self._layers,
                             lambda fraction: self._reporter.within(begin, size, fraction))

    def run(self, chunk: int, cancel: threading.Event) -> torch.Tensor | None:
        """The whole prefill in chunks; None if cancel was set before a chunk (what was
        computed stays in the lease, so a retry of the same prompt reuses it)."""
        while not cancel.is_set():
            logits = self.step(chunk)
            if logits is not None:
                return logits
        return None
