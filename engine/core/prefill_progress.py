"""A prompt's PrefillProgress events: after each chunk, and within a long chunk as it goes.

Late in a long prompt a chunk takes longer (each token attends over everything before it): on
the Xeon VM a 64-token llama.cpp chunk took ~0.9 s at 4,000 tokens of context and a 256-token
torch chunk ~0.8 s, so progress only at chunk ends came less often than every 0.5 s. Smaller
chunks cost throughput (16-token llama.cpp chunks ran at half the rate of 64-token ones), so
the engines report from inside a chunk instead: how far the model's layers have gone through it
(torch: a hook per decoder layer, engine/runtimes/torch/layer_progress.py; llama.cpp: the graph's
nodes, engine/runtimes/llamacpp/graph_meter.py). A chunk's share done counts as that share of its
tokens, which is the share of its work when every layer costs the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.core.prefill_eta import PrefillClock
from engine.events import PrefillProgress

WITHIN_CHUNK_NS = 250_000_000  # within a chunk, progress at most this often


class PrefillReporter:
    """Emits one prompt's PrefillProgress: `chunk_done` after each chunk, `within` (throttled
    to WITHIN_CHUNK_NS) while one runs. Stamps come from the calling thread's monotonic clock."""

    def __init__(self, request_id: str, total: int,
                 emit: Callable[[PrefillProgress], None]) -> None:
        self.request_id = request_id
        self.total = total
        self._emit = emit
        self._clock = PrefillClock(total, time.perf_counter_ns())
        self._done = 0
        self._last_ns = self._clock.start_ns

    def chunk_done(self, done: int) -> None:
        """The chunk that brought the prompt to `done` tokens is in."""
        self._report(done, time.perf_counter_ns())

    def within(self, begin: int, size: int, fraction: float) -> None:
        """The chunk of `size` tokens from `begin` is `fraction` of the way through the model."""
        t = time.perf_counter_ns()
        # The chunk's end is chunk_done's to say: its tokens are in the cache only then.
        done = begin + min(int(size * max(fraction, 0.0)), size - 1)
        if t - self._last_ns >= WITHIN_CHUNK_NS and done > self._done:
            self._report(done, t)

    def _report(self, done: int, t: int) -> None:
        self._done, self._last_ns = done, t
        rate, left_s = self._clock.tick(done, t)
        self._emit(PrefillProgress(self.request_id, t, done, self.total, rate, left_s))
