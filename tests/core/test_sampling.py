import math

import numpy as np
import pytest
import torch

from engine.core import sampling
from engine.core.sampling import (
    AHEAD,
    BLOCK,
    SAMPLE_SIZE,
    apply_repetition_penalty,
    beyond_top_p,
    by_rejection,
    draw,
    filtered_probs,
    make_generator,
    pick,
    sample,
    sample_token,
    sampler_view,
    top_k_ids,
    weight_reaching,
)
from engine.errors import InvalidRequestError, SamplingError
from engine.params import SamplingParams


@pytest.fixture(autouse=True, params=["native", "numpy"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on both ways of computing the weights: the native pass
    (engine/core/_weights.c) and numpy's, which a machine without a C compiler gets."""
    if request.param == "native" and not sampling.native_weights:
        pytest.skip("engine/core/_weights.c was not compiled here")
    monkeypatch.setattr(sampling, "native_weights", request.param == "native")
    return str(request.param)


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) if p > 0 else float("-inf") for p in probs])


def test_greedy_is_argmax_without_randomness() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    params = SamplingParams(temperature=0)
    assert {sample_token(logits, params, None) for _ in range(5)} == {1}


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.count_nonzero(probs) == 2
    assert torch.allclose(probs[:2], torch.tensor([0.625, 0.375]))


def test_top_p_always_keeps_the_most_likely_token() -> None:
    logits = logits_from_probs([0.9, 0.1])
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.05))
    assert probs.tolist() == [1.0, 0.0]


def test_top_k_and_min_p_filter() -> None:
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1])
    top2 = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.count_nonzero(top2) == 2
    min_p = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.6))
    assert torch.count_nonzero(min_p) == 2  # 0.2 and 0.1 are below 0.6 x 0.4


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    cold = filtered_probs(logits, SamplingParams(temperature=0.5))
    hot = filtered_probs(logits, SamplingParams(temperature=2.0))
    assert cold[0] > hot[0]


def test_seeded_sampling_is_reproducible() -> None:
    logits = torch.randn(500)
    params = SamplingParams(temperature=1.0, seed=1234)

    def draw() -> list[int]:
        gen = make_generator(params.seed)
        return [sample_token(logits, params, gen) for _ in range(20)]

    assert draw() == draw()
    assert len(set(draw())) > 1


def test_nan_and_all_masked_logits_raise_clear_errors() -> None:
    with pytest.raises(SamplingError, match="NaN"):
        sample_token(torch.tensor([0.0, float("nan")]), SamplingParams(), None)
    with pytest.raises(SamplingError, match="-inf"):
        sample_token(torch.full((3,), float("-inf")), SamplingParams(), None)


def test_repetition_penalty_lowers_seen_tokens() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repetition_penalty(logits, [0, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_sampler_view_reports_cut() -> None:
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    top, kept = sampler_view(logits, SamplingParams(temperature=1.0, top_p=0.8), k=4)
    assert [t for t, _ in top] == [0, 1, 2, 3]
    assert kept == 2
    assert sampler_view(logits, SamplingParams(temperature=0))[1] == 1


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),  # the draw's own distribution is the plain one
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, min_p=0.2),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.5, min_p=0.05),
], ids=["plain", "top-p", "top-k", "min-p", "all"])
def test_a_view_from_the_drawn_distribution_is_the_view_computed_afresh(
        params: SamplingParams) -> None:
    logits = torch.randn(20_000, generator=torch.Generator().manual_seed(3)) * 4
    drawn = sample(logits, params, make_generator(1))
    assert drawn.chosen is not None
    assert (drawn.chosen.owed_top_p < 1.0) == by_rejection(params, logits.numel())
    assert sampler_view(logits, params, chosen=drawn.chosen) == sampler_view(logits, params)
    assert 0 < sampler_view(logits, params, chosen=drawn.chosen)[1] <= 12


def test_a_draw_keeps_the_logits_it_was_picked_from_after_the_penalty() -> None:
    """A snapshot shows what the sampler saw: the penalised logits."""
    logits = torch.tensor([3.0, 2.0, 0.0])
    greedy = SamplingParams(temperature=0, repetition_penalty=2.0)
    drawn = sample(logits, greedy, None, previous_ids=[0])
    assert drawn.token == 1 and drawn.chosen is None
    assert drawn.logits.tolist() == [1.5, 2.0, 0.0]
    assert sampler_view(drawn.logits, greedy)[0][0][0] == 1
    assert sampler_view(logits, greedy)[0][0][0] == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top-p"),
        ({"top_p": 1.5}, "top-p"),
        ({"max_tokens": 0}, "max tokens"),
        ({"max_tokens": -3}, "max tokens"),
        ({"top_k": -1}, "top-k"),
        ({"min_p": 1.0}, "min-p"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_invalid_params_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs).validate()


