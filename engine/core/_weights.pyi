"""Sampling weights in one native pass (engine/core/_weights.c)."""

import numpy as np
import numpy.typing as npt

def exp_weights(logits: npt.NDArray[np.float32], top: float, inv_temperature: float,
                out: npt.NDArray[np.float32], sums: npt.NDArray[np.float64], block: int,
                /) -> None:
    """out[i] = exp((logits[i] - top) * inv_temperature) (0 below exp(-87)); sums[b] = the sum
    of block b of out. C-contiguous float32 logits and out of one length, a float64 sum per
    block."""

def pick(weights: npt.NDArray[np.float32], sums: npt.NDArray[np.float64], u: float, block: int,
         /) -> int:
    """The index of the first weight whose cumulative sum (float64, in order) passes u times
    the total, found through the block sums first."""

def top(logits: npt.NDArray[np.float32], /) -> float:
    """The largest logit, NaN if any is."""

def top_k(logits: npt.NDArray[np.float32], k: int, ids: npt.NDArray[np.int64], /) -> int:
    """The ids of the logits >= the k-th largest (1 <= k <= 256, at most their size), in order:
    as many as fit written to ids; how many there are."""

def reaching(weights: npt.NDArray[np.float32], target: float, /) -> tuple[float, float]:
    """The largest weight w whose weights >= w hold target, and the mass of those heavier."""

def cut(weights: npt.NDArray[np.float32], last: float, stay: int, sums: npt.NDArray[np.float64],
        block: int, /) -> int:
    """Zero the weights below last and those equal to it after the first `stay`, in place, the
    block sums following; how many weights equal last."""

def keeps(weights: npt.NDArray[np.float32], index: int, sums: npt.NDArray[np.float64],
          block: int, top_p: float, /) -> bool:
    """Whether the mass of the weights heavier than weights[index] and of those equal to it at
    lower indices (float32 lanes, float64 across) is short of top_p of the whole (`sums`: one
    float64 sum per block); read block by block until the verdict is sure."""

def draw(logits: npt.NDArray[np.float32], inv_temperature: float, top_p: float, u: float,
         out: npt.NDArray[np.float32], sums: npt.NDArray[np.float64], block: int,
         /) -> tuple[float, int, bool]:
    """top, exp_weights, pick and keeps in one call: the logits' maximum, the drawn index and
    whether top-p keeps it (top_p >= 1: kept); index -1 where the maximum is not finite."""

def level() -> str:
    """The instruction-set level the weights run on: 'avx512', 'avx2' or 'portable'."""

def use(level: str, /) -> bool:
    """Run the weights on `level` if this CPU can (False, unchanged, if not)."""
