"""Logits a runtime holds as numpy arrays, found again from their torch views without torch.

Right after a llama.cpp decode step has streamed the weights through the caches, torch's own
row indexing (`rows[0]`) and conversion (`.numpy()`) of a logits view cost ~40 us each (an
AMD EPYC Zen 4; ~1 us when warm), about 1% of a step on two cores. A runtime that makes its
views with `torch.from_numpy` registers them here once; the core then reads a view's rows and
their arrays by a dictionary lookup each. A view stays registered until its runtime forgets it
(when its buffer goes away); the registry holds it alive meanwhile, so an id names one view.
"""

from __future__ import annotations

import numpy as np
import torch

_rows: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}
_arrays: dict[int, tuple[torch.Tensor, np.ndarray]] = {}
# a registered view's runs of rows (a batch step's rows of one reply), by (start, count)
_parts: dict[int, dict[tuple[int, int], torch.Tensor]] = {}


def register(view: torch.Tensor, array: np.ndarray) -> None:
    """Register `view`, made by torch.from_numpy(array) of shape (rows, vocab), and its rows."""
    rows = tuple(view[i] for i in range(array.shape[0]))
    _rows[id(view)] = (view, rows)
    _arrays[id(view)] = (view, array)
    for row, values in zip(rows, array, strict=True):
        _arrays[id(row)] = (row, values)


def forget(view: torch.Tensor) -> None:
    """Drop a registered view, its rows and its runs of rows (its runtime's buffer is going
    away)."""
    entry = _rows.get(id(view))
    if entry is None or entry[0] is not view:
        return
    del _rows[id(view)]
    for tensor in (view, *entry[1]):
        _arrays.pop(id(tensor), None)
    for part in _parts.pop(id(view), {}).values():
        forget(part)


def row(rows: torch.Tensor, j: int) -> torch.Tensor:
    """rows[j]: the registered row itself where `rows` is a registered view."""
    entry = _rows.get(id(rows))
    if entry is not None and entry[0] is rows:
        return entry[1][j]
    return rows[j]


def rows_of(view: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """view[start : start + count]; where `view` is registered, a registered view of those rows,
    made once (a batch step takes each reply's rows so: torch's slice and its row cost ~40 us
    each right after a decode step)."""
    entry = _rows.get(id(view))
    if entry is None or entry[0] is not view:
        return view[start : start + count]
    parts = _parts.setdefault(id(view), {})
    part = parts.get((start, count))
    if part is None:
        part = parts[(start, count)] = view[start : start + count]
        register(part, _arrays[id(view)][1][start : start + count])
    return part


def array(tensor: torch.Tensor) -> np.ndarray | None:
    """The numpy array a registered view or row reads (no copy); None for any other tensor."""
    entry = _arrays.get(id(tensor))
    if entry is not None and entry[0] is tensor:
        return entry[1]
    return None