# ----- exact values (mutation testing, `make mutation`): each computed here independently -------
def softmax(values: list[float]) -> list[float]:
    top = max(values)
    weights = [math.exp(v - top) for v in values]
    return [w / sum(weights) for w in weights]


def test_temperature_divides_the_logits_exactly() -> None:
    logits = [2.0, 1.0, 0.0, -1.0]
    for temperature in (0.5, 1.0, 2.0):
        probs = filtered_probs(torch.tensor(logits), SamplingParams(temperature=temperature))
        expected = softmax([v / temperature for v in logits])
        assert probs.tolist() == pytest.approx(expected, rel=1e-5)


def test_a_tiny_temperature_stays_finite() -> None:
    """Shifting by the max first: 1000 / 1e-36 would overflow float32 to inf (then NaN)."""
    logits = torch.tensor([1000.0, 999.0])
    params = SamplingParams(temperature=1e-36)
    assert filtered_probs(logits, params).tolist() == [1.0, 0.0]
    assert sampler_view(logits, params)[0] == [(0, 1.0), (1, 0.0)]
    assert sample_token(logits, params, make_generator(1)) == 0


def test_top_p_of_one_is_off_even_for_a_vanishing_tail() -> None:
    """p = 1 keeps every token: the mass before a 1e-13 tail rounds to 1.0 in float32."""
    probs = filtered_probs(torch.tensor([0.0, -30.0, -30.0]), SamplingParams(temperature=1.0))
    assert torch.count_nonzero(probs) == 3


def test_top_k_keeps_exactly_k_renormalised() -> None:
    logits = [3.0, 1.0, 2.0, 0.0, -1.0]
    probs = filtered_probs(torch.tensor(logits), SamplingParams(temperature=1.0, top_k=2))
    kept = softmax([3.0, 2.0])
    assert probs.tolist() == pytest.approx([kept[0], 0.0, kept[1], 0.0, 0.0], rel=1e-5)


def test_top_k_of_one_is_the_argmax() -> None:
    probs = filtered_probs(torch.tensor([0.5, 2.0, 1.0]), SamplingParams(temperature=1.0, top_k=1))
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    probs = filtered_probs(torch.tensor([1.0, 1.0, 1.0, 0.0]),
                           SamplingParams(temperature=1.0, top_k=2))
    assert probs.tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])


def test_top_k_at_or_above_the_vocabulary_is_off() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    plain = filtered_probs(logits, SamplingParams(temperature=1.0))
    assert plain.tolist() == pytest.approx(softmax([2.0, 1.0, 0.0]), rel=1e-5)
    for k in (3, 50):
        assert filtered_probs(logits, SamplingParams(temperature=1.0, top_k=k)).tolist() == \
            plain.tolist()


def test_top_p_stops_where_the_mass_before_a_token_reaches_p() -> None:
    """Four equal tokens (0.25 each, exact in float): p = 0.5 keeps two, as the mass before the
    third is exactly 0.5; p = 0.51 keeps three."""
    logits = torch.zeros(4)
    half = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert half.tolist() == [0.5, 0.5, 0.0, 0.0]
    more = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.51))
    assert more.tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])


def test_top_p_drops_the_tail_of_an_unsorted_vocabulary() -> None:
    """The cut is made in probability order, then mapped back to token ids."""
    logits = logits_from_probs([0.05, 0.3, 0.15, 0.5])
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert probs.tolist() == pytest.approx([0.0, 0.375, 0.0, 0.625], rel=1e-5)


def test_min_p_floor_is_relative_to_the_most_likely_token() -> None:
    logits = logits_from_probs([0.1, 0.4, 0.3, 0.2])
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.6))
    assert probs.tolist() == pytest.approx([0.0, 4 / 7, 3 / 7, 0.0], rel=1e-5)
    off = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.0))
    assert off.tolist() == pytest.approx([0.1, 0.4, 0.3, 0.2], rel=1e-5)


