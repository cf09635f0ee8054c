"""Token sampling. Order: repetition penalty -> temperature -> top-k -> top-p -> min-p -> draw."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.core import host_logits
from engine.errors import SamplingError
from engine.params import SamplingParams

try:  # compiled by the package's install (engine/core/_weights.c)
    from engine.core import _weights

    native_weights = True
except ImportError:  # no C compiler there: numpy makes the same weights, in four passes
    native_weights = False
# The fused exponent pays on the vector copies (AVX-512 ~55 us, AVX2 ~90 us over 262,144 cold
# logits); the portable one (SSE2 on x86-64) took ~245 us where numpy's four passes take ~145 us.
# The draw and top-p stay native.
VECTOR_LEVELS = ("avx512", "avx2")
native_exp = native_weights and _weights.level() in VECTOR_LEVELS

SAMPLE_SIZE = 4096  # top-k and top-p find their thresholds from a sample of this many logits
BRACKET = 64  # top-p's selection keeps the sampled weights this many ranks either side
BLOCK = 1024  # a draw sums the weights in blocks of this many first
NATIVE_TOP_K = 256  # the native top-k keeps its head in a sorted array of at most this many
TIES_ROOM = 64  # ids of logits tied with the k-th that fit without a second pass
REJECTION_MIN_TOP_P = 0.5  # a top-p draw at or above this is checked, not cut (by_rejection)
MAX_REJECTIONS = 64  # then the cut: each try is kept with probability >= top-p
# 1 / T past float32's range (T below ~3e-39) would make the top token's 0 x inf a NaN
_NATIVE_MIN_TEMPERATURE = 1e-30


AHEAD = 64  # a request's generator draws this many numbers at a time
_UNSEEDED = np.random.default_rng()  # draws for callers without a request's generator


class Generator:
    """A request's random numbers: numpy's PCG64 (on the host whatever the model's device),
    drawn AHEAD at a time, in the order single draws give them: a fixed seed reproduces a
    sampled reply exactly, on either runtime. (After a decode step numpy's code is cold in the
    caches: one draw took ~10 us there, what 64 cost; the first torch.rand took ~40 us.)"""

    def __init__(self, seed: int | None) -> None:
        self._numbers = np.random.default_rng(seed)
        self._ahead: list[float] = []

    def random(self) -> float:
        """The next number in [0, 1) (float64)."""
        if not self._ahead:
            self._ahead = self._numbers.random(AHEAD).tolist()[::-1]
        return self._ahead.pop()


def make_generator(seed: int | None) -> Generator:
    """A per-request generator (a fixed seed reproduces its numbers)."""
    return Generator(seed)


def apply_repetition_penalty(
    logits: torch.Tensor, previous_ids: Sequence[int], penalty: float
) -> torch.Tensor:
    """CTRL-style penalty: shrink positive logits and grow negative ones of seen tokens."""
    if penalty == 1.0 or not previous_ids:
        return logits
    ids = torch.tensor(sorted(set(previous_ids)), device=logits.device)
    seen = logits.index_select(-1, ids)
    lowered = torch.where(seen > 0, seen / penalty, seen * penalty)
    # a finite logit stays finite where the penalty lowers it (-3e38 x 1.3 would overflow to
    # -inf: probability 0, and an error if it was the only token left)
    floor = torch.finfo(lowered.dtype).min
    lowered = torch.where(torch.isfinite(seen) & (lowered < floor), floor, lowered)
    return logits.index_copy(-1, ids, lowered)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (renormalised), float32 on the
    host; [..., vocab] logits are filtered row by row."""
    host = host_array(logits)
    rows = host.reshape(-1, host.shape[-1])
    out = np.stack([distribution(row, params).dense(row.size) for row in rows])
    return torch.from_numpy(out.reshape(host.shape))


@dataclass(frozen=True)
class Distribution:
    """Unnormalised probabilities over part of a vocabulary: `weights[i]` for token `ids[i]`
    (ids None: every token, in order). The most likely token weighs exactly 1. `block_sums`:
    the weights' sums per BLOCK (float64), when the pass that made them summed them too."""

    weights: np.ndarray
    ids: np.ndarray | None
    block_sums: np.ndarray | None = None
    # top-p not applied to the weights: a token is kept if top_p_keeps (a draw by rejection;
    # over the whole vocabulary only)
    owed_top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.owed_top_p < 1.0 and self.ids is not None:
            raise ValueError("top-p is owed only over the whole vocabulary")

    def dense(self, vocab: int) -> np.ndarray:
        """Every token's probability, renormalised, float32."""
        weights = self.weights
        if self.owed_top_p < 1.0:
            weights = weights.copy()
            sums = None if self.block_sums is None else self.block_sums.copy()
            apply_top_p(weights, self.owed_top_p, sums)
        probs: np.ndarray = (weights / weights.sum(dtype=np.float64)).astype(np.float32)
        if self.ids is None:
            return probs
        out = np.zeros(vocab, np.float32)
        out[self.ids] = probs
        return out

    def mass(self) -> float:
        """The weights' sum (from the block sums where known: a float64 sum of 262,144 float32
        weights took 0.12 ms, cold)."""
        if self.block_sums is not None:
            return float(self.block_sums.sum())
        return float(self.weights.sum(dtype=np.float64))

    def kept(self, ids: np.ndarray) -> int:
        """How many of these token ids survive the filters."""
        if self.owed_top_p < 1.0:
            return self._kept_by_top_p(ids)
        if self.ids is None:
            return int(np.count_nonzero(self.weights[ids] > 0))
        inside = np.isin(self.ids, ids)
        return int(np.count_nonzero(self.weights[inside] > 0))

    def token(self, index: int) -> int:
        """The token id of weights[index]."""
        return index if self.ids is None else int(self.ids[index])

    def _kept_by_top_p(self, ids: np.ndarray) -> int:
        """How many of `ids` (indices into every token's weights) the owed top-p keeps: a
        prefix of them in order of weight (equal weights by id), its end found by bisection,
        the last first (one check where all are kept, as top-p 0.95 keeps a view's few)."""
        ranked = ids[np.lexsort((ids, -self.weights[ids]))]
        sums = _block_sums(self.weights) if self.block_sums is None else self.block_sums
        low, high = 0, ranked.size  # ranked[:low] kept, ranked[high:] dropped
        probe = high - 1
        while low < high:
            if top_p_keeps(self.weights, int(ranked[probe]), self.owed_top_p, sums):
                low = probe + 1
            else:
                high = probe
            probe = (low + high) // 2
        return low


def distribution(logits: np.ndarray, params: SamplingParams,
                 top: float | None = None) -> Distribution:
    """The distribution a sampled token is drawn from (1-D float logits; top: their maximum if
    known). A few passes over the vocabulary, no sort of it: top-k keeps only its head, the
    rest weigh exp((logit - max) / T) (shifting by the max first: a tiny temperature cannot
    overflow a finite logit to inf)."""
    top = maximum(logits) if top is None else top
    ids = top_k_ids(logits, params.top_k) if 0 < params.top_k < logits.size else None
    chosen = logits if ids is None else logits[ids]
    weights, sums = exp_weights(chosen, top, params.temperature)
    # masks multiply: a boolean assignment took 0.8 ms over 262,144 weights, this 0.04 ms
    if params.top_p < 1.0:
        apply_top_p(weights, params.top_p, sums)
    if params.min_p > 0.0:  # relative to the most likely token's weight, 1
        np.multiply(weights, weights >= params.min_p, out=weights)
        sums = None
    return Distribution(weights, ids, sums)


def apply_top_p(weights: np.ndarray, top_p: float, sums: np.ndarray | None) -> None:
    """Zero in place what top-p drops: the native pass's weights cut with their block sums
    kept up to date, others through beyond_top_p's mask."""
    if sums is not None:
        cut_top_p(weights, top_p, sums)
    else:
        np.multiply(weights, ~beyond_top_p(weights, top_p), out=weights)


def weights_kernel() -> str:
    """What computes the sampling weights here: 'native-<instruction set>' or 'numpy'."""
    return f"native-{_weights.level()}" if native_weights and native_exp else "numpy"


def _native_reads(array: np.ndarray) -> bool:
    """Whether the native pass takes this array as it is (C-contiguous float32)."""
    return native_weights and array.dtype == np.float32 and array.flags.c_contiguous


def exp_weights(logits: np.ndarray, top: float,
                temperature: float) -> tuple[np.ndarray, np.ndarray | None]:
    """exp((logits - top) / T) as float32, and their sums per BLOCK where the native pass
    (one pass: ~60 us over 262,144 cold logits, against numpy's ~190 us in four) made them.
    Shifting by the maximum first: a tiny temperature cannot overflow a finite logit to inf."""
    if native_exp and _native_reads(logits) and temperature >= _NATIVE_MIN_TEMPERATURE:
        weights = np.empty_like(logits)
        sums = np.empty(-(-logits.size // BLOCK), np.float64)
        _weights.exp_weights(logits, top, 1.0 / temperature, weights, sums, BLOCK)
        return weights, sums
    with np.errstate(over="ignore"):  # a logit far below the top overflows to -inf: weight 0
        weights = np.subtract(logits, top, dtype=np.float32)
        np.divide(weights, temperature, out=weights)
    np.exp(weights, out=weights)
    return weights, None


def top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest logits and of any tied with the k-th, ascending. The native
    pass (k up to NATIVE_TOP_K) reads only the chunks that could enter the head; numpy's: a
    threshold from a strided sample finds a few times k candidates in one pass, only they are
    partitioned (np.argpartition over 262,144 logits took 0.3 ms)."""
    n = logits.size
    if k <= NATIVE_TOP_K and _native_reads(logits):
        ids = np.empty(k + TIES_ROOM, np.int64)
        count = _weights.top_k(logits, k, ids)
        if count > ids.size:  # many tied with the k-th: once more, with room for them all
            ids = np.empty(count, np.int64)
            count = _weights.top_k(logits, k, ids)
        return ids[:count]
    stride = max(1, n // SAMPLE_SIZE)
    sample = np.sort(logits[::stride])[::-1]
    threshold = sample[min(sample.size - 1, k // stride + 2)]
    candidates = np.flatnonzero(logits >= threshold)
    if candidates.size < k:  # the sample misled: the whole vocabulary is a candidate
        candidates = np.arange(n)
    values = logits[candidates]
    kth = np.partition(values, values.size - k)[values.size - k]
    head: np.ndarray = candidates[values >= kth]
    return head


def beyond_top_p(weights: np.ndarray, top_p: float) -> np.ndarray:
    """Where top-p drops a token: it keeps the smallest set, in order of weight (equal weights
    by token id), whose mass reaches top_p of the whole; a token goes if the mass before it
    already does, so the most likely token always stays. The weight where the set ends is
    found by a selection by mass (no sort of the vocabulary, no cumulative sum over it)."""
    target = top_p * float(weights.sum(dtype=np.float64))
    last, above = weight_reaching(weights, target)
    drop = weights < last
    ties = np.flatnonzero(weights == last)
    # the i-th tie (from 0, by id) stays while the mass before it, above + i * last, is short
    stay = min(ties.size, max(1, math.ceil((target - above) / last)))
    drop[ties[stay:]] = True
    return drop


def cut_top_p(weights: np.ndarray, top_p: float, sums: np.ndarray) -> None:
    """What beyond_top_p drops, zeroed in place by the native pass, `sums` (the weights' block
    sums) kept up to date: one selection and one pass, no masks."""
    target = top_p * float(sums.sum())
    last, above = weight_reaching(weights, target)
    stay = min(weights.size, max(1, math.ceil((target - above) / last)))
    _weights.cut(weights, last, stay, sums, BLOCK)


def weight_reaching(weights: np.ndarray, target: float) -> tuple[float, float]:
    """The largest weight w such that the tokens weighing w or more hold `target` (0 < target
    <= the total), and the mass of the tokens heavier than w. Each round brackets the crossing
    between two weights from a sample of the pool and keeps the part the target is crossed in
    (the mass above it counted); a small pool is sorted. (np.compress, not a boolean index:
    5x faster here.) The native pass selects by the weights' bits instead, in three passes."""
    if _native_reads(weights):
        return _weights.reaching(weights, target)
    above = 0.0  # the mass of the tokens heavier than the pool
    pool = weights
    at_median = False
    while pool.size > SAMPLE_SIZE:
        low, high = _median_bracket(pool) if at_median else _bracket(pool, target - above)
        heavy = np.compress(pool > high, pool)
        heavy_mass = float(heavy.sum(dtype=np.float64))
        if above + heavy_mass >= target:
            rest = heavy
        else:
            above += heavy_mass
            band = np.compress((pool >= low) & (pool <= high), pool)
            band_mass = float(band.sum(dtype=np.float64))
            if above + band_mass >= target:
                if low == high:  # the band is one weight, and the set ends at it
                    return float(low), above
                rest = band
            else:
                above += band_mass
                rest = np.compress(pool < low, pool)
                if rest.size == 0:  # rounding: even the whole pool falls short; it ends at
                    return float(low), above - float(band[band == low].sum(dtype=np.float64))
        # a part as large as the pool (a misleading sample): split at the median next round
        at_median = rest.size > pool.size * 3 // 4
        pool = rest
    descending = np.sort(pool)[::-1]
    cumulative = np.cumsum(descending, dtype=np.float64)
    end = min(int(np.searchsorted(above + cumulative, target)), pool.size - 1)
    last = float(descending[end])
    return last, above + float(descending[descending > last].sum(dtype=np.float64))


def _bracket(pool: np.ndarray, target: float) -> tuple[float, float]:
    """Two of the pool's weights a sample puts the crossing between; the sample's heaviest
    twice when the sample holds too little mass (the heavy tokens are few, outside it)."""
    stride = pool.size // SAMPLE_SIZE + 1
    sample = np.sort(pool[::stride])[::-1]
    estimate = np.cumsum(sample, dtype=np.float64) * stride
    if estimate[-1] < target:
        return float(sample[0]), float(sample[0])
    crossing = int(np.searchsorted(estimate, target))
    return (float(sample[min(crossing + BRACKET, sample.size - 1)]),
            float(sample[max(crossing - BRACKET, 0)]))


def _median_bracket(pool: np.ndarray) -> tuple[float, float]:
    median = float(np.partition(pool, pool.size // 2)[pool.size // 2])
    return median, median


def check_logits(logits: torch.Tensor) -> float:
    """Refuse logits no token can be honestly drawn from (a numerical fault upstream); their
    maximum. One pass: the maximum is NaN if any logit is, +inf if one overflowed, -inf if
    all are."""
    return _checked(maximum(host_array(logits)))


def maximum(logits: np.ndarray) -> float:
    """The largest logit, NaN if any is: one native pass where it reads them as they are."""
    return _weights.top(logits) if _native_reads(logits) else float(logits.max())


def _checked(top: float) -> float:
    if math.isnan(top):
        raise SamplingError("the model produced NaN logits; cannot pick a token")
    if top == math.inf:
        raise SamplingError("the model produced infinite logits (a numerical overflow); "
                            "cannot pick a token")
    if top == -math.inf:
        raise SamplingError("every token has probability 0 (all logits are -inf)")
    return top


def draw(probs: torch.Tensor, generator: Generator | None) -> int:
    """One token from a 1-D distribution (not necessarily normalised): the first whose
    cumulative probability passes one uniform draw scaled to the total. A token of probability
    0 is never drawn. (torch.multinomial draws an exponential per token: 7 ms on a
    262,144-token vocabulary.)"""
    return pick(host_array(probs), uniform(generator))


def uniform(generator: Generator | None) -> float:
    """One number in [0, 1) from the request's generator (float64)."""
    return generator.random() if generator is not None else float(_UNSEEDED.random())


def pick(weights: np.ndarray, u: float, block_sums: np.ndarray | None = None) -> int:
    """The index of the first weight whose cumulative sum passes u times the total; never a
    weight of 0. A long vector is summed in blocks first (`block_sums` if the weights' maker
    summed them; numpy's are float32 sums: a block's sum is off by ~1e-7 of itself, which moves
    where the blocks meet by far less than a token's weight) and only the block the draw lands
    in is accumulated, in float64 (a float64 cumulative sum of 262,144 weights took 0.3-1.6 ms,
    the block sums 0.04-0.1 ms). The native walk is the same, in one call."""
    if weights.size <= 4 * BLOCK:
        return _first_past(weights, u * float(weights.sum(dtype=np.float64)))
    sums = _block_sums(weights) if block_sums is None else block_sums
    if _native_reads(weights):
        return _weights.pick(weights, sums, u, BLOCK)
    ends = np.cumsum(sums)
    target = u * float(ends[-1])  # below the last end (u < 1): the draw lands in a block
    block = int(np.searchsorted(ends, target, side="right"))
    before = float(ends[block - 1]) if block else 0.0
    start = block * BLOCK
    return start + _first_past(weights[start:start + BLOCK], target - before)


def _block_sums(weights: np.ndarray) -> np.ndarray:
    whole = weights.size // BLOCK * BLOCK
    sums: np.ndarray = weights[:whole].reshape(-1, BLOCK).sum(axis=1).astype(np.float64)
    if whole < weights.size:
        sums = np.append(sums, weights[whole:].sum(dtype=np.float64))
    return sums


def _first_past(weights: np.ndarray, target: float) -> int:
    cumulative = np.cumsum(weights, dtype=np.float64)
    index = int(np.searchsorted(cumulative, target, side="right"))
    if index >= weights.size:  # rounding: the last token with mass
        index = int(np.flatnonzero(weights)[-1])
    return index


@dataclass(frozen=True)
class Draw:
    """A token picked, the logits it was picked from (after the penalty) and, when sampled,
    the distribution it was drawn from: what a snapshot of the sampler shows, not computed
    twice."""

    token: int
    logits: torch.Tensor
    chosen: Distribution | None  # None: greedy


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: Generator | None,
    previous_ids: Sequence[int] = (),
) -> Draw:
    """Pick the next token from a 1-D logits vector."""
    if params.repetition_penalty != 1.0 and previous_ids:
        check_logits(logits)
        logits = apply_repetition_penalty(logits, previous_ids, params.repetition_penalty)
    if params.greedy:  # an extreme penalty can overflow a logit: checked after it
        return Draw(greedy_token(logits), logits, None)
    host = host_array(logits)
    if one_call(params, host):
        return _drawn_in_one_call(logits, host, params, generator)
    top = _checked(maximum(host))
    if by_rejection(params, host.size):
        whole, index = top_p_by_rejection(host, params, top, generator)
        return Draw(index, logits, whole)
    chosen = distribution(host, params, top)
    index = pick(chosen.weights, uniform(generator), chosen.block_sums)
    return Draw(chosen.token(index), logits, chosen)


def by_rejection(params: SamplingParams, vocab: int) -> bool:
    """Whether a top-p draw skips the cut: top-p alone (no top-k, no min-p, which could keep
    little of the mass) on a long vocabulary, keeping at least REJECTION_MIN_TOP_P of the mass
    (so at most 1 / that many draws on average)."""
    return (REJECTION_MIN_TOP_P <= params.top_p < 1.0 and params.top_k == 0
            and params.min_p == 0.0 and vocab > 4 * BLOCK)


def unfiltered(params: SamplingParams) -> bool:
    """Whether no top-k, top-p or min-p filters the distribution."""
    return (params.top_k, params.top_p, params.min_p) == (0, 1.0, 0.0)


def one_call(params: SamplingParams, host: np.ndarray) -> bool:
    """Whether the native pass makes a sampled draw in one call (_drawn_in_one_call): top-p by
    rejection, or the plain distribution over a vocabulary long enough that pick walks its
    block sums; logits the pass reads as they are."""
    if not (native_exp and _native_reads(host)
            and params.temperature >= _NATIVE_MIN_TEMPERATURE):
        return False
    return by_rejection(params, host.size) or (unfiltered(params) and host.size > 4 * BLOCK)


def _drawn_in_one_call(logits: torch.Tensor, host: np.ndarray, params: SamplingParams,
                       generator: Generator | None) -> Draw:
    """What maximum, exp_weights, pick and top_p_keeps make, the same token from the same
    numbers, in one native call (each call from Python cost 5-15 us right after a decode
    step); a try top-p drops goes on as top_p_by_rejection's next."""
    weights = np.empty_like(host)
    sums = np.empty(-(-host.size // BLOCK), np.float64)
    top, index, kept = _weights.draw(host, 1.0 / params.temperature, params.top_p,
                                     uniform(generator), weights, sums, BLOCK)
    top = _checked(top)
    whole = Distribution(weights, None, sums, owed_top_p=params.top_p)
    if not kept:
        index = _draw_kept(whole, host, params, top, generator, MAX_REJECTIONS - 1)
    return Draw(index, logits, whole)


def top_p_by_rejection(logits: np.ndarray, params: SamplingParams, top: float,
                       generator: Generator | None) -> tuple[Distribution, int]:
    """A token drawn from the whole distribution, kept if top-p keeps it, else drawn again: the
    kept tokens' distribution exactly, as the cut's draw, without the cut's selection (~0.4 ms
    on a flat 262,144-token distribution; a token's check reads until its verdict is sure:
    ~7 us on the median draw, a pass ~45 us near the edge). Each try takes the next number of
    the generator. Returns the whole distribution, top-p owed, and the token."""
    weights, sums = exp_weights(logits, top, params.temperature)
    whole = Distribution(weights, None, sums, owed_top_p=params.top_p)
    return whole, _draw_kept(whole, logits, params, top, generator, MAX_REJECTIONS)


def _draw_kept(whole: Distribution, logits: np.ndarray, params: SamplingParams, top: float,
               generator: Generator | None, tries: int) -> int:
    """Up to `tries` draws from the whole distribution until top-p keeps one; then the cut's."""
    weights = whole.weights
    blocks = _block_sums(weights) if whole.block_sums is None else whole.block_sums
    for _ in range(tries):  # numpy's block sums: made once, not every try
        index = pick(weights, uniform(generator), blocks)
        if top_p_keeps(weights, index, params.top_p, blocks):
            return index
    cut = distribution(logits, params, top)  # rounding has left next to nothing kept
    return pick(cut.weights, uniform(generator), cut.block_sums)


def top_p_keeps(weights: np.ndarray, index: int, top_p: float, block_sums: np.ndarray) -> bool:
    """Whether top-p keeps weights[index] (beyond_top_p's rule): the mass before it, in order
    of weight (equal weights by token id), is short of top_p of the whole (`block_sums`: the
    weights' sums per BLOCK). The native pass reads block by block and stops once the verdict
    is sure."""
    if _native_reads(weights):
        return bool(_weights.keeps(weights, index, block_sums, BLOCK, top_p))
    weight = weights[index]
    above = float(np.compress(weights > weight, weights).sum(dtype=np.float64))
    ties = int(np.count_nonzero(weights[:index] == weight))
    return above + ties * float(weight) < top_p * float(block_sums.sum())


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: Generator | None,
    previous_ids: Sequence[int] = (),
) -> int:
    """Pick the next token id from a 1-D logits vector."""
    return sample(logits, params, generator, previous_ids).token


def greedy_token(logits: torch.Tensor) -> int:
    """The first of the most likely tokens, in one pass that also checks the logits (numpy's
    and torch's argmax both stop at a NaN). Logits elsewhere than in host memory stay there:
    only the token id comes back."""
    host = _host_view(logits)
    if host is not None:
        token = int(host.argmax())
        _checked(float(host[token]))
    else:
        token = int(torch.argmax(logits))
        _checked(float(logits[token]))
    return token


def _in_place(tensor: torch.Tensor) -> bool:
    """Whether numpy can read the tensor's own memory. (is_cpu: `device.type` builds a device
    object, ~5 us after a decode step.)"""
    return tensor.is_cpu and tensor.dtype in (torch.float32, torch.float64)


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """The tensor as a numpy array on the host: a view (no copy) of a float32 or float64 tensor
    in host memory, else one float32 copy (bf16, half precision, a GPU's memory). numpy scans a
    vocabulary 4-7x faster than torch here (262,144 floats: argmax 33 us against 223 us); both
    return the first of equal maxima. A view a runtime registered: its own array (torch's
    conversion is slow right after a decode step: host_logits)."""
    view = _host_view(tensor)
    return view if view is not None else tensor.detach().float().cpu().numpy()


def _host_view(tensor: torch.Tensor) -> np.ndarray | None:
    """The tensor's own memory as a numpy array (a registered view's array first), or None
    where numpy cannot read it in place."""
    registered = host_logits.array(tensor)
    if registered is not None:
        return registered
    return tensor.numpy(force=tensor.requires_grad) if _in_place(tensor) else None


def sampler_view(
    logits: torch.Tensor, params: SamplingParams, k: int = 12,
    chosen: Distribution | None = None,
) -> tuple[list[tuple[int, float]], int]:
    """Top-k candidates with probabilities after temperature, and how many survive filtering
    (by `chosen`, the distribution a token was drawn from these logits with, if given: on a
    flat 262,144-token distribution, top-p's selection is most of a view's time).

    For greedy decoding the probabilities are the plain softmax and only the argmax survives.
    """
    host = host_array(logits)
    k = min(k, host.size)
    temperature = params.temperature if params.temperature > 0 else 1.0
    # a draw without filters, or by rejection (top-p owed), was made from the plain
    # distribution itself
    plain = (chosen if chosen is not None and (unfiltered(params) or chosen.owed_top_p < 1.0)
             else distribution(host, SamplingParams(temperature=temperature)))
    head = top_k_ids(host, k)
    head = head[np.argsort(-plain.weights[head], kind="stable")][:k]
    probs = plain.weights[head] / plain.mass()
    if chosen is None and not params.greedy:
        chosen = distribution(host, params)
    kept = 1 if chosen is None else chosen.kept(head)
    return [(int(i), float(p)) for i, p in zip(head, probs, strict=True)], kept
