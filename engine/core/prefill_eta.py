"""Time left in a prefill, from the chunks so far.

A prompt token attends over every token before it, so it costs more the further into the
context it sits: on the Xeon VM a llama.cpp token cost ~5.5 ms at the start of a prompt and
~15 ms 4,000 tokens in. "Tokens left / rate so far" then promises about half the time that is
really left of a long paste. Here each chunk's cost per token is fitted as a straight line in
its position in the prompt (weighted least squares over the chunks so far; a cached prefix before
the first one only shifts the line), and the time left is that line summed over the tokens
still to come, never less than at the rate so far. Without an upward slope it is the rate so
far.

No figure (None) until ETA_FROM of the prompt is read and the fitted cost per token of the
tokens still to come is known to within MAX_ERROR (one standard error, from the chunks' scatter
about the line): before that the line is extrapolated from a sliver of the prompt. A 5,000-word
paste read 14 s at 9% with ~27 s to go (the rate so far, before the fit), then jumped to 32 s
when a fit over three chunks took over. On a llama.cpp-like sequence with +-10% chunk noise
(tests/core/test_prefill_eta.py) the first figure comes at ~25% and every one is within 0.96-1.13x
of the real time left.
"""

from __future__ import annotations

import math

MIN_CHUNKS = 3  # chunks after the first before a slope is trusted
ETA_FROM = 0.10  # share of the prompt read before a time left is said
MAX_ERROR = 0.05  # the fitted cost per token still to come, known to within this share


class PrefillClock:
    """Feed it (tokens done, time) after each chunk; it says the rate so far and the time
    left."""

    def __init__(self, total: int, start_ns: int) -> None:
        self.total = total
        self.start_ns = start_ns
        self._done = 0
        self._last_ns = start_ns
        self._chunks: list[tuple[float, int, float]] = []  # (mid position, tokens, seconds)
        self._said = False  # a figure was given: later ones follow (no figure, figure, none)

    def tick(self, done: int, t_ns: int) -> tuple[float, float | None]:
        """After the chunk that brought the prompt to `done` tokens at t_ns: (tok/s so far,
        seconds left, or None while too little is read to say)."""
        tokens, seconds = done - self._done, (t_ns - self._last_ns) * 1e-9
        # The first chunk is left out of the fit: it also carries the prefill's setup and,
        # on llama.cpp, a larger size than the clock's later ones (cheaper per token).
        if tokens > 0 and seconds > 0 and self._done > 0:
            self._chunks.append((self._done + tokens / 2, tokens, seconds))
        self._done, self._last_ns = done, t_ns
        elapsed = (t_ns - self.start_ns) * 1e-9
        rate = done / elapsed if elapsed > 0 else 0.0
        return rate, self._seconds_left(rate)

    def _seconds_left(self, rate: float) -> float | None:
        left = self.total - self._done
        if left <= 0:
            return 0.0
        if rate <= 0 or self._done < ETA_FROM * self.total:
            return None
        here = self._done
        line = self._cost_line(at=here + left / 2)  # the mean position still to come
        if line is None:
            return None
        base, slope, error = line
        # Once a figure was given, later ones follow even if the fit wobbles out of
        # MAX_ERROR again: a figure that comes and goes reads as a fault.
        if error > MAX_ERROR and not self._said:
            return None
        self._said = True
        flat = left / rate
        if slope <= 0:  # later tokens cost no more: the rate so far
            return flat
        # The line's per-token cost summed over positions here .. here + left; never below
        # the rate so far (a noisy fit may dip under it).
        return max(flat, base * left + slope * (here * left + left * left / 2))

    def _cost_line(self, at: float) -> tuple[float, float, float] | None:
        """(seconds per token at context 0, extra seconds per token of context, the standard
        error of the line's cost per token at position `at` as a share of it), or None before
        MIN_CHUNKS chunks. The error comes from the chunks' scatter about the line and how far
        `at` lies beyond them: three chunks 100 positions apart, 10% apart in cost, foretell
        little about a position 5,000 tokens on."""
        chunks = self._chunks
        if len(chunks) < MIN_CHUNKS:
            return None
        weight = sum(tokens for _, tokens, _ in chunks)
        mean_x = sum(mid * tokens for mid, tokens, _ in chunks) / weight
        mean_y = sum(s for _, _, s in chunks) / weight  # seconds per token
        spread = sum(tokens * (mid - mean_x) ** 2 for mid, tokens, _ in chunks)
        if spread <= 0:
            return None
        slope = sum((mid - mean_x) * (s - tokens * mean_y) for mid, tokens, s in chunks) / spread
        base = mean_y - slope * mean_x
        scatter = sum(tokens * (s / tokens - base - slope * mid) ** 2
                      for mid, tokens, s in chunks) / (len(chunks) - 2)
        cost = base + slope * at
        error = math.sqrt(scatter * (1 / weight + (at - mean_x) ** 2 / spread))
        return base, slope, error / cost if cost > 0 else math.inf