def test_filters_compose_in_order() -> None:
    """temperature, then top-k, top-p and min-p, each cutting one more token."""
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    params = SamplingParams(temperature=2.0, top_k=4, top_p=0.85, min_p=0.5)
    after_k = softmax([2.0, 1.5, 1.0, 0.5])  # T = 2; top-k cuts the last token
    assert sum(after_k[:2]) < 0.85 <= sum(after_k[:3])  # top-p cuts the fourth
    assert after_k[2] / after_k[0] < 0.5 <= after_k[1] / after_k[0]  # min-p cuts the third
    kept = after_k[0] + after_k[1]
    expected = [after_k[0] / kept, after_k[1] / kept, 0.0, 0.0, 0.0]
    assert filtered_probs(logits, params).tolist() == pytest.approx(expected, rel=1e-5)


def test_filtered_probs_works_row_by_row_on_a_batch() -> None:
    """[..., vocab] logits: each row is filtered and renormalised on its own."""
    rows = torch.tensor([[3.0, 1.0, 0.0, -2.0], [0.0, 0.5, 4.0, 1.0]])
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=2),
                   SamplingParams(temperature=1.0, top_p=0.6),
                   SamplingParams(temperature=1.0, min_p=0.2)):
        batch = filtered_probs(rows, params)
        for i in range(2):
            assert batch[i].tolist() == pytest.approx(filtered_probs(rows[i], params).tolist())


def test_repetition_penalty_shrinks_small_positive_and_grows_negative_logits() -> None:
    logits = torch.tensor([0.5, -0.5, 0.0, 3.0])
    out = apply_repetition_penalty(logits, [0, 1, 2, 0, 2], 2.0)
    assert out.tolist() == [0.25, -1.0, 0.0, 3.0]
    assert apply_repetition_penalty(logits, [0], 1.0).tolist() == logits.tolist()
    assert apply_repetition_penalty(logits, [], 2.0).tolist() == logits.tolist()


def test_repetition_penalty_changes_which_token_is_greedy() -> None:
    logits = torch.tensor([2.0, 1.5, 0.0])
    greedy = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert sample_token(logits, greedy, None) == 0
    assert sample_token(logits, greedy, None, previous_ids=[0]) == 1  # 2.0 / 1.5 < 1.5


def test_infinite_logits_are_refused() -> None:
    with pytest.raises(SamplingError, match="infinite"):
        sample_token(torch.tensor([0.0, float("inf")]), SamplingParams(temperature=0), None)


def test_some_masked_logits_are_fine() -> None:
    logits = torch.tensor([float("-inf"), 1.0, float("-inf"), 0.5])
    assert sample_token(logits, SamplingParams(temperature=0), None) == 1
    gen = make_generator(7)
    draws = {sample_token(logits, SamplingParams(temperature=1.0), gen) for _ in range(30)}
    assert draws <= {1, 3}


def test_a_penalty_that_overflows_a_logit_is_refused() -> None:
    """A penalty below 1 grows a seen positive logit: 3e38 / 0.5 overflows float32."""
    logits = torch.tensor([3e38, 0.0])
    params = SamplingParams(temperature=0, repetition_penalty=0.5)
    with pytest.raises(SamplingError, match="infinite"):
        sample_token(logits, params, None, previous_ids=[0])


def test_sampling_draws_with_the_given_generator() -> None:
    """The request's generator, not the global one: the same seed draws the same tokens
    whatever else used torch's global generator in between."""
    logits = torch.zeros(1000)
    params = SamplingParams(temperature=1.0)
    first = [sample_token(logits, params, make_generator(99)) for _ in range(3)]
    torch.rand(10)  # move the global generator on
    again = [sample_token(logits, params, make_generator(99)) for _ in range(3)]
    assert first == again
    assert len(set(first)) == 1  # a fresh generator of one seed: the same first draw each time
    # one uniform number from that generator picks the token (1000 equal tokens: its 1000th)
    u = float(np.random.default_rng(99).random())
    assert first[0] == int(u * 1000)


def test_an_unseeded_generator_differs_between_requests() -> None:
    logits = torch.zeros(1 << 16)
    params = SamplingParams(temperature=1.0)
    draws = {sample_token(logits, params, make_generator(None)) for _ in range(4)}
    assert len(draws) > 1  # 4 draws among 65,536 equal tokens: all equal 1 time in 2**48


