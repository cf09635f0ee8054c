"""engine/core/host_logits.py: a runtime's registered logits views, read without torch."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from engine.core import host_logits
from engine.core.sampling import greedy_token, host_array, sample
from engine.params import SamplingParams

Registered = tuple[torch.Tensor, np.ndarray]


@pytest.fixture
def registered() -> Iterator[Registered]:
    """Three rows of logits whose best tokens differ (7, 2, 11), registered, then forgotten."""
    array = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    for row, best in zip(array, (7, 2, 11), strict=True):
        row[best] = 10.0
    view = torch.from_numpy(array)
    host_logits.register(view, array)
    yield view, array
    host_logits.forget(view)


def test_a_registered_views_rows_and_arrays_are_its_own(registered: Registered) -> None:
    view, array = registered
    for j in range(3):
        row = host_logits.row(view, j)
        assert row is host_logits.row(view, j)  # the same object every step
        assert torch.equal(row, view[j])
        assert host_logits.array(row) is not None
        assert np.shares_memory(host_logits.array(row), array[j])
        assert host_array(row) is host_logits.array(row)
    assert host_logits.array(view) is array


def test_the_core_draws_each_row_from_that_rows_logits(registered: Registered) -> None:
    view, _ = registered
    sampled = SamplingParams(temperature=0.01, top_p=0.9)
    for j, best in enumerate((7, 2, 11)):
        row = host_logits.row(view, j)
        assert greedy_token(row) == best
        assert sample(row, sampled, None).token == best


def test_a_batch_steps_run_of_rows_is_registered_once(registered: Registered) -> None:
    """A batch step takes each reply's rows (one, or a draft's run) through rows_of: the same
    registered part every step, its rows reading the view's own memory, drawn from as their
    rows of the view are."""
    view, array = registered
    part = host_logits.rows_of(view, 1, 2)
    assert part is host_logits.rows_of(view, 1, 2)
    assert torch.equal(part, view[1:3])
    assert host_logits.rows_of(view, 2, 1) is not part
    for j, best in enumerate((2, 11)):
        row = host_logits.row(part, j)
        assert row is host_logits.row(part, j)
        assert np.shares_memory(host_logits.array(row), array[1 + j])
        assert greedy_token(row) == best


def test_an_unregistered_tensor_takes_torchs_way() -> None:
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert host_logits.array(tensor) is None
    row = host_logits.row(tensor, 1)
    assert torch.equal(row, tensor[1])
    assert host_logits.array(row) is None
    assert np.array_equal(host_array(row), [4, 5, 6, 7])
    assert greedy_token(row) == 3
    part = host_logits.rows_of(tensor, 1, 2)
    assert torch.equal(part, tensor[1:3]) and host_logits.array(part) is None


def test_a_forgotten_view_is_no_longer_known(registered: Registered) -> None:
    view, _ = registered
    row = host_logits.row(view, 1)
    part = host_logits.rows_of(view, 0, 2)
    part_row = host_logits.row(part, 1)
    host_logits.forget(view)
    assert host_logits.array(view) is None
    assert host_logits.array(row) is None
    assert host_logits.array(part) is None and host_logits.array(part_row) is None
    assert host_logits.rows_of(view, 0, 2) is not part
    assert host_logits.row(view, 1) is not row
    host_logits.forget(view)  # twice: nothing to drop
