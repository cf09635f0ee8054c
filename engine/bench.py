"""Benchmarks shared by `phasewise bench` and benchmarks/: measure, never assert.

Everything runs in the calling thread on one LoadedModel, so our decode loop and the
transformers generate() baseline see the same weights, prompt, dtype and token count.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.events import GenerationResult
from engine.generate import DecodeSession, now_ns, prepare_prompt
from engine.loader import LoadedModel
from engine.metrics import RequestTimeline, percentiles
from engine.params import ChatMessage, GenerationRequest, SamplingParams
from engine.prefix_cache import PrefixCache

PASSAGE = (
    "The history of computing is a story of layers. Each generation of engineers built tools "
    "on top of the last, hiding detail behind cleaner abstractions: vacuum tubes gave way to "
    "transistors, transistors to integrated circuits, and assembly language to compilers that "
    "could reason about whole programs. Memory grew from a few kilobytes of magnetic core to "
    "gigabytes of dynamic RAM, yet the distance between the processor and its data remained "
    "the central problem of performance. Caches, prefetchers and wide vector units all exist "
    "to hide that distance. "
)


def fixed_prompt_ids(loaded: LoadedModel, n_tokens: int) -> list[int]:
    """Exactly n_tokens of a fixed English passage (no chat template), the same every run."""
    tokenizer = loaded.tokenizer
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += tokenizer(PASSAGE, add_special_tokens=False)["input_ids"]
    return ids[:n_tokens]


def run_ours(
    loaded: LoadedModel,
    prompt_ids: list[int],
    max_tokens: int,
    cache: PrefixCache | None = None,
    conversation_id: str | None = None,
    reuse_cache: bool = True,
    speculative: str | None = None,
) -> GenerationResult:
    """One greedy request of exactly max_tokens tokens through the engine's decode loop."""
    pool = cache or PrefixCache(loaded.model.config, budget_bytes=1 << 40)
    request = GenerationRequest(
        messages=[],
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        conversation_id=conversation_id,
        prompt_token_ids=prompt_ids,
        reuse_cache=reuse_cache,
        speculative=speculative,
    )
    timeline = RequestTimeline(submitted_ns=now_ns())
    return DecodeSession(loaded, pool).run(request, timeline, threading.Event(), lambda _e: None)


