import math

import pytest
import torch

from engine.errors import InvalidRequestError, SamplingError
from engine.params import SamplingParams
from engine.sampling import (
    apply_repetition_penalty,
    filtered_probs,
    make_generator,
    sample_token,
    sampler_view,
)


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