def test_sampler_view_probabilities_are_after_temperature() -> None:
    logits = torch.tensor([2.0, 0.0, 1.0])
    top, kept = sampler_view(logits, SamplingParams(temperature=0.5), k=2)
    expected = softmax([4.0, 0.0, 2.0])
    assert [t for t, _ in top] == [0, 2]
    assert [p for _, p in top] == pytest.approx([expected[0], expected[2]], rel=1e-5)
    assert kept == 2


def test_sampler_view_for_greedy_is_the_plain_softmax_and_keeps_one() -> None:
    logits = torch.tensor([2.0, 0.0, 1.0])
    top, kept = sampler_view(logits, SamplingParams(temperature=0))
    assert [t for t, _ in top] == [0, 2, 1]  # k = 12 > vocabulary: all three
    plain = softmax([2.0, 0.0, 1.0])
    assert [p for _, p in top] == pytest.approx([plain[0], plain[2], plain[1]], rel=1e-5)
    assert kept == 1


def test_sampler_view_shows_twelve_candidates() -> None:
    logits = torch.arange(20, dtype=torch.float32)
    top, kept = sampler_view(logits, SamplingParams(temperature=1.0))
    assert [t for t, _ in top] == list(range(19, 7, -1))
    assert kept == 12


def test_sampler_view_counts_only_top_candidates_that_survive() -> None:
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    _, kept = sampler_view(logits, SamplingParams(temperature=1.0, top_k=4), k=3)
    assert kept == 3  # four survive, three of them shown
    _, kept = sampler_view(logits, SamplingParams(temperature=1.0, top_k=2), k=3)
    assert kept == 2


def test_min_p_keeps_a_token_exactly_at_the_floor() -> None:
    """min-p keeps every token with p >= min_p * p_max: one exactly at the floor stays (a `<=`
    cut would drop it). Logits ln 2, 0, 0 give probabilities 0.5, 0.25, 0.25 exactly."""
    logits = torch.tensor([math.log(2.0), 0.0, 0.0])
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.5))
    assert probs.tolist() == [0.5, 0.25, 0.25]
    assert filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.51)).tolist() == \
        [1.0, 0.0, 0.0]


def test_draws_follow_the_distribution_and_never_pick_a_zero() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0.0])
    gen = make_generator(7)
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(4000)]), minlength=6)
    assert counts[[0, 2, 5]].tolist() == [0, 0, 0]
    assert abs(int(counts[1]) - 2000) < 150 and abs(int(counts[3]) - 1000) < 120
    # an unnormalised vector draws as its normalised one: the same token for the same seed
    assert draw(probs * 3, make_generator(5)) == draw(probs, make_generator(5))


def test_top_p_on_a_large_vocabulary_drops_what_a_full_sort_drops() -> None:
    """beyond_top_p never sorts the vocabulary: the same tokens go as with a full sort (the mass
    before each token against top_p of the whole, in float64), also where most of the mass
    lies in a flat tail of equal weights (ties go by token id)."""
    gen = torch.Generator().manual_seed(3)
    for logits in (torch.randn(262_144, generator=gen) * 4,
                   torch.cat([torch.tensor([6.0, 5.0]), torch.zeros(100_000)]),
                   torch.randn(50_000, generator=gen) * 0.01):
        weights = torch.softmax(logits, dim=-1).numpy()
        order = np.argsort(-weights, kind="stable")
        cumulative = np.cumsum(weights[order], dtype=np.float64)
        for top_p in (0.1, 0.5, 0.9, 0.999):
            full = np.zeros(weights.size, dtype=bool)
            full[order] = (cumulative - weights[order]) >= top_p * cumulative[-1]
            assert np.array_equal(beyond_top_p(weights, top_p), full), top_p


def test_a_draw_landing_exactly_on_a_boundary_takes_the_next_token_with_mass() -> None:
    """The drawn token is the first whose cumulative probability passes the draw: one that lands
    exactly where a token's mass ends goes on past it, and past the zeros after it."""
    seed = next(s for s in range(100) if make_generator(s).random() >= 0.5)
    u = make_generator(seed).random()
    probs = torch.tensor([u, 0.0, 0.0, 1.0 - u], dtype=torch.float64)  # sums to 1 exactly
    assert draw(probs, make_generator(seed)) == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_logits_of_other_dtypes_are_checked_and_sampled(dtype: torch.dtype) -> None:
    """bf16-eager on a CPU, a GPU's half precision: numpy has no bfloat16, so these are read
    through one float32 copy (float32 and float64 logits are read in place)."""
    logits = torch.tensor([0.5, 3.0, 1.0, -2.0], dtype=dtype)
    assert sample_token(logits, SamplingParams(temperature=0.0), None) == 1
    assert sample_token(logits, SamplingParams(temperature=1.0, top_k=1),
                        make_generator(0)) == 1
    with pytest.raises(SamplingError, match="NaN"):
        sample_token(torch.tensor([0.5, math.nan], dtype=dtype),
                     SamplingParams(temperature=0.0), None)


