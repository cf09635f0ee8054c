"""Quality guard and speculative decoding on the real default model (SmolLM2-135M)."""

from __future__ import annotations

import pytest

from engine.core.chat_template import encode_chat_with_spans
from engine.params import ChatMessage
from engine.runtimes.torch.kernels import apply_kernel, select_kernel
from engine.runtimes.torch.loader import LoadedModel, load_model
from engine.runtimes.torch.quality import (
    greedy_continuation,
    perplexity,
    reference_ids,
    within_tolerance,
)
from engine.runtimes.torch.runtime import TorchRuntime
from engine.tools.bench import run_ours

pytestmark = pytest.mark.real_model
GUARD_TOKENS = 32
PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
)
INT8_REASON = (
    "torch.ao dynamic int8 quantizes activations per tensor (7-bit on x86): perplexity "
    "+10% decoding token by token and +190% over a whole prompt on SmolLM2, so the guard "
    "rejects it and auto never picks it here"
)


@pytest.fixture(scope="module")
def reference() -> LoadedModel:
    return load_model("default")


@pytest.fixture(scope="module")
def prompt_ids(reference: LoadedModel) -> list[list[int]]:
    return [encode_chat_with_spans(reference.tokenizer, [ChatMessage("user", p)])[0]
            for p in PROMPTS]


@pytest.fixture(scope="module")
def fp32_greedy(reference: LoadedModel, prompt_ids: list[list[int]]) -> list[list[int]]:
    return [greedy_continuation(reference.model, ids, GUARD_TOKENS) for ids in prompt_ids]


def passes_guard(fast: LoadedModel, reference: LoadedModel, prompt_ids: list[list[int]],
                 fp32_greedy: list[list[int]]) -> tuple[bool, str]:
    """Greedy output equal to fp32 for GUARD_TOKENS tokens on every prompt, or perplexity
    on the reference text within 2% of fp32."""
    same = [greedy_continuation(fast.model, ids, GUARD_TOKENS) == ref
            for ids, ref in zip(prompt_ids, fp32_greedy, strict=True)]
    text = reference_ids(reference.tokenizer)
    ppl, ref_ppl = perplexity(fast.model, text), perplexity(reference.model, text)
    detail = f"greedy equal per prompt {same}; perplexity {ppl:.3f} vs fp32 {ref_ppl:.3f}"
    return all(same) or within_tolerance(ppl, ref_ppl), detail


@pytest.mark.parametrize(
    "name",
    ["fp16-dynamic",
     # it fails the guard's assertion; anything else (it no longer builds, a crash) is an error
     pytest.param("int8-dynamic", marks=pytest.mark.xfail(reason=INT8_REASON, strict=True,
                                                          raises=AssertionError))],
)
def test_fast_path_quality_guard(reference: LoadedModel, prompt_ids: list[list[int]],
                                 fp32_greedy: list[list[int]], name: str) -> None:
    ok, detail = passes_guard(apply_kernel(reference, name), reference, prompt_ids,
                              fp32_greedy)
    assert ok, f"{name}: {detail}"


def test_auto_choice_passes_the_guard(reference: LoadedModel, prompt_ids: list[list[int]],
                                      fp32_greedy: list[list[int]]) -> None:
    chosen = select_kernel(reference, use_probe_cache=False)
    ok, detail = passes_guard(chosen, reference, prompt_ids, fp32_greedy)
    assert ok, f"{chosen.info.kernel}: {detail}"


@pytest.mark.parametrize("name", ["fp32-eager", "fp16-dynamic"])
def test_speculative_greedy_equals_plain_real(reference: LoadedModel, name: str) -> None:
    """Exact for kernels whose rows do not depend on each other (fp32, fp16 weights)."""
    loaded = apply_kernel(reference, name)
    text = ("Repeat exactly: The quick brown fox jumps over the lazy dog, and the lazy dog "
            "sleeps in the warm afternoon sun.")
    ids = encode_chat_with_spans(reference.tokenizer, [ChatMessage("user", text)])[0]
    plain = run_ours(TorchRuntime(loaded), ids, 48)
    spec = run_ours(TorchRuntime(loaded), ids, 48, speculative="ngram")
    assert spec.token_ids == plain.token_ids
    assert spec.spec_accepted > 0
