"""The static-cache decode step (engine/runtimes/torch/static_decode.py) against the DynamicCache
loop.

Compiled modes take minutes to build on a 2-core CPU, so tests run the step eagerly: the graph
that torch.compile or CUDA graphs would capture is this same step, and its tokens must equal
the dynamic loop's. benchmarks/static_decode.py measures the compiled modes.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.chat_template import encode_chat_with_spans
from engine.params import ChatMessage
from engine.runtimes.torch.loader import LoadedModel, load_model
from engine.runtimes.torch.quality import greedy_continuation
from engine.runtimes.torch.static_decode import StaticDecoder

PROMPTS = ("What is the capital of France? Answer in one sentence.",
           "Write a haiku about the sea.")


@pytest.fixture(scope="module")
def reference() -> LoadedModel:
    return load_model("default")


@pytest.mark.real_model
def test_static_greedy_equals_dynamic_loop_and_survives_reuse(reference: LoadedModel) -> None:
    decoder = StaticDecoder(reference.model, max_len=128)
    for text in PROMPTS * 2:  # the second pass reuses the same preallocated cache
        ids = encode_chat_with_spans(reference.tokenizer, [ChatMessage("user", text)])[0]
        with torch.inference_mode():
            expected = greedy_continuation(reference.model, ids, 24)
        assert decoder.generate(ids, 24).tokens == expected


@pytest.mark.real_model
def test_prompt_that_does_not_fit_the_static_cache_is_refused(reference: LoadedModel) -> None:
    decoder = StaticDecoder(reference.model, max_len=16)
    with pytest.raises(ValueError, match="does not fit 16"):
        decoder.generate(list(range(20)), 4)


@pytest.mark.real_model
def test_unknown_compile_mode_is_refused(reference: LoadedModel) -> None:
    with pytest.raises(ValueError, match="compile mode"):
        StaticDecoder(reference.model, max_len=16, compile_mode="fastest")
