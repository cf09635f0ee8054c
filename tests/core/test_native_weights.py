"""The sampler's native pass (engine/core/_weights.c): built where it can be, and drawing what
numpy's weights draw. (tests/core/test_sampling.py runs every sampler test on both.)"""

import shutil
import sysconfig

import numpy as np
import pytest
import torch

from engine.core import sampling
from engine.core.sampling import make_generator, sample_token, weights_kernel
from engine.params import SamplingParams


def test_the_native_pass_is_built_where_a_c_compiler_is() -> None:
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) here: numpy computes the weights")
    assert sampling.native_weights
    assert weights_kernel() in ("native-avx512", "native-avx2", "native-portable")


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
