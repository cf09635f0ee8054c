"""A third runtime, written only against the core's protocols (issue 27): if the core holds
everything the runtimes share, a new runtime is a KvStore, a SoloRunner and a BatchCore's few
hooks, and the runner contract holds for it unchanged.

Its "model" is a tiny recurrent net with random weights: the state after each position is
kept per position (its KV), so a cut keeps the first states, a lent prefix is a copy of them,
and a snapshot is their bytes. Cached and cold computation are bit-for-bit the same."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from engine.core.batch import Done, Emit, OwnKvBatch, alternative_cache_key
from engine.core.ledger import CacheLease, KvCheckpoint, KvLedger
from engine.core.prefill_progress import PrefillReporter
from engine.core.reply import Reply, ReplyJob, Vocabulary, open_reply, sibling_reply
from engine.core.snapshots import Payload
from engine.events import ModelInfo

DIM = 16


@dataclass
class FakeKv:
    """One sequence's KV: the net's state after each position."""

    states: list[torch.Tensor] = field(default_factory=list)


class FakeNet:
    def __init__(self, vocab: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(vocab, DIM, generator=gen)
        self.recur = torch.randn(DIM, DIM, generator=gen) * 0.4
        self.out = torch.randn(DIM, vocab, generator=gen) * 4

    def feed(self, kv: FakeKv, ids: list[int]) -> torch.Tensor:
        """Feed ids onto kv; the logits of every fed position, (len(ids), vocab)."""
        rows = []
        for token in ids:
            last = kv.states[-1] if kv.states else torch.zeros(DIM)
            kv.states.append(torch.tanh(self.embed[token] + last @ self.recur))
            rows.append(kv.states[-1] @ self.out)
        return torch.stack(rows)


class FakeKvStore:
    """The KvStore protocol over FakeKv handles."""

    takes_checkpoints = False
    can_lend = True

    def fresh(self) -> FakeKv:
        return FakeKv()

    def lend(self, donor: FakeKv, checkpoint: KvCheckpoint | None, length: int) -> FakeKv:
        return FakeKv(list(donor.states[:length]))

    def cut(self, handle: FakeKv, checkpoint: KvCheckpoint | None, length: int) -> None:
        del handle.states[length:]

    def blocker(self, handle: FakeKv) -> str | None:
        return None

    def length(self, handle: FakeKv) -> int:
        return len(handle.states)

    def nbytes(self, handle: FakeKv, tokens: int, checkpoint: KvCheckpoint | None) -> int:
        return tokens * DIM * 4

    def free(self, handle: FakeKv) -> None:
        """Garbage-collected."""

    def export(self, handle: FakeKv, checkpoint: KvCheckpoint | None) -> Payload | None:
        states = list(handle.states)
        return lambda: torch.stack(states).numpy().tobytes() if states else b""

    def restore(self, data: bytes) -> tuple[FakeKv, KvCheckpoint | None]:
        if len(data) % (DIM * 4):
            raise ValueError("not this runtime's snapshot")
        flat = torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(-1, DIM)
        return FakeKv(list(flat.clone())), None


class FakeModel:
    """The ChatModel the core reads: its info and tokenizer (the tiny model's)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.net = FakeNet(len(tokenizer))
        self.info = ModelInfo(name="fake", source="folder", path="", device="cpu",
                              dtype="float32", context_length=512, parameters=DIM * DIM,
                              weight_bytes_per_step=DIM * DIM * 4, kernel="python",
                              engine="fake")

    def vocabulary(self) -> Vocabulary:
        return Vocabulary(self.tokenizer, frozenset({self.tokenizer.eos_token_id}))


class FakeRunner:
    """The SoloRunner protocol: prefill in chunks with progress and Stop between them."""

    can_roll_back = True

    def __init__(self, model: FakeModel, chunk: int = 8) -> None:
        self.model, self.chunk = model, chunk

    def prefill(self, reply: Reply, ids: list[int]) -> torch.Tensor | None:
        report = PrefillReporter(reply.request.request_id, len(ids), reply.emit)
        return self.read(reply.lease, ids, self.chunk, report, reply.job.cancel.is_set)

    def read(self, lease: CacheLease, ids: list[int], chunk: int, report: PrefillReporter,
             stopped: Any) -> torch.Tensor | None:
        done, logits = 0, None
        while done < len(ids):
            if stopped():
                return None
            logits = self.forward(lease, ids[done : done + chunk], 1)
            done = min(done + chunk, len(ids))
            report.chunk_done(done)
        return logits

    def forward(self, lease: CacheLease, ids: list[int], rows: int) -> torch.Tensor:
        if not 1 <= rows <= len(ids):
            raise ValueError(f"need 1 <= rows <= {len(ids)}")
        logits = self.model.net.feed(lease.cache, ids)[-rows:]
        lease.ids.extend(ids)
        return logits

    def trim(self, lease: CacheLease, length: int) -> None:
        del lease.cache.states[length:]
        del lease.ids[length:]


class FakeBatcher(OwnKvBatch):
    """The BatchCore's hooks for rows that each step on their own KV (the core's OwnKvBatch
    does the rest: joining, leaving, finishing)."""

    def __init__(self, model: FakeModel, pool: KvLedger[Any], emit: Emit, done: Done,
                 lone_chunk: int | None = None) -> None:
        super().__init__(pool, emit, done)
        self.model = model
        self.runner = FakeRunner(model, lone_chunk or 1 << 30)

    def _open(self, job: ReplyJob) -> Reply:
        return open_reply(self.model, self.prefix_cache, job, self.model.vocabulary(),
                          partial(self._emit, job))

    def _read_prompt(self, reply: Reply, ids: list[int]) -> torch.Tensor | None:
        report = PrefillReporter(reply.request.request_id, len(ids), reply.emit)
        logits = self.runner.read(reply.lease, ids, self.runner.chunk, report,
                                  reply.job.cancel.is_set)
        return None if logits is None else logits[-1]

    def _sibling(self, job: ReplyJob, source: Reply, index: int) -> Reply:
        key = alternative_cache_key(source.lease.conversation_id, index)
        lease = self.prefix_cache.lease_for(key, list(source.lease.ids))
        lease.cache.states[:] = source.lease.cache.states
        return sibling_reply(job, source, lease, partial(self._emit, job))

    drafts_in_batch = True  # each row steps on its own KV: a draft is a few more positions

    def _forward_rows(self) -> torch.Tensor:
        return torch.cat([self.runner.forward(r.lease, [r.generated[-1], *r.draft],
                                              1 + len(r.draft)) for r in self.rows])