class _TokenClock:
    """A generate() streamer that stamps each new token (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._seen_prompt = False

    def put(self, _value: torch.Tensor) -> None:
        if self._seen_prompt:
            self.stamps.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass


@dataclass
class HfResult:
    ttft_s: float
    decode_tok_s: float


@torch.inference_mode()
def run_hf(loaded: LoadedModel, prompt_ids: list[int], max_tokens: int) -> HfResult:
    """transformers generate() for exactly max_tokens greedy tokens, timed per token with a
    streamer, so TTFT and decode tok/s follow the same definitions as ours."""
    input_ids = torch.tensor([prompt_ids], device=loaded.device)
    clock = _TokenClock()
    start = time.perf_counter()
    loaded.model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=loaded.tokenizer.eos_token_id,
        streamer=clock,
    )
    stamps = clock.stamps
    decode_s = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return HfResult(
        ttft_s=stamps[0] - start if stamps else 0.0,
        decode_tok_s=(len(stamps) - 1) / decode_s if decode_s > 0 else 0.0,
    )


def bench_decode(
    loaded: LoadedModel,
    *,
    prompt_tokens: int = 128,
    max_tokens: int = 64,
    repeats: int = 3,
    vs_hf: bool = False,
    speculative: bool = False,
    hf_reference: LoadedModel | None = None,
    progress: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """Cold TTFT, prefill tok/s, decode tok/s and ITL percentiles; medians over repeats.

    Runs alternate ours / generate() (/ ours with speculative drafts) so drift in machine load
    hits all alike. generate() runs on hf_reference (the model as loaded, before a fast
    kernel) when given, so the ratio is against stock transformers.
    """
    hf_model = hf_reference or loaded
    prompt_ids = fixed_prompt_ids(loaded, prompt_tokens)
    progress("warm-up")
    run_ours(loaded, prompt_ids[:16], 4)
    if vs_hf:
        run_hf(hf_model, prompt_ids[:16], 4)
    ours: list[GenerationResult] = []
    theirs: list[HfResult] = []
    spec: list[GenerationResult] = []
    for i in range(repeats):
        progress(f"run {i + 1}/{repeats}: phasewise")
        ours.append(run_ours(loaded, prompt_ids, max_tokens))
        if vs_hf:
            progress(f"run {i + 1}/{repeats}: transformers generate()")
            theirs.append(run_hf(hf_model, prompt_ids, max_tokens))
        if speculative:
            progress(f"run {i + 1}/{repeats}: phasewise, speculative (ngram)")
            spec.append(run_ours(loaded, prompt_ids, max_tokens, speculative="ngram"))
    itl = [x for r in ours for x in r.metrics.itl_s]
    itl_p50, itl_p90, itl_p99 = percentiles(itl, (50, 90, 99))
    med = statistics.median
    report: dict[str, Any] = {
        "model": loaded.info.name,
        "device": loaded.info.device,
        "dtype": loaded.info.dtype,
        "kernel": loaded.info.kernel,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "ttft_s": med(r.metrics.ttft_s for r in ours),
        "prefill_s": med(r.metrics.prefill_s for r in ours),
        "prefill_tok_s": med(r.metrics.prefilled_tokens / r.metrics.prefill_s for r in ours),
        "decode_tok_s": med(r.metrics.decode_tok_s for r in ours),
        "itl_p50_s": itl_p50,
        "itl_p90_s": itl_p90,
        "itl_p99_s": itl_p99,
        "achieved_gb_s": med(r.metrics.achieved_gb_s for r in ours),
        "prefill_tflop_s": med(r.metrics.prefill_tflop_s for r in ours),
        "weight_bytes_per_step": loaded.info.weight_bytes_per_step,
        "parameters": loaded.info.parameters,
    }
    if vs_hf:
        report["hf_kernel"] = hf_model.info.kernel
        report["hf_ttft_s"] = med(h.ttft_s for h in theirs)
        report["hf_decode_tok_s"] = med(h.decode_tok_s for h in theirs)
        report["decode_ratio_vs_hf"] = (
            report["decode_tok_s"] / report["hf_decode_tok_s"] if report["hf_decode_tok_s"] else 0.0
        )
    if speculative:
        report.update(speculative_summary(ours, spec))
    return report


def speculative_summary(plain: list[GenerationResult], spec: list[GenerationResult]
                        ) -> dict[str, Any]:
    """Acceptance and speedup of prompt-lookup decoding against plain runs of the same
    prompt; spec_output_identical checks the greedy outputs match token for token."""
    proposed = sum(r.spec_proposed for r in spec)
    accepted = sum(r.spec_accepted for r in spec)
    rate = statistics.median(r.metrics.decode_tok_s for r in spec)
    plain_rate = statistics.median(r.metrics.decode_tok_s for r in plain)
    return {
        "spec_method": "ngram",
        "spec_decode_tok_s": rate,
        "spec_speedup": rate / plain_rate if plain_rate else 0.0,
        "spec_e2e_speedup": (statistics.median(r.metrics.e2e_s for r in plain)
                             / statistics.median(r.metrics.e2e_s for r in spec)),
        "spec_proposed": proposed,
        "spec_accepted": accepted,
        "spec_accept_rate": accepted / proposed if proposed else 0.0,
        "spec_output_identical": all(s.token_ids == plain[0].token_ids for s in spec),
    }


TURN_QUESTIONS = (
    "Summarise the passage above in two sentences.",
    "Which hardware trend does it say matters most for performance, and why?",
    "Explain how caches hide memory latency, with one concrete example.",
    "Write a short numbered list of three layers of abstraction from the passage.",
    "Give a one-paragraph conclusion for a talk about this passage.",
    "Suggest a title for that talk.",
    "Rewrite the title as a question.",
    "Now answer that question in one sentence.",
)


def bench_turns(
    loaded: LoadedModel,
    *,
    turns: int = 4,
    max_tokens: int = 64,
    context_tokens: int = 1100,
    progress: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """A scripted multi-turn chat whose prompt passes ~1,000 tokens by the last turn.

    Each turn reuses the conversation's prefix cache; finally the last turn's whole prompt runs
    on an empty cache, so `cold_ttft_s_last_prompt` is measured in the same process.
    """
    # Small test models have tiny contexts: keep the script inside a third of it.
    context = fixed_text(loaded, min(context_tokens, loaded.info.context_length // 3))
    pool = PrefixCache(loaded.model.config, budget_bytes=1 << 40)
    messages = [ChatMessage("system", "You are a concise assistant."),
                ChatMessage("user", context + "\n\n" + TURN_QUESTIONS[0])]

    run_ours(loaded, fixed_prompt_ids(loaded, 16), 4)  # warm-up, outside the pool
    rows: list[dict[str, Any]] = []
    last_prompt: list[int] = []
    for turn in range(turns):
        progress(f"turn {turn + 1}/{turns}")
        request = GenerationRequest(
            messages=list(messages),
            params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
            conversation_id="bench-turns",
        )
        last_prompt = prepare_prompt(loaded, request).ids
        timeline = RequestTimeline(submitted_ns=now_ns())
        result = DecodeSession(loaded, pool).run(request, timeline, threading.Event(),
                                                  lambda _e: None)
        m = result.metrics
        rows.append({
            "turn": turn + 1,
            "prompt_tokens": m.prompt_tokens,
            "cached_tokens": m.cached_tokens,
            "cached_share": m.cached_tokens / m.prompt_tokens,
            "prefill_s": m.prefill_s,
            "ttft_s": m.ttft_s,
            "decode_tok_s": m.decode_tok_s,
            "output_tokens": m.output_tokens,
            "cache_miss_reason": m.cache_miss_reason,
        })
        messages.append(ChatMessage("assistant", result.text))
        messages.append(ChatMessage("user", TURN_QUESTIONS[(turn + 1) % len(TURN_QUESTIONS)]))
    progress("cold run of the last prompt")
    cold = run_ours(loaded, last_prompt, 1, cache=pool, reuse_cache=False)
    cold_ttft = cold.metrics.ttft_s
    return {
        "model": loaded.info.name,
        "device": loaded.info.device,
        "turns": rows,
        "cold_ttft_s_last_prompt": cold_ttft,
        "last_ttft_over_cold": rows[-1]["ttft_s"] / cold_ttft if cold_ttft else 0.0,
        "cached_share_from_turn_2": (
            sum(r["cached_tokens"] for r in rows[1:]) / sum(r["prompt_tokens"] for r in rows[1:])
            if len(rows) > 1 else 0.0
        ),
        "cache_bytes": pool.used_bytes,
        "cache_budget_bytes": pool.budget_bytes,
    }


def fixed_text(loaded: LoadedModel, n_tokens: int) -> str:
    return loaded.tokenizer.decode(fixed_prompt_ids(loaded, n_tokens))


@torch.inference_mode()
def bench_batch(
    loaded: LoadedModel,
    *,
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8),
    prompt_tokens: int = 64,
    max_tokens: int = 32,
    rounds: int = 2,
    progress: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """Decode B requests in one batch per step: per-token latency and total throughput.

    Each request is a different window of the fixed passage, all of one length (no padding).
    Batch sizes alternate round by round; each step's time is the median over the rounds.
    """
    from transformers import DynamicCache

    stride = 7
    source = fixed_prompt_ids(loaded, prompt_tokens + stride * max(batch_sizes))
    step_s: dict[int, list[float]] = {b: [] for b in batch_sizes}
    for r in range(rounds):
        for b in batch_sizes:
            progress(f"round {r + 1}/{rounds}: batch {b}")
            prompts = [source[i * stride : i * stride + prompt_tokens] for i in range(b)]
            cache = DynamicCache(config=loaded.model.config)
            logits = loaded.model(input_ids=torch.tensor(prompts, device=loaded.device),
                                  cache=cache, use_cache=True, logits_to_keep=1).logits
            for _ in range(max_tokens - 1):
                step = logits[:, -1].argmax(-1, keepdim=True)
                start = time.perf_counter()
                logits = loaded.model(input_ids=step, cache=cache, use_cache=True,
                                      logits_to_keep=1).logits
                logits[:, -1].argmax(-1).tolist()  # the tokens reach the host, as in serving
                step_s[b].append(time.perf_counter() - start)
    base = statistics.median(step_s[batch_sizes[0]]) / batch_sizes[0]
    rows = []
    for b in batch_sizes:
        step = statistics.median(step_s[b])
        rows.append({"batch": b, "per_token_latency_ms": step * 1e3,
                     "total_tok_s": b / step, "throughput_vs_first": base * b / step})
    return {"model": loaded.info.name, "device": loaded.info.device,
            "kernel": loaded.info.kernel, "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens, "rounds": rounds, "batches": rows}
