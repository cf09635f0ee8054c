"""Time left in a prefill, from the chunks so far.

A prompt token attends over every token before it, so it costs more the further into the
context it sits: on the Xeon VM a llama.cpp token cost ~5.5 ms at the start of a prompt and
~15 ms 4,000 tokens in. "Tokens left / rate so far" then promises about half the time that is
really left of a long paste. Here each chunk's cost per token is fitted as a straight line in
its position in the prompt (weighted least squares over the chunks so far; a cached prefix before
the first one only shifts the line), and the time left is that line summed over the tokens
still to come, never less than at the rate so far. With fewer than MIN_CHUNKS chunks after the
first, or no upward slope, it is the rate so far.
"""

from __future__ import annotations

MIN_CHUNKS = 3  # chunks after the first before a slope is trusted


class PrefillClock:
    """Feed it (tokens done, time) after each chunk; it says the rate so far and the time
    left."""

    def __init__(self, total: int, start_ns: int) -> None:
        self.total = total
        self.start_ns = start_ns
        self._done = 0
        self._last_ns = start_ns
        self._chunks: list[tuple[float, int, float]] = []  # (mid position, tokens, seconds)

    def tick(self, done: int, t_ns: int) -> tuple[float, float]:
        """After the chunk that brought the prompt to `done` tokens at t_ns: (tok/s so far,
        seconds left)."""
        tokens, seconds = done - self._done, (t_ns - self._last_ns) * 1e-9
        # The first chunk is left out of the fit: it also carries the prefill's setup and,
        # on llama.cpp, a larger size than the clock's later ones (cheaper per token).
        if tokens > 0 and seconds > 0 and self._done > 0:
            self._chunks.append((self._done + tokens / 2, tokens, seconds))
        self._done, self._last_ns = done, t_ns
        elapsed = (t_ns - self.start_ns) * 1e-9
        rate = done / elapsed if elapsed > 0 else 0.0
        return rate, self._seconds_left(rate)

    def _seconds_left(self, rate: float) -> float:
        left = self.total - self._done
        if left <= 0 or rate <= 0:
            return 0.0
        flat = left / rate
        line = self._cost_line()
        if line is None:
            return flat
        base, slope = line
        here = self._done
        # The line's per-token cost summed over positions here .. here + left; never below
        # the rate so far (a noisy fit may dip under it).
        return max(flat, base * left + slope * (here * left + left * left / 2))

    def _cost_line(self) -> tuple[float, float] | None:
        """(seconds per token at context 0, extra seconds per token of context), or None."""
        if len(self._chunks) < MIN_CHUNKS:
            return None
        weight = sum(tokens for _, tokens, _ in self._chunks)
        mean_x = sum(mid * tokens for mid, tokens, _ in self._chunks) / weight
        mean_y = sum(s for _, _, s in self._chunks) / weight  # seconds per token
        spread = sum(tokens * (mid - mean_x) ** 2 for mid, tokens, _ in self._chunks)
        if spread <= 0:
            return None
        slope = sum((mid - mean_x) * (s - tokens * mean_y)
                    for mid, tokens, s in self._chunks) / spread
        if slope <= 0:
            return None
        return mean_y - slope * mean_x, slope
