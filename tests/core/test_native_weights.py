"""The sampler's native pass (engine/core/_weights.c): built where it can be, and drawing what
numpy's weights draw. (tests/core/test_sampling.py runs every sampler test on both.)"""

import contextlib
import shutil
import sysconfig
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest
import torch

from engine.core import sampling
from engine.core.sampling import make_generator, sample_token, weights_kernel
from engine.errors import SamplingError
from engine.params import SamplingParams


def test_the_native_pass_is_built_where_a_c_compiler_is() -> None:
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) here: numpy computes the weights")
    assert sampling.native_weights
    if sampling.native_exp:  # an AVX2 or AVX-512 CPU
        assert weights_kernel() in ("native-avx512", "native-avx2")
    else:  # the portable copy: numpy's exponent is faster there, the draw stays native
        assert weights_kernel() == "numpy"


@pytest.mark.skipif(not sampling.native_weights, reason="engine/core/_weights.c not compiled")
def test_seeded_draws_on_a_large_vocabulary_are_the_same_on_both_kernels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's usual shape (a few likely tokens, a long tail): a seed draws the same tokens
    whichever kernel computed the weights (they differ by float rounding only), plain and with
    top-p."""
    rng = np.random.default_rng(2)
    logits = torch.from_numpy(rng.standard_normal(262_144).astype(np.float32))
    logits[[5, 70_000, 200_001]] = torch.tensor([14.0, 13.0, 12.5])
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_p=0.9)):
        native = [sample_token(logits, params, make_generator(seed)) for seed in range(60)]
        with monkeypatch.context() as numpy_only:
            numpy_only.setattr(sampling, "native_weights", False)
            assert native == [sample_token(logits, params, make_generator(seed))
                              for seed in range(60)]
        assert {5, 70_000, 200_001} <= set(native)


@pytest.mark.skipif(not sampling.native_exp, reason="no vector copy of engine/core/_weights.c")
def test_a_draw_in_one_native_call_is_the_draw_of_its_pieces(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled draw (plain, or top-p by rejection) in one native call draws the token its
    pieces (maximum, weights, pick, top-p's check) draw from the same numbers: on a flat
    distribution top-p 0.5 drops about half the first tries, which go on drawing from the
    generator as before; logits no token can be drawn from are refused as before."""
    rng = np.random.default_rng(3)
    flat = torch.from_numpy(rng.standard_normal(262_144).astype(np.float32))
    peaked = flat.clone()
    peaked[[5, 70_000]] = torch.tensor([12.0, 11.0])
    cases = [(flat, SamplingParams(temperature=0.7, top_p=0.5)),
             (flat, SamplingParams(temperature=1.3)),
             (peaked, SamplingParams(temperature=0.8, top_p=0.95))]
    for logits, params in cases:
        assert sampling.one_call(params, logits.numpy())
        together = [sampling.sample(logits, params, make_generator(seed)) for seed in range(40)]
        with monkeypatch.context() as in_pieces:
            in_pieces.setattr(sampling, "one_call", lambda params, host: False)
            apart = [sampling.sample(logits, params, make_generator(seed)) for seed in range(40)]
        assert [d.token for d in together] == [d.token for d in apart]
        for one, other in zip(together, apart, strict=True):
            assert one.chosen is not None and other.chosen is not None
            assert np.array_equal(one.chosen.weights, other.chosen.weights)
            assert np.array_equal(one.chosen.block_sums, other.chosen.block_sums)
            assert one.chosen.owed_top_p == other.chosen.owed_top_p == params.top_p
    faulty = flat.clone()
    faulty[100_000] = float("nan")
    with pytest.raises(SamplingError, match="NaN"):
        sampling.sample(faulty, SamplingParams(temperature=0.7, top_p=0.9), make_generator(1))
    with pytest.raises(SamplingError, match="every token"):
        sampling.sample(torch.full((262_144,), float("-inf")), SamplingParams(temperature=0.7),
                        make_generator(1))
    from engine.core import _weights

    with pytest.raises(ValueError, match="of one length"):  # out shorter than the logits
        _weights.draw(flat.numpy(), 1.0, 1.0, 0.5, np.empty(4096, np.float32),
                      np.empty(256), 1024)


@contextlib.contextmanager
def running_level(level: str) -> Iterator[ModuleType]:
    """The native module running one instruction-set copy (skipped where this CPU or build
    has none), the best copy restored after."""
    from engine.core import _weights

    best = _weights.level()
    try:
        if not _weights.use(level):
            pytest.skip(f"this CPU does not run the {level} copy")
    except ValueError:
        pytest.skip(f"no {level} copy in this build (another architecture)")
    try:
        yield _weights
    finally:
        assert _weights.use(best)