def test_a_repetition_penalty_of_two_turns_greedy_away_from_a_repeat() -> None:
    logits = torch.tensor([2.0, 1.5, 0.0])
    greedy = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample_token(logits, greedy, None) == 0
    assert sample_token(logits, greedy, None, previous_ids=[0]) == 1  # 2.0 / 2 < 1.5


def test_a_draw_from_blocks_picks_what_one_cumulative_sum_picks() -> None:
    """pick sums a long vector in blocks and accumulates only the block the draw lands in: the
    token is the one a single float64 cumulative sum gives, at block edges and across runs of
    zeros (never a zero), but where the draw falls within the blocks' float32 rounding of a
    token's edge."""
    rng = np.random.default_rng(5)
    weights = rng.random(262_144 + 77).astype(np.float32)
    weights[rng.random(weights.size) < 0.5] = 0.0
    weights[3 * BLOCK:9 * BLOCK] = 0.0  # whole blocks without mass
    cumulative = np.cumsum(weights, dtype=np.float64)
    edges = [float(cumulative[i]) / float(cumulative[-1]) for i in (BLOCK - 1, 3 * BLOCK - 1)]
    for u in [*rng.random(300), 0.0, *edges, np.nextafter(1.0, 0.0)]:
        expected = min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")),
                       int(np.flatnonzero(weights)[-1]))
        chosen = pick(weights, float(u))
        assert weights[chosen] > 0
        if chosen != expected:  # a draw on an edge: the chosen token's span reaches it
            slack = 1e-7 * float(cumulative[-1])
            target = u * float(cumulative[-1])
            assert cumulative[chosen - 1] - slack <= target <= cumulative[chosen] + slack, u


@pytest.mark.parametrize("k", [1, 40, 64, 1000])
def test_top_k_ids_are_the_k_largest_and_their_ties(k: int) -> None:
    rng = np.random.default_rng(k)
    flat = rng.standard_normal(262_144).astype(np.float32)
    tied = np.round(flat, 1)  # many equal logits, the k-th among them
    only_in_sample = np.zeros(262_144, np.float32)
    only_in_sample[:: 262_144 // SAMPLE_SIZE] = 10 + np.arange(SAMPLE_SIZE)  # misleads the sample
    for logits in (flat, tied, only_in_sample, rng.standard_normal(1500).astype(np.float32)):
        kth = np.sort(logits)[::-1][k - 1]
        assert np.array_equal(top_k_ids(logits, k), np.flatnonzero(logits >= kth))


def test_top_p_finds_a_head_the_sample_misses() -> None:
    """A few heavy tokens between the sampled positions hold most of the mass: the set still
    ends where a full sort ends it."""
    logits = np.zeros(262_144, np.float32)
    logits[[1, 333, 70_001]] = [12.0, 11.5, 11.0]
    weights = np.exp(logits - logits.max())
    for top_p in (0.3, 0.6, 0.95):
        order = np.argsort(-weights, kind="stable")
        cumulative = np.cumsum(weights[order], dtype=np.float64)
        full = np.zeros(weights.size, dtype=bool)
        full[order] = (cumulative - weights[order]) >= top_p * cumulative[-1]
        assert np.array_equal(beyond_top_p(weights, top_p), full), top_p


# ----- the survivors of `make mutation` on the numpy sampler ------------------------------------
def test_filtered_probabilities_are_float32_and_keep_one_of_equal_tokens_where_p_asks() -> None:
    probs = filtered_probs(torch.zeros(4), SamplingParams(temperature=1.0, top_p=0.2))
    assert probs.dtype == torch.float32
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]  # 0.2 of four equal tokens: the first alone
    sparse = filtered_probs(torch.tensor([3.0, 1.0, 2.0]), SamplingParams(temperature=1.0,
                                                                          top_k=2))
    assert sparse.dtype == torch.float32


