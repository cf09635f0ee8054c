"""The decode loop for a request that runs alone: speculative requests, and models whose cache
cannot share a batch. Written once for every runtime, over a SoloRunner.

Prefill what the prefix cache lacks, then one timed step per token; with a drafter, each step
verifies a whole draft in one forward and keeps the longest prefix it agrees with (the rest is
trimmed from the cache). Runs only on the engine thread.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from engine.core.ledger import CacheLease, KvLedger
from engine.core.prompt import ChatModel
from engine.core.reply import DetachedJob, EmitEvent, Reply, Vocabulary, open_reply
from engine.core.speculative import TokenProposer, drafter_for
from engine.errors import InvalidRequestError
from engine.events import GenerationResult
from engine.metrics import RequestTimeline, now_ns
from engine.params import GenerationRequest


class SoloRunner(Protocol):
    """What a runtime does for a request that runs alone."""

    @property
    def can_roll_back(self) -> bool:
        """Whether positions can be cut off the cache again (no recurrent state): drafts
        need it, as a rejected one is taken back out."""
        ...

    def prefill(self, reply: Reply, ids: list[int]) -> torch.Tensor | None:
        """Feed ids (the prompt's uncached part) onto reply.lease, reporting progress and
        honouring Stop within a chunk; the last position's logits, shape (1, vocab), or None
        if Stop came first (what was read stays in the lease)."""
        ...

    def forward(self, lease: CacheLease, ids: list[int], rows: int) -> torch.Tensor:
        """Feed ids on top of the lease's cache; the logits of the last `rows` positions,
        shape (rows, vocab), valid until the next forward."""
        ...

    def trim(self, lease: CacheLease, length: int) -> None:
        """Drop cached positions from `length` on, keeping lease.ids equal to the cache."""
        ...


def decode_alone(runner: SoloRunner, reply: Reply) -> None:
    """Prefill, then decode until the reply ends, verifying the reply's drafts if it has a
    drafter; the lease ends holding exactly the prompt and every token fed back."""
    lease, cancel, drafter = reply.lease, reply.job.cancel, reply.drafter
    rows = runner.prefill(reply, reply.prompt_ids[lease.cached_tokens :])
    if rows is not None and drafter is not None and not drafter.prepare(cancel):
        rows = None
    if rows is None:
        reply.finish = "cancelled"  # Stop before or during the prefill: within one chunk
    else:
        reply.job.timeline.first_logits_ns = now_ns()
        while True:
            token, rejected = reply.take_drafted(rows)
            if rejected:  # the cache holds the last step's input token plus the whole draft
                runner.trim(lease, len(lease.ids) - rejected)
            if reply.finish is not None or token is None:
                break
            draft = reply.propose()
            if cancel.is_set():  # Stop while the draft model proposed (or just now)
                reply.finish = "cancelled"
                break
            rows = runner.forward(lease, [token, *draft], 1 + len(draft))
    # Plain decoding never feeds the last emitted token; a draft may have gone further.
    runner.trim(lease, reply.kv_len)


class SoloSession:
    """Runs one request to completion on the engine thread, on any runtime's SoloRunner."""

    def __init__(self, model: ChatModel, runner: SoloRunner, cache: KvLedger[Any],
                 vocab: Vocabulary, draft: TokenProposer | None) -> None:
        self.model = model
        self.runner = runner
        self.cache = cache
        self.vocab = vocab
        self.draft = draft  # proposes tokens for speculative="draft" requests

    @torch.inference_mode()
    def run(self, request: GenerationRequest, timeline: RequestTimeline,
            cancel: threading.Event, emit: EmitEvent) -> GenerationResult:
        if request.speculative == "draft" and self.draft is None:
            raise InvalidRequestError("speculative decoding with a draft model needs one: "
                                      "load it first (--draft-model SPEC)")
        reply = open_reply(self.model, self.cache, DetachedJob(request, timeline, cancel),
                           self.vocab, emit)
        try:
            reply.use_drafter(drafter_for(request, reply.prompt_ids, self.runner.can_roll_back,
                                          self.draft, self.vocab.eos_ids, reply.generator))
            decode_alone(self.runner, reply)
            result = reply.result()
        except BaseException:
            self.cache.discard(reply.lease)  # its KV is in an unknown state
            raise
        self.cache.release(reply.lease)
        return result
