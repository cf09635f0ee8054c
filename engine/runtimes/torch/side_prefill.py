"""A long prompt prefilled beside the streaming rows, in a thread of its own (torch on a CPU).

Between two decode steps a prefill chunk stalls every streaming row for its whole forward, and
on a CPU a small chunk still pays a fixed cost (see STEP_TOKEN_BUDGET in
engine/runtimes/torch/batching.py), so the rows' ITL stays several times its value alone while the
prompt crawls. Here the prompt goes in whole chunks in a second thread on half the cores while the
engine thread keeps decoding the rows on the rest: prefill and decode disaggregated across one
machine's cores, as the llama.cpp engine does on a side context
(engine/runtimes/llamacpp/side_prefill.py). torch's intra-op thread count belongs to the thread that
sets it, and torch releases the GIL inside each op, so the two forwards run at once. The prompt's
cache is the lease's own: when it is in, the request joins the batch through the usual path.
Progress events are queued here and emitted by the engine thread. The engine thread owns the object;
only `work` runs on the side thread.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from engine.core.ledger import CacheLease
from engine.core.schedule import FIRST_SIDE_CHUNK, SIDE_MIN_TOKENS, next_side_chunk
from engine.core.side_thread import SideWorker
from engine.events import PrefillProgress
from engine.runtimes.torch.generate import ChunkedPrefill
from engine.runtimes.torch.kernels import allowed_cpus
from engine.runtimes.torch.loader import LoadedModel


def side_threads() -> int:
    """Intra-op threads the side prefill gets (the rows keep the rest); 0 with one core."""
    return allowed_cpus() // 2


def can_prefill_beside(loaded: LoadedModel, new_tokens: int) -> bool:
    """Whether a prompt of new_tokens should go beside the rows: on a CPU with two cores or more
    (a GPU runs one forward at a time), and long enough to stall them for several steps."""
    return loaded.device.type == "cpu" and new_tokens >= SIDE_MIN_TOKENS and side_threads() >= 1


class SidePrefill(SideWorker):
    """Prefill `ids` on top of `lease`'s cache in a thread (see engine.core.side_thread), in chunks
    of at most `chunk` sized to take about schedule.SIDE_CHUNK_S each. The engine thread emits
    `progress()` as it polls, then calls `finish`."""

    def __init__(self, loaded: LoadedModel, lease: CacheLease, ids: list[int], request_id: str,
                 chunk: int, cancel: threading.Event) -> None:
        super().__init__(side_threads(), cancel)
        self.chunk = chunk
        self._events: queue.SimpleQueue[PrefillProgress] = queue.SimpleQueue()
        self._prefill = ChunkedPrefill(loaded, lease, ids, request_id, self._queue)
        self._logits: torch.Tensor | None = None

    def progress(self) -> list[PrefillProgress]:
        """The chunks finished since the last call, as progress events (oldest first)."""
        events = []
        while not self._events.empty():
            events.append(self._events.get())
        return events

    # ----- the side thread -------------------------------------------------------------------
    def _queue(self, event: object) -> None:
        assert isinstance(event, PrefillProgress)  # the only event ChunkedPrefill emits
        self._events.put(event)

    def set_threads(self, threads: int) -> None:
        torch.set_num_threads(threads)  # this thread's own; the engine thread keeps its own

    def work(self) -> None:
        size = min(FIRST_SIDE_CHUNK, self.chunk)
        self.set_threads(self.threads)
        with torch.inference_mode():
            while not self.stopped:
                self.before_chunk()
                began, before = time.perf_counter(), self._prefill.done
                logits = self._prefill.step(size)
                if logits is not None:
                    self._logits = logits
                    return
                size = self._next_chunk(self._prefill.done - before,
                                        time.perf_counter() - began)

    def _next_chunk(self, tokens: int, seconds: float) -> int:
        """The next chunk after one of `tokens` took `seconds` (the last one's rate)."""
        return next_side_chunk(tokens, seconds, self.chunk)

    # ----- back on the engine thread ---------------------------------------------------------
    def finish(self) -> torch.Tensor | None:
        """After the thread ended: the last prompt position's logits, shape (1, vocab), with
        the prompt in the lease's cache; None if Stop came first; the side thread's error."""
        self.check()
        return self._logits