def test_sampler_view_counts_what_top_k_and_top_p_together_keep() -> None:
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    _, kept = sampler_view(logits, SamplingParams(temperature=1.0, top_k=4, top_p=0.5), k=6)
    assert kept == 1  # top-k keeps four; of those, e^5 alone holds half of their mass


def test_sampler_view_lists_equal_candidates_by_token_id() -> None:
    """Five tokens above 40 equal ones: the twelve shown are the five, then the first seven of
    the equal ones by id (an unstable sort of the candidates mixes them)."""
    values = np.zeros(120, np.float32)
    order = np.random.default_rng(0).permutation(120)
    values[order[:5]], values[order[5:45]] = 2.0, 1.0
    top, _ = sampler_view(torch.from_numpy(values), SamplingParams(temperature=1.0))
    assert [t for t, _ in top] == sorted(range(120), key=lambda i: (-values[i], i))[:12]


def test_where_top_p_ends_is_found_also_at_exact_masses_and_past_rounding() -> None:
    """weight_reaching: (the weight where the set reaching the target ends, the mass heavier
    than it). Exact sums (integers in float32), heavy tokens outside the selection's sample,
    and a target a rounding above the whole (the set is then every token)."""
    heavy = np.ones(10_000, np.float32)
    heavy[[1, 2]] = 1000.0  # between the sampled positions; they hold the target exactly
    assert weight_reaching(heavy, 2000.0) == (1000.0, 0.0)
    levels = np.repeat(np.array([2.0, 1.0], np.float32), 5000)  # the 2s hold it exactly
    assert weight_reaching(levels, 10_000.0) == (2.0, 0.0)
    assert weight_reaching(np.ones(10_000, np.float32), 10_000 * (1 + 1e-9)) == (1.0, 0.0)
    small = np.arange(1, 101, dtype=np.float32)
    assert weight_reaching(small, 5050 * (1 + 1e-9)) == (1.0, 5049.0)


def test_a_draw_on_a_block_edge_or_past_a_block_sums_rounding_takes_the_right_token() -> None:
    """Exact sums: a draw exactly where a block's mass ends takes the next block's first
    token. A block's float32 sum can exceed its tokens' float64 sum: a draw landing between the
    two takes the block's last token with mass."""
    ones = np.ones(8 * BLOCK, np.float32)
    assert pick(ones, 0.125) == BLOCK  # 0.125 x 8,192 = 1,024: past the first block
    for count in range(900, BLOCK - 1):  # one whose float32 sum rounds up (found at 900 here)
        rounded_up = np.zeros(5 * BLOCK, np.float32)
        rounded_up[1:count + 1] = 3 * 2.0**-25  # 0.75 of float32's step at 1.0
        rounded_up[0] = 1.0
        exact = float(np.cumsum(rounded_up, dtype=np.float64)[-1])
        block_sum = float(rounded_up[:BLOCK].sum())
        if block_sum > exact:
            break
    assert block_sum > exact
    u = (exact + (block_sum - exact) / 2) / block_sum
    assert pick(rounded_up, u) == count  # the last token with mass; those after it weigh 0


def test_a_logit_overflowing_below_the_top_weighs_nothing_without_a_warning() -> None:
    """-3e38 - 3e38 and -1,000 / 1e-36 overflow float32 to -inf: weight 0, as exp would give
    (found by the fuzz test; warnings are errors here)."""
    wide = torch.tensor([3e38, -3e38])
    assert filtered_probs(wide, SamplingParams(temperature=1.0)).tolist() == [1.0, 0.0]
    assert sample_token(wide, SamplingParams(temperature=1.0), make_generator(0)) == 0
    cold = torch.tensor([0.0, -1000.0])
    assert filtered_probs(cold, SamplingParams(temperature=1e-36)).tolist() == [1.0, 0.0]


def test_a_penalty_lowering_a_huge_negative_logit_keeps_it_finite() -> None:
    """-3e38 x 1.3 overflows float32: the penalised logit stays at the lowest finite value, so
    the token is still the only one left to draw (found by the deep fuzz profile); a masked
    (-inf) token stays masked."""
    logits = torch.tensor([-3e38, float("-inf")])
    out = apply_repetition_penalty(logits, [0, 1], 1.3)
    assert out.tolist() == [torch.finfo(torch.float32).min, float("-inf")]
    assert sample_token(logits, SamplingParams(temperature=0, repetition_penalty=1.3), None,
                        previous_ids=[0]) == 0


