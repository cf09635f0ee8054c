"""Time left in a prefill: a token costs more the further into the prompt it sits."""

from __future__ import annotations

import pytest

from engine.prefill_eta import PrefillClock

BASE_S, SLOPE_S = 5e-3, 2.5e-6  # per token at position 0, and per position (llama.cpp-like)


def chunk_s(start: int, tokens: int, slope: float = SLOPE_S) -> float:
    """A chunk's time on a machine whose per-token cost grows linearly along the prompt."""
    return tokens * (BASE_S + slope * (start + tokens / 2))


def run(clock: PrefillClock, chunks: list[int], slope: float = SLOPE_S,
        first_scale: float = 1.0) -> tuple[float, float]:
    done, t_ns, out = 0, clock.start_ns, (0.0, 0.0)
    for tokens in chunks:
        t_ns += round(chunk_s(done, tokens, slope) * (1.0 if done else first_scale) * 1e9)
        done += tokens
        out = clock.tick(done, t_ns)
    return out


def test_time_left_follows_the_growing_cost_of_later_tokens() -> None:
    total, done = 6000, 4 * 450
    rate, left_s = run(PrefillClock(total, 0), [450] * 4)
    truth = sum(chunk_s(start, 1) for start in range(done, total))
    assert left_s == pytest.approx(truth, rel=1e-3)
    assert rate == pytest.approx(done / sum(chunk_s(s, 450) for s in range(0, done, 450)))
    assert left_s > 1.5 * (total - done) / rate  # what "left / rate so far" would promise


@pytest.mark.parametrize("first_scale", [0.3, 3.0])
def test_the_first_chunk_setup_or_size_does_not_bend_the_line(first_scale: float) -> None:
    total, done = 6000, 4 * 450
    _rate, left_s = run(PrefillClock(total, 0), [450] * 4, first_scale=first_scale)
    assert left_s == pytest.approx(sum(chunk_s(start, 1) for start in range(done, total)),
                                   rel=1e-3)


def test_before_three_chunks_or_without_a_slope_it_is_the_rate_so_far() -> None:
    rate, left_s = run(PrefillClock(1000, 0), [100, 100])
    assert left_s == pytest.approx(800 / rate)
    rate, left_s = run(PrefillClock(1000, 0), [100] * 5, slope=0.0)
    assert left_s == pytest.approx(500 / rate)


def test_cheaper_later_tokens_never_promise_less_than_the_rate_so_far() -> None:
    rate, left_s = run(PrefillClock(1000, 0), [100] * 4, slope=-1e-6)
    assert left_s == pytest.approx(600 / rate)


def test_nothing_left_is_zero() -> None:
    _rate, left_s = run(PrefillClock(400, 0), [100] * 4)
    assert left_s == 0.0