@pytest.mark.skipif(not sampling.native_weights, reason="engine/core/_weights.c not compiled")
@pytest.mark.parametrize("level", ["avx512", "avx2", "portable"])
def test_every_copy_this_cpu_runs_makes_numpys_weights(level: str) -> None:
    """Each instruction-set copy of the pass (the import picks the best this CPU runs; the
    others are tested here where the CPU runs them): numpy's weights within float32 rounding,
    the top exactly 1, a masked token 0, float64-close block sums."""
    rng = np.random.default_rng(6)
    logits = (rng.standard_normal(3 * 1024 + 5) * 5).astype(np.float32)
    logits[17] = -np.inf
    top = float(logits.max())
    weights, sums = np.empty_like(logits), np.empty(4)
    with running_level(level) as native:
        native.exp_weights(logits, top, 1 / 0.6, weights, sums, 1024)
    expected = np.exp((logits.astype(np.float64) - top) / 0.6)
    assert weights[int(logits.argmax())] == 1.0 and weights[17] == 0.0
    assert np.allclose(weights, expected, rtol=2e-5, atol=1.7e-38)
    assert np.allclose(sums, [weights[i:i + 1024].sum(dtype=np.float64)
                              for i in range(0, weights.size, 1024)], rtol=1e-6, atol=0)


@pytest.mark.skipif(not sampling.native_weights, reason="engine/core/_weights.c not compiled")
@pytest.mark.parametrize("level", ["avx512", "avx2", "portable"])
def test_every_copy_this_cpu_runs_an_exponent_within_two_float_steps(level: str) -> None:
    """The pass's own exponent (a degree-5 polynomial after Cephes' reduction): within 2.5e-7
    of exp, relatively (about 2 steps of float32's 1.2e-7), over the whole range a weight
    keeps, the top token's exactly 1."""
    rng = np.random.default_rng(12)
    shifted = np.concatenate([-rng.random(1 << 20) * 87, -rng.random(1 << 18) * 2,
                              np.linspace(-87, 0, 100_001), [0.0]]).astype(np.float32)
    weights = np.empty_like(shifted)
    sums = np.empty(-(-shifted.size // 1024))
    with running_level(level) as native:
        native.exp_weights(shifted, 0.0, 1.0, weights, sums, 1024)
    exact = np.exp(shifted.astype(np.float64))
    assert np.abs(weights / exact - 1).max() < 2.5e-7
    assert weights[-1] == 1.0


@pytest.mark.skipif(not sampling.native_weights, reason="engine/core/_weights.c not compiled")
@pytest.mark.parametrize("level", ["avx512", "avx2", "portable"])
def test_every_copy_this_cpu_runs_finds_numpys_maximum(level: str) -> None:
    """The native maximum (what a draw shifts the logits by, and checks) on every copy: numpy's
    on any length, NaN wherever a NaN sits (the vector part or the tail after it), +inf for an
    overflow, -inf when every token is masked."""
    rng = np.random.default_rng(8)
    with running_level(level) as native:
        for size in (1, 15, 16, 17, 1000, 262_144):
            logits = (rng.standard_normal(size) * 4).astype(np.float32)
            assert native.top(logits) == float(logits.max())
            for where in {0, size // 2, size - 1}:
                faulty = logits.copy()
                faulty[where] = np.nan
                assert np.isnan(native.top(faulty))
                faulty[where] = np.inf
                assert native.top(faulty) == np.inf
            assert native.top(np.full(size, -np.inf, np.float32)) == -np.inf
        with pytest.raises(ValueError, match="float32"):
            native.top(np.zeros(4))  # float64


@pytest.mark.skipif(not sampling.native_weights, reason="engine/core/_weights.c not compiled")
@pytest.mark.parametrize("level", ["avx512", "avx2", "portable"])
def test_every_copy_this_cpu_runs_finds_numpys_top_k(level: str) -> None:
    """The native top-k (the sampler view's head, top-k sampling) on every copy: the ids of the
    logits at or above numpy's k-th largest, in order, whatever their order (ascending: every
    chunk enters the head; descending: only the first), a chunk's worth of ties with the k-th,
    a short last chunk, and all k (k = the size); as many as fit written, how many returned;
    NaN never in the head."""
    rng = np.random.default_rng(9)
    flat = rng.standard_normal(50_003).astype(np.float32)
    cases = [flat, np.sort(flat), np.sort(flat)[::-1].copy(), np.round(flat, 1),
             np.full(300, 2.0, np.float32), rng.standard_normal(7).astype(np.float32)]
    with running_level(level) as native:
        for logits in cases:
            for k in sorted(k for k in {1, 12, 40, 256, logits.size} if k <= min(256, logits.size)):
                kth = np.sort(logits)[::-1][k - 1]
                expected = np.flatnonzero(logits >= kth)
                ids = np.empty(expected.size + 3, np.int64)
                assert native.top_k(logits, k, ids) == expected.size
                assert np.array_equal(ids[:expected.size], expected)
                few = np.empty(1, np.int64)
                assert native.top_k(logits, k, few) == expected.size
                assert few[0] == expected[0]
        with_nan = flat.copy()
        with_nan[[0, 5, 49_000]] = np.nan
        ids = np.empty(12, np.int64)
        assert native.top_k(with_nan, 12, ids) == 12
        assert not np.isnan(with_nan[ids]).any()
        assert np.array_equal(np.sort(with_nan[ids]),
                              np.sort(with_nan[~np.isnan(with_nan)])[-12:])
        with pytest.raises(ValueError, match="1 <= k <= 256"):
            native.top_k(flat, 257, np.empty(300, np.int64))


@pytest.mark.skipif(not sampling.native_weights, reason="engine/core/_weights.c not compiled")
def test_an_unknown_level_is_refused() -> None:
    from engine.core import _weights

    with pytest.raises(ValueError, match="no weights level 'avx1024'"):
        _weights.use("avx1024")