# ----- the native weights (engine/core/_weights.c) against numpy's -----------------------------
def numpy_weights(logits: np.ndarray, temperature: float) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.exp((logits.astype(np.float64) - float(logits.max())) / temperature)


@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 4.0])
def test_weights_are_exp_of_the_scaled_logits_within_float_rounding(
        kernel: str, temperature: float) -> None:
    """Both kernels: exp((logit - top) / T) within float32's rounding of the scaled logit (the
    native pass multiplies by 1 / T: ~87 x 6e-8 relative at the far end), the top token exactly
    1, a masked (-inf) token and one far below the top exactly 0; the block sums (native) or
    none (numpy) in every length, a partial last block included."""
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal(5 * BLOCK + 77) * 6).astype(np.float32)
    logits[[7, 4000]] = -np.inf
    logits[9] = logits.max() - 1000 * temperature  # exp(-1000): 0, under float32's smallest
    top = float(logits.max())
    weights, sums = sampling.exp_weights(logits, top, temperature)
    expected = numpy_weights(logits, temperature)
    assert weights.dtype == np.float32
    assert weights[int(logits.argmax())] == 1.0
    assert weights[[7, 4000, 9]].tolist() == [0.0, 0.0, 0.0]
    normal = expected > 1.2e-38  # float32's normal range (the native pass flushes below it)
    assert np.allclose(weights[normal], expected[normal], rtol=1e-5, atol=0)
    assert np.all(weights[~normal] <= 1.2e-38)
    if kernel == "numpy" or not sampling.native_exp:
        assert sums is None
        return
    assert sums is not None and sums.size == 6
    exact = [float(weights[i:i + BLOCK].sum(dtype=np.float64)) for i in range(0, 6 * BLOCK,
                                                                               BLOCK)]
    assert sums.tolist() == pytest.approx(exact, rel=1e-6)


def test_a_draw_takes_the_token_numpy_would_take_on_either_kernel(kernel: str) -> None:
    """The native pick walks the block sums and the block in float64, in order, as numpy's
    cumulative sums do: for the same weights and sums, the same token at every draw."""
    rng = np.random.default_rng(4)
    weights = rng.random(40 * BLOCK + 5).astype(np.float32) ** 8
    weights[rng.random(weights.size) < 0.3] = 0.0
    sums = sampling._block_sums(weights)
    for u in [*rng.random(500), 0.0, np.nextafter(1.0, 0.0)]:
        chosen = pick(weights, float(u), sums)
        cumulative = np.cumsum(sums)
        target = float(u) * float(cumulative[-1])
        block = int(np.searchsorted(cumulative, target, side="right"))
        before = float(cumulative[block - 1]) if block else 0.0
        inside = np.cumsum(weights[block * BLOCK:(block + 1) * BLOCK], dtype=np.float64)
        at = int(np.searchsorted(inside, target - before, side="right"))
        expected = block * BLOCK + min(at, int(np.flatnonzero(
            weights[block * BLOCK:(block + 1) * BLOCK])[-1]))
        assert chosen == expected, u
        assert weights[chosen] > 0


def test_a_generator_gives_the_numbers_single_draws_give() -> None:
    """Drawn AHEAD at a time, in order: a seed's sequence is numpy's PCG64 sequence (a reply
    seeded before this change draws the same tokens)."""
    generator = make_generator(123)
    reference = np.random.default_rng(123)
    assert [generator.random() for _ in range(3 * AHEAD + 5)] == \
        [reference.random() for _ in range(3 * AHEAD + 5)]


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.95, 0.999])
def test_top_p_in_a_distribution_keeps_what_beyond_top_p_keeps(kernel: str, top_p: float) -> None:
    """The native pass cuts top-p in place (one selection, one pass, its block sums kept): the
    same tokens stay as beyond_top_p's mask keeps, on a trained model's shape, a flat one and a
    tail of equal weights (ties by id), and a draw's block sums are the kept weights'."""
    gen = torch.Generator().manual_seed(8)
    peaked = torch.randn(262_144, generator=gen)
    peaked[[3, 900, 77_000]] = torch.tensor([16.0, 15.0, 14.5])
    for logits in (peaked, torch.randn(262_144, generator=gen) * 0.3,
                   torch.cat([torch.tensor([6.0, 5.0]), torch.zeros(100_000)])):
        host = logits.numpy()
        plain = sampling.distribution(host, SamplingParams(temperature=0.7)).weights
        chosen = sampling.distribution(host, SamplingParams(temperature=0.7, top_p=top_p))
        assert np.array_equal(chosen.weights > 0, ~beyond_top_p(plain, top_p)), top_p
        assert np.array_equal(chosen.weights[chosen.weights > 0], plain[chosen.weights > 0])
        if kernel == "native" and sampling.native_exp:
            assert chosen.block_sums is not None
            assert np.allclose(chosen.block_sums, sampling._block_sums(chosen.weights),
                               rtol=1e-6, atol=0)


