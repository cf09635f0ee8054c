"""A long prompt prefilled beside the streaming rows, in a thread of its own (torch on a CPU).

Between two decode steps a prefill chunk stalls every streaming row for its whole forward, and
on a CPU a small chunk still pays a fixed cost (see STEP_TOKEN_BUDGET in engine/batching.py), so
the rows' ITL stays several times its value alone while the prompt crawls. Here the prompt goes
in whole chunks in a second thread on half the cores while the engine thread keeps decoding the
rows on the rest: prefill and decode disaggregated across one machine's cores, as the llama.cpp
engine does on a side context (engine/llamacpp/side_prefill.py). torch's intra-op thread count
belongs to the thread that sets it, and torch releases the GIL inside each op, so the two
forwards run at once. The prompt's cache is the lease's own: when it is in, the request joins the
batch through the usual path. Progress events are queued here and emitted by the engine thread.
The engine thread owns the object; only `_run` is on the side thread.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from engine.events import PrefillProgress
from engine.generate import ChunkedPrefill
from engine.kernels import allowed_cpus
from engine.loader import LoadedModel
from engine.prefix_cache import CacheLease

SIDE_MIN_TOKENS = 256  # shorter prompts go in chunks between the rows' steps (a chunk or so)
# Side chunks follow the clock so that progress and Stop come about every SIDE_CHUNK_S. On the
# Xeon VM (one core each, bench --interference, 4,000 tokens) 256-token chunks took ~1.3 s at
# 197-242 tok/s; sized to 0.5 s the prompt ran at 174 tok/s, to 0.4 s (at least 32) at 141,
# against 156-165 for chunks between the steps: each chunk's ~600 ops also wait for the GIL.
SIDE_CHUNK_S = 0.5
FIRST_SIDE_CHUNK = 128
MIN_SIDE_CHUNK = 64


def side_threads() -> int:
    """Intra-op threads the side prefill gets (the rows keep the rest); 0 with one core."""
    return allowed_cpus() // 2


def can_prefill_beside(loaded: LoadedModel, new_tokens: int) -> bool:
    """Whether a prompt of new_tokens should go beside the rows: on a CPU with two cores or more
    (a GPU runs one forward at a time), and long enough to stall them for several steps."""
    return loaded.device.type == "cpu" and new_tokens >= SIDE_MIN_TOKENS and side_threads() >= 1


class SidePrefill:
    """Prefill `ids` on top of `lease`'s cache in a thread, in chunks of at most `chunk` sized
    to take about SIDE_CHUNK_S each. The engine thread polls `running`, emits `progress()`,
    then calls `finish` and always `close`."""

    def __init__(self, loaded: LoadedModel, lease: CacheLease, ids: list[int], request_id: str,
                 chunk: int, cancel: threading.Event) -> None:
        self.threads = side_threads()
        self.chunk = chunk
        self.cancel = cancel
        self.error: BaseException | None = None
        self._events: queue.SimpleQueue[PrefillProgress] = queue.SimpleQueue()
        self._prefill = ChunkedPrefill(loaded, lease, ids, request_id, self._queue)
        self._logits: torch.Tensor | None = None
        self._wanted_threads = self.threads
        self._stop = threading.Event()  # close() before the end: the engine gave up
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="phasewise-side-prefill",
                                        daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def use_threads(self, threads: int) -> None:
        """Nothing streams any more: the side prefill takes `threads` from its next chunk."""
        self._wanted_threads = threads

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

    def _run(self) -> None:
        try:
            threads, size = self.threads, min(FIRST_SIDE_CHUNK, self.chunk)
            torch.set_num_threads(threads)  # this thread's own; the engine thread keeps its own
            with torch.inference_mode():
                while not (self.cancel.is_set() or self._stop.is_set()):
                    if self._wanted_threads != threads:
                        threads = self._wanted_threads
                        torch.set_num_threads(threads)
                    began, before = time.perf_counter(), self._prefill.done
                    logits = self._prefill.step(size)
                    if logits is not None:
                        self._logits = logits
                        return
                    size = self._next_chunk(self._prefill.done - before,
                                            time.perf_counter() - began)
        except BaseException as exc:  # handed to the engine thread by finish()
            self.error = exc

    def _next_chunk(self, tokens: int, seconds: float) -> int:
        """The next chunk after one of `tokens` took `seconds` (the last one's rate)."""
        if seconds <= 0:
            return self.chunk
        return max(MIN_SIDE_CHUNK, min(self.chunk, round(tokens / seconds * SIDE_CHUNK_S)))

    # ----- back on the engine thread ---------------------------------------------------------
    def finish(self) -> torch.Tensor | None:
        """After the thread ended: the last prompt position's logits, shape (1, vocab), with
        the prompt in the lease's cache; None if Stop came first; the side thread's error."""
        if self.running:
            raise RuntimeError("finish() while the side prefill runs")
        if self.error is not None:
            raise self.error
        return self._logits

    def close(self) -> None:
        """Stop the thread after its current chunk and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
