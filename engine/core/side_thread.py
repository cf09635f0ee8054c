"""The thread both engines' side prefills run in, and the engine thread's loop around it.

A long prompt that joins streaming rows is prefilled beside them
(engine/runtimes/torch/side_prefill.py for torch, engine/runtimes/llamacpp/side_prefill.py for
llama.cpp): a worker thread with part of the cores runs its chunks while the engine thread keeps
stepping the rows on the rest. This module holds what the two share: starting and stopping the
thread, handing it every core once no row streams, and carrying its exception back to the engine
thread.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

from engine.core.schedule import SIDE_POLL_S


class SideWorker(ABC):
    """`work()` in a daemon thread on `threads` threads. The engine thread starts it, polls
    `running`, may give it more threads, calls `check()` once it ended and always `close()`."""

    def __init__(self, threads: int, cancel: threading.Event) -> None:
        self.threads = threads
        self.cancel = cancel
        self.error: BaseException | None = None
        self._wanted_threads = threads
        self._stop = threading.Event()  # close() before the end: the engine gave up
        self._thread: threading.Thread | None = None

    @abstractmethod
    def work(self) -> None:
        """The side thread's job: chunk by chunk, until done or `stopped`."""

    @abstractmethod
    def set_threads(self, threads: int) -> None:
        """Run the next chunks on `threads` threads (called on the side thread)."""

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
        """From the next chunk on, work on `threads` threads (nothing streams any more)."""
        self._wanted_threads = threads

    @property
    def stopped(self) -> bool:
        """Stop pressed, or the engine gave up: the side thread ends before its next chunk."""
        return self.cancel.is_set() or self._stop.is_set()

    def before_chunk(self) -> None:
        """On the side thread before each chunk: take up a new thread count."""
        if self._wanted_threads != self.threads:
            self.threads = self._wanted_threads
            self.set_threads(self.threads)

    def check(self) -> None:
        """On the engine thread after the worker ended: raise what it raised."""
        if self.running:
            raise RuntimeError("the side prefill is still running")
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Stop the thread after its current chunk and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        try:
            self.work()
        except BaseException as exc:  # handed to the engine thread by check()
            self.error = exc


def step_rows_beside(worker: SideWorker, streaming: Callable[[], bool], step: Callable[[], None],
                     all_threads: int, on_progress: Callable[[], None]) -> None:
    """On the engine thread: start the worker and step the rows while it runs, every thread
    to it once none streams; on_progress after each step or poll, and once at the end."""
    worker.start()
    while worker.running:
        if streaming():
            step()
        else:
            worker.use_threads(all_threads)
            worker.wait(SIDE_POLL_S)
        on_progress()
    on_progress()
