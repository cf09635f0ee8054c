"""Time left in a prefill: a token costs more the further into the prompt it sits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.core.prefill_eta import PrefillClock

RECORDED = Path(__file__).resolve().parents[1] / "data" / "prefill_progress_llamacpp_6000.json"

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


def test_before_three_chunks_or_a_tenth_of_the_prompt_there_is_no_figure() -> None:
    _rate, left_s = run(PrefillClock(1000, 0), [100, 100])  # 20% read, one chunk fitted
    assert left_s is None
    _rate, left_s = run(PrefillClock(10_000, 0), [100] * 9)  # 8 chunks fitted, 9% read
    assert left_s is None
    rate, left_s = run(PrefillClock(10_000, 0), [100] * 10)  # 10%
    assert left_s is not None and left_s > 9_000 / rate


def test_without_a_slope_it_is_the_rate_so_far() -> None:
    rate, left_s = run(PrefillClock(1000, 0), [100] * 5, slope=0.0)
    assert left_s == pytest.approx(500 / rate)


def llama_cpp_like(total: int = 6000) -> list[tuple[int, int, float]]:
    """(tokens done, ns, true seconds left) of a llama.cpp-like prefill: a 512-token first
    chunk, then 64-token ones, each reported halfway through too (the graph meter), per-token
    cost 5.5 ms + 2.4 us per position (~15 ms at 4,000: the Xeon VM), each chunk +-10%."""
    ends, done, i = [], 0, 0
    while done < total:
        size = min(512 if done == 0 else 64, total - done)
        wobble = 1 + ((i * 37) % 11 - 5) / 50
        ends.append((done + size, chunk_s(done, size, 2.4e-6) * 5.5 / 5 * wobble))
        done, i = done + size, i + 1
    finish = sum(seconds for _, seconds in ends)
    out, t, start = [], 0.0, 0
    for end, seconds in ends:
        out.append((start + (end - start) // 2, round((t + seconds / 2) * 1e9),
                    finish - t - seconds / 2))
        t += seconds
        out.append((end, round(t * 1e9), finish - t))
        start = end
    return out


def test_no_figure_until_the_fit_is_known_then_close_to_the_truth() -> None:
    """Issue 31 item 5: at 9% of a 5,000-word paste it said 14 s with ~27 s to go (the rate
    so far, before the fit), then jumped to 32 s (a fit over a sliver of the prompt). Now
    nothing until 10% is read and the fit is known to within 5%; from the first figure on,
    every one is within 10-15% of the real time left, and none goes missing again."""
    total = 6000
    clock, said = PrefillClock(total, 0), []
    for done, t_ns, truth in llama_cpp_like(total)[:-1]:
        rate, left_s = clock.tick(done, t_ns)
        said.append((done, left_s, truth, (total - done) / rate))
    first = next(i for i, (_d, left_s, _t, _f) in enumerate(said) if left_s is not None)
    assert said[first][0] >= total // 10
    assert all(left_s is not None for _d, left_s, _t, _f in said[first:])
    ratios = [left_s / truth for _d, left_s, truth, _f in said[first:]]
    assert min(ratios) >= 0.9 and max(ratios) <= 1.15
    # What was hidden: at 9% the rate so far promised about half the time really left, and a
    # fit at 10% (three noisy chunks past the first) about twice it.
    nine = max(i for i, (done, *_rest) in enumerate(said) if done <= 0.09 * total)
    assert said[nine][3] / said[nine][2] < 0.78


def test_the_rule_on_a_recorded_llama_cpp_prefill() -> None:
    """A real sequence (tests/data: 991 progress events of a lone 6,000-token llama.cpp
    prefill, by benchmarks/record_prefill_progress.py on a 2-core EPYC while other jobs loaded
    it, so the rate fell from ~35 to ~100 ms/token): no figure before 10% is read, none until
    the fit is known, then one on every event; where 10 s or more remained, within 0.85-1.3x
    of the real time."""
    data = json.loads(RECORDED.read_text("utf-8"))
    total, end_ns, clock = data["total"], data["end_ns"], PrefillClock(data["total"], 0)
    said = [(done, clock.tick(done, t_ns)[1], (end_ns - t_ns) * 1e-9)
            for t_ns, done in data["progress"]]
    assert len(said) == 991 and said[-1][:2] == (total, 0.0)
    first = next(i for i, (_d, left_s, _t) in enumerate(said) if left_s is not None)
    assert said[first][0] >= total // 10
    assert all(left_s is not None for _d, left_s, _t in said[first:])
    ratios = [left_s / truth for _d, left_s, truth in said[first:] if truth >= 10]
    assert min(ratios) >= 0.85 and max(ratios) <= 1.3


def test_cheaper_later_tokens_never_promise_less_than_the_rate_so_far() -> None:
    rate, left_s = run(PrefillClock(1000, 0), [100] * 4, slope=-1e-6)
    assert left_s == pytest.approx(600 / rate)


def test_nothing_left_is_zero() -> None:
    _rate, left_s = run(PrefillClock(400, 0), [100] * 4)
    assert left_s == 0.0