def test_a_top_p_draw_by_rejection_draws_from_the_kept_tokens_as_the_cut_does() -> None:
    """Top-p without top-k on a long vocabulary draws from the whole distribution and keeps the
    token if top-p keeps it: the kept tokens' distribution, as a draw from the cut weights."""
    # the head holds ~53% of the mass; top-p keeps it and the first ~3,460 of the equal tail
    logits = torch.cat([torch.tensor([8.0, 7.5, 7.0, 6.0, 6.0]), torch.zeros(6_000)])
    params = SamplingParams(temperature=1.0, top_p=0.8)
    assert by_rejection(params, logits.numel())
    cut = filtered_probs(logits, params).numpy()
    generator = make_generator(11)
    draws = np.array([sample(logits, params, generator).token for _ in range(6_000)])
    assert set(np.unique(draws)) <= set(np.flatnonzero(cut > 0))
    assert 3_000 < np.count_nonzero(cut) < 4_000  # ties go by token id: the tail's first
    for token in range(5):
        expected = cut[token] * draws.size
        assert abs(np.count_nonzero(draws == token) - expected) < 5 * math.sqrt(expected)
    tail = np.count_nonzero(draws >= 5)
    assert abs(tail - cut[5:].sum() * draws.size) < 5 * math.sqrt(cut[5:].sum() * draws.size)
    again = make_generator(11)
    assert [sample(logits, params, again).token for _ in range(50)] == draws[:50].tolist()


def test_top_p_below_one_half_or_with_top_k_or_min_p_is_cut_not_checked() -> None:
    assert not by_rejection(SamplingParams(temperature=1.0, top_p=0.4), 100_000)
    assert not by_rejection(SamplingParams(temperature=1.0, top_p=0.9, top_k=40), 100_000)
    assert not by_rejection(SamplingParams(temperature=1.0, top_p=0.9, min_p=0.2), 100_000)
    assert not by_rejection(SamplingParams(temperature=1.0, top_p=0.9), 4 * BLOCK)
    assert not by_rejection(SamplingParams(temperature=1.0), 100_000)


def test_a_draw_that_never_passes_the_check_falls_back_to_the_cut(
        monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.cat([torch.tensor([10.0, 9.0]), torch.zeros(10_000)])
    params = SamplingParams(temperature=1.0, top_p=0.6)  # keeps the first two tokens only
    monkeypatch.setattr(sampling, "top_p_keeps", lambda *_args: False)
    assert sample(logits, params, make_generator(2)).token in (0, 1)


@pytest.mark.parametrize("top_p", [0.5, 0.6, 0.8, 0.9, 0.97, 0.999])
def test_a_top_p_draws_view_counts_what_the_cut_keeps(top_p: float) -> None:
    """A draw by rejection keeps the whole distribution with top-p owed; its view's count of
    kept candidates (a bisection over them by rank) is the cut's, wherever the set ends among
    them, equal weights included."""
    head = torch.tensor([6.0, 5.0, 5.0, 4.5, 4.0, 4.0, 4.0, 3.5, 3.0, 2.5, 2.0, 1.0, 1.0, 0.5])
    logits = torch.cat([head, torch.full((8_000,), -6.0)])  # the tail: ~2% of the mass
    params = SamplingParams(temperature=1.0, top_p=top_p)
    drawn = sample(logits, params, make_generator(4))
    assert drawn.chosen is not None and drawn.chosen.owed_top_p == top_p
    assert sampler_view(logits, params, chosen=drawn.chosen) == sampler_view(logits, params)
    dense, cut = drawn.chosen.dense(logits.numel()), filtered_probs(logits, params).numpy()
    assert np.array_equal(dense > 0, cut > 0) and np.allclose(dense, cut, rtol=1e-5, atol=0)
