"""The decode batch, written once: its loop (BatchCore), how it reports, where alternatives
keep their cache. Runs only on the engine thread."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.core import host_logits
from engine.core.ledger import ALT_CACHE_SUFFIX, CacheLease, KvLedger
from engine.core.reply import Reply, ReplyJob
from engine.core.schedule import MAX_BATCH
from engine.core.speculative import drafter_for
from engine.events import EngineEvent, FinishReason, GenerationResult
from engine.metrics import now_ns
from engine.params import GenerationRequest

Emit = Callable[[ReplyJob, EngineEvent], None]
Done = Callable[[ReplyJob, GenerationResult | None, BaseException | None], None]


def batchable(request: GenerationRequest, drafts_in_batch: bool) -> bool:
    """Whether a request may decode in the batch: plain ones always; prompt-lookup ones where
    the runtime verifies drafts inside the batch's step (drafts_in_batch). A draft model
    proposes for one sequence at a time: its requests run alone."""
    if request.speculative is None:
        return True
    return drafts_in_batch and request.speculative == "ngram"


def alternative_cache_key(conversation_id: str | None, index: int) -> str:
    """Where alternative `index` (>= 1) of a conversation's reply keeps its cached prefix;
    alternative 0 uses the conversation's own entry."""
    return f"{conversation_id}{ALT_CACHE_SUFFIX}{index}"


class BatchCore(ABC):
    """The decode batch, written once for every runtime: admit a request (or N alternatives
    of one prompt), step all rows (one token each), settle what failed or finished. A runtime
    supplies how a prompt is read (_prefill), how an alternative forks its source's cache
    (_sibling), how rows' KV joins and leaves the batch, and the forward over the rows.

    A runtime whose rows can feed several tokens in one step (drafts_in_batch) verifies
    prompt-lookup drafts there: a speculative row feeds its last token and its draft, takes
    the longest agreed prefix plus one token, and the rejected rest is cut from its KV."""

    drafts_in_batch = False  # whether _forward_rows feeds a row's draft and _cut exists

    def __init__(self, prefix_cache: KvLedger[Any], emit: Emit, done: Done) -> None:
        self.prefix_cache = prefix_cache
        self._emit = emit
        self._done = done
        self.rows: list[Reply] = []
        self.steps = 0
        self.side_prefills = 0
        self._decode_step_s = 0.0  # moving average of a plain decode step's time

    @property
    def room(self) -> int:
        return MAX_BATCH - len(self.rows)

    # ----- what a runtime supplies ---------------------------------------------------------------
    @abstractmethod
    def _open(self, job: ReplyJob) -> Reply:
        """The job's reply (core.reply.open_reply with this runtime's model and vocabulary)."""

    @abstractmethod
    def _read_prompt(self, reply: Reply, ids: list[int]) -> torch.Tensor | None:
        """Feed ids (the prompt's uncached part) onto reply.lease, on this runtime's schedule
        (alone, between or inside the rows' steps, or beside them); the last position's
        logits, shape (vocab,), or None if Stop came first."""

    @abstractmethod
    def _sibling(self, job: ReplyJob, source: Reply, index: int) -> Reply:
        """Alternative `index` of source's prompt, on a fork of source's prefilled cache."""

    @abstractmethod
    def _join(self, joining: list[Reply], ended: list[Reply], source: Reply) -> None:
        """After the first token: `joining` rows enter the batch, `ended` ones are finished
        (_finish); `source` prefilled the prompt they share."""

    @abstractmethod
    def _forward_rows(self) -> torch.Tensor:
        """One forward over every row: its last token at its own position, then its draft
        (row.draft, empty but where drafts_in_batch); logits for each fed position, rows in
        order, shape (sum of 1 + len(row.draft), vocab)."""

    def _cut(self, row: Reply, rejected: int) -> None:
        """Drop the row's last `rejected` fed positions (a draft's rejected tail)."""
        raise NotImplementedError("this runtime's batch feeds no drafts")

    @abstractmethod
    def _leave(self, leaving: list[Reply], reason: FinishReason | None) -> None:
        """Rows leave the batch; each is finished (_finish) with `reason` if it has none."""

    @abstractmethod
    def _drop(self, row: Reply) -> None:
        """A failed row leaves the batch; its KV is not kept."""

    @abstractmethod
    def _clear_batch(self) -> None:
        """Every row is gone (a failed forward): forget the batch's KV."""

    # ----- the loop ------------------------------------------------------------------------------
    def _prefill(self, job: ReplyJob) -> tuple[Reply, torch.Tensor]:
        """Open the reply and read its prompt: the reply and the last position's logits
        (empty if Stop came first). On an error the reply's lease is discarded."""
        reply = self._open(job)
        lease = reply.lease
        try:
            logits = self._read_prompt(reply, reply.prompt_ids[lease.cached_tokens :])
        except BaseException:
            self.prefix_cache.discard(lease)
            raise
        if logits is None:
            return reply, torch.empty(0)
        job.timeline.first_logits_ns = now_ns()
        return reply, logits

    @torch.inference_mode()
    def admit(self, jobs: Sequence[ReplyJob]) -> None:
        """Prefill one request (or one prompt shared by N alternatives) and join the batch.
        A request that ends at its first token (or fails) never joins; one failing alternative
        leaves the others."""
        try:
            first, logits = self._prefill(jobs[0])
        except Exception as exc:
            for job in jobs:
                self._done(job, None, exc)
            return
        replies = [first]
        for i, job in enumerate(jobs[1:], 1):
            try:
                replies.append(self._sibling(job, first, i))
            except Exception as exc:
                self._done(job, None, exc)
        taken = []
        for reply in replies:
            try:
                self._speculate(reply)
                reply.take_drafted(logits[None])
            except Exception as exc:
                self._fail(reply, exc)
                continue
            taken.append(reply)
        self._join([r for r in taken if r.finish is None],
                   [r for r in taken if r.finish is not None], first)

    def _speculate(self, reply: Reply) -> None:
        """A joining prompt-lookup request drafts here where the batch verifies drafts."""
        if self.drafts_in_batch:
            reply.use_drafter(drafter_for(reply.request, reply.prompt_ids, True, None, (),
                                          reply.generator))

    @torch.inference_mode()
    def step(self) -> None:
        """Rows cancelled since the last step leave; speculative rows propose their drafts;
        then one forward over all rows, each taking one token or a verified draft's run. A
        forward error fails every row (their leases are discarded)."""
        self._leave([r for r in self.rows if r.job.cancel.is_set()], "cancelled")
        if not self.rows:
            return
        drafted = sum(len(row.propose()) for row in self.rows if row.drafter is not None)
        start = now_ns()
        try:
            logits = self._forward_rows()
        except Exception as exc:
            self._fail_all(exc)
            return
        self.steps += 1
        failed = self._take_tokens(logits)
        step_s = (now_ns() - start) * 1e-9
        if not drafted:  # the plain step's time sizes the prompt chunks that ride in it
            self._decode_step_s = step_s if not self._decode_step_s else \
                0.7 * self._decode_step_s + 0.3 * step_s
        self._settle(failed)

    def _take_tokens(self, logits: torch.Tensor) -> list[tuple[Reply, BaseException]]:
        """Each row's tokens from its logits rows (one, or its draft's verification); the rows
        that failed."""
        failed: list[tuple[Reply, BaseException]] = []
        at = 0
        for row in self.rows:
            fed = 1 + len(row.draft)
            try:
                _, rejected = row.take_drafted(host_logits.rows_of(logits, at, fed))
                if rejected:
                    self._cut(row, rejected)
            except Exception as exc:
                failed.append((row, exc))
            at += fed
        return failed

    def _settle(self, failed: list[tuple[Reply, BaseException]]) -> None:
        """Failed rows leave without their KV; finished ones leave with it."""
        for row, error in failed:
            self._drop(row)
            self._fail(row, error)
        self._leave([r for r in self.rows if r.finish is not None], None)

    def _fail(self, row: Reply, error: BaseException) -> None:
        self.prefix_cache.discard(row.lease)  # its KV is in an unknown state
        self._done(row.job, None, error)

    def _fail_all(self, error: BaseException) -> None:
        rows, self.rows = self.rows, []
        self._clear_batch()
        for row in rows:
            self._fail(row, error)

    def _report(self, row: Reply) -> None:
        """The row's KV is back in the prefix cache: its result goes out."""
        self._done(row.job, row.result(), None)


