"""The wait before the first token, forecast before a message is sent.

Two parts: how much of the prompt is cached (the ledger's `peek`, from any thread), and what
reading the rest costs on this model and machine. A prompt token attends over every token
before it, so a token at position x costs about a + b*x (engine/core/prefill_eta.py fits the same
line within one prefill). Reading positions c..p therefore costs

    a * (p - c) + b * (p^2 - c^2) / 2   (+ a fixed setup cost d per prefill),

and each finished reply is one observation of (c, p, prefill seconds). The three weights are
fitted by least squares over this session's replies (the newest MAX_OBSERVATIONS); no figure
until MIN_OBSERVATIONS replies with distinct sizes have been seen (only the token counts are
said). A fit that comes out non-physical (a negative weight) gives way to the plain rate:
seconds per token read over the same replies.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from engine.protocol import PrefixPeek

MIN_OBSERVATIONS = 3
MAX_OBSERVATIONS = 64
MIN_READ_TOKENS = 8  # a prefill that read fewer tokens says little about the cost per token


class PrefillCost:
    """Prefill seconds as a function of (cached, prompt) tokens, fitted from finished
    replies of the loaded model."""

    def __init__(self) -> None:
        self._seen: deque[tuple[int, int, float]] = deque(maxlen=MAX_OBSERVATIONS)
        self._weights: tuple[float, float, float] | None = None
        self._restore_s_per_token: float | None = None  # the last restore from disk's

    def clear(self) -> None:
        """Another model: its costs are another line."""
        self._seen.clear()
        self._weights = None
        self._restore_s_per_token = None

    def add(self, cached: int, prompt: int, seconds: float, restored: int = 0,
            restore_s: float = 0.0) -> None:
        """A finished prefill: `seconds` in all, of which `restore_s` read `restored` of the
        cached tokens back from disk."""
        if restored > 0 and restore_s > 0:
            self._restore_s_per_token = restore_s / restored
        seconds -= restore_s
        if prompt - cached < MIN_READ_TOKENS or seconds <= 0:
            return
        self._seen.append((cached, prompt, seconds))
        self._weights = self._fit()

    def seconds(self, cached: int, prompt: int, from_disk: bool = False) -> float | None:
        """The forecast prefill time, or None while the fit is not trusted (a restore from
        disk adds the last one's time per token, once one was seen)."""
        if self._weights is None:
            return None
        a, b, d = self._weights
        reading = d + a * (prompt - cached) + b * (prompt * prompt - cached * cached) / 2
        restoring = cached * (self._restore_s_per_token or 0.0) if from_disk else 0.0
        return reading + restoring

    def weights(self) -> tuple[float, float, float] | None:
        """The fitted (a, b, d), None while not trusted (engine/tools/speed.py prices other models
        from the bundled model's)."""
        return self._weights

    def _fit(self) -> tuple[float, float, float] | None:
        sizes = {p - c for c, p, _ in self._seen}
        if len(self._seen) < MIN_OBSERVATIONS or len(sizes) < 2:
            return None
        rows = [[p - c, (p * p - c * c) / 2, 1.0] for c, p, _ in self._seen]
        x = np.array(rows, dtype=np.float64)
        y = np.array([s for _, _, s in self._seen], dtype=np.float64)
        scale = np.maximum(np.abs(x).max(axis=0), 1.0)  # columns of very different sizes
        solution = np.linalg.lstsq(x / scale, y, rcond=None)[0] / scale
        a, b, d = (float(v) for v in solution)
        if a <= 0 or b < 0 or d < 0:
            # Noise the line cannot explain (tiny prefills, a busy machine): the session's
            # plain rate, seconds per token read, is the honest figure then.
            read = sum(p - c for c, p, _ in self._seen)
            return sum(s for _, _, s in self._seen) / read, 0.0, 0.0
        return a, b, d


def forecast_text(peek: PrefixPeek, seconds: float | None) -> str:
    """"~1,204 new tokens · ~9 s to first token · 5,980 from cache" (the time left out while
    it is not known)."""
    parts = [f"~{peek.new_tokens:,} new tokens"]
    if seconds is not None:
        parts.append(f"~{_short_seconds(seconds)} to first token")
    if peek.cached_tokens:
        where = "from disk" if peek.from_disk else "from cache"
        parts.append(f"{peek.cached_tokens:,} {where}")
    return " · ".join(parts)


def _short_seconds(seconds: float) -> str:
    if seconds < 1:
        return f"{max(seconds, 0.01) * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    return f"{seconds:.0f} s"
