"""The llama.cpp runtime's runner for a request alone: the core's loop (engine/core/solo.py),
llama.cpp's kernels.

The prompt goes in llama_decode batches on the lease's sequence, with progress and Stop from
inside each (decode.feed); a step is one llama_decode with logits for every position asked for
(a whole draft is verified in one); a rejected draft leaves the sequence with seq_rm. The
logits are views of llama.cpp's buffer, valid until the next decode. Runs only in the engine
thread.
"""

from __future__ import annotations

import torch

from engine.core.ledger import CacheLease
from engine.core.prefill_progress import PrefillReporter
from engine.core.prompt import template_stops
from engine.core.reply import Reply, Vocabulary
from engine.core.solo import SoloSession
from engine.core.speculative import TokenProposer
from engine.runtimes.llamacpp.decode import feed
from engine.runtimes.llamacpp.model import LlamaCppModel
from engine.runtimes.llamacpp.prefix_pool import SeqPrefixCache


def eos_ids(loaded: LlamaCppModel) -> set[int]:
    """Every end-of-generation token of the vocabulary, computed once per model."""
    ids = loaded.eog_ids
    if ids is None:
        ids = loaded.eog_ids = loaded.tokenizer.end_of_generation_ids()
    return ids


def llama_vocabulary(loaded: LlamaCppModel) -> Vocabulary:
    return Vocabulary(loaded.tokenizer, frozenset(eos_ids(loaded)), template_stops(loaded),
                      loaded.tokenizer.token_to_piece)


class LlamaRunner:
    """The core's SoloRunner on a llama.cpp context (engine/core/solo.py)."""

    def __init__(self, loaded: LlamaCppModel, pool: SeqPrefixCache) -> None:
        self.loaded = loaded
        self.pool = pool
        self.can_roll_back = loaded.can_roll_back

    def prefill(self, reply: Reply, ids: list[int]) -> torch.Tensor | None:
        cancel = reply.job.cancel
        if cancel.is_set():
            return None
        report = PrefillReporter(reply.request.request_id, len(ids), reply.emit)
        if not feed(self.loaded, self.pool, reply.lease, ids, 1, cancel, report):
            return None
        return self.loaded.logits(1)

    def forward(self, lease: CacheLease, ids: list[int], rows: int) -> torch.Tensor:
        feed(self.loaded, self.pool, lease, ids, rows)
        return self.loaded.logits(rows)

    def trim(self, lease: CacheLease, length: int) -> None:
        if len(lease.ids) > length:
            self.pool.store.cut(lease.cache, None, length)
            del lease.ids[length:]


class LlamaSession(SoloSession):
    """A request alone on llama.cpp: the core's loop over a LlamaRunner."""

    def __init__(self, loaded: LlamaCppModel, prefix_cache: SeqPrefixCache,
                 draft: TokenProposer | None = None) -> None:
        super().__init__(loaded, LlamaRunner(loaded, prefix_cache), prefix_cache,
                         llama_vocabulary(loaded), draft)