class OwnKvBatch(BatchCore):
    """A batch whose rows each keep their KV in their own lease (llama.cpp's sequences in one
    KV memory): joining, leaving and failing only change the list of rows, and a finished
    row's lease goes back to the prefix cache cut to what it fed."""

    def _join(self, joining: list[Reply], ended: list[Reply], source: Reply) -> None:
        self.rows.extend(joining)
        for reply in ended:
            self._finish(reply)

    def _leave(self, leaving: list[Reply], reason: FinishReason | None) -> None:
        for row in leaving:
            self.rows.remove(row)
            row.finish = row.finish or reason
            self._finish(row)

    def _drop(self, row: Reply) -> None:
        self.rows.remove(row)

    def _clear_batch(self) -> None:
        """Nothing to forget: each row's KV is its own, discarded with its lease."""

    def _cut(self, row: Reply, rejected: int) -> None:
        self._keep(row.lease, len(row.lease.ids) - rejected)

    def _finish(self, row: Reply) -> None:
        """Hand the row's KV (prompt + fed tokens) to the prefix cache, report."""
        lease = row.lease
        self._keep(lease, min(row.kv_len, len(lease.ids)))
        self.prefix_cache.release(lease)
        self._report(row)

    def _keep(self, lease: CacheLease, length: int) -> None:
        """Cut the lease's KV and ids to their first `length` positions."""
        if len(lease.ids) > length:
            self.prefix_cache.store.cut(lease.cache, None, length)
            del lease.ids[length:]
