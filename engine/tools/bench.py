"""Benchmarks shared by `phasewise bench` and benchmarks/: measure, never assert.

Everything runs in the calling thread on one loaded model (a `Runtime`), so our decode loop and
the transformers generate() baseline (torch: the model as loaded) see the same weights, prompt,
dtype and token count; the llama.cpp peer (engine/tools/peers.py) sees the same prompt ids and
token count on the GGUF weights, in a child process: if it crashes, the report says so in one
line and keeps our numbers.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from typing import Any

import torch

from engine.core.batch import batchable
from engine.core.ledger import KvLedger
from engine.core.prompt import prepare_prompt
from engine.core.reply import DetachedJob
from engine.core.runtime import BatchSchedule, Runtime
from engine.core.sampling import weights_kernel
from engine.core.speculative import TokenProposer
from engine.errors import InvalidRequestError
from engine.events import GenerationResult, PrefillProgress
from engine.metrics import RequestTimeline, now_ns, percentiles
from engine.native import NativeCrashError
from engine.params import ChatMessage, GenerationRequest, SamplingParams, Speculative
from engine.runtimes.torch.loader import LoadedModel
from engine.tools.peers import LlamaCppPeer, PeerResult, gguf_for, result_from_stamps

PeerRunner = Callable[[list[int], int], PeerResult]

PASSAGE = (
    "The history of computing is a story of layers. Each generation of engineers built tools "
    "on top of the last, hiding detail behind cleaner abstractions: vacuum tubes gave way to "
    "transistors, transistors to integrated circuits, and assembly language to compilers that "
    "could reason about whole programs. Memory grew from a few kilobytes of magnetic core to "
    "gigabytes of dynamic RAM, yet the distance between the processor and its data remained "
    "the central problem of performance. Caches, prefetchers and wide vector units all exist "
    "to hide that distance. "
)


def fixed_prompt_ids(loaded: Runtime, n_tokens: int) -> list[int]:
    """Exactly n_tokens of a fixed English passage (no chat template), the same every run."""
    tokenizer = loaded.tokenizer
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += tokenizer(PASSAGE, add_special_tokens=False)["input_ids"]
    return ids[:n_tokens]


def run_ours(
    loaded: Runtime,
    prompt_ids: list[int],
    max_tokens: int,
    cache: KvLedger[Any] | None = None,
    conversation_id: str | None = None,
    reuse_cache: bool = True,
    speculative: Speculative | None = None,
    draft: TokenProposer | None = None,
) -> GenerationResult:
    """One greedy request of exactly max_tokens tokens, on the path the engine's worker takes
    for it: the continuous batcher for one that may join a batch (a chat's plain reply), alone
    otherwise (a draft model's)."""
    pool = cache or loaded.new_prefix_cache(budget_bytes=1 << 40)
    request = GenerationRequest(
        messages=[],
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        conversation_id=conversation_id,
        prompt_token_ids=prompt_ids,
        reuse_cache=reuse_cache,
        speculative=speculative,
    )
    timeline = RequestTimeline(submitted_ns=now_ns())
    if decode_path(loaded, request) == "batch":
        return _run_in_batch(loaded, pool, request, timeline)
    session = loaded.new_session(pool, draft)
    result: GenerationResult = session.run(request, timeline, threading.Event(),
                                           lambda _e: None)
    return result


def settle(loaded: Runtime, progress: Callable[[str], None] = lambda _m: None) -> None:
    """The runtime's idle work done (llama.cpp: its memory moved to huge pages), as the
    engine thread does it before a request arrives: a bench measures the app's steady state."""
    progress("settling memory")
    while loaded.idle_work():
        pass


def decode_path(loaded: Runtime, request: GenerationRequest) -> str:
    """Where the engine's worker decodes the request: "batch" (the continuous batcher) or
    "alone"."""
    batched = loaded.supports_batching and batchable(request, loaded.drafts_in_batch)
    return "batch" if batched else "alone"


def _run_in_batch(loaded: Runtime, pool: KvLedger[Any], request: GenerationRequest,
                  timeline: RequestTimeline) -> GenerationResult:
    """The request as the only row of a fresh batcher, stepped until it ends."""
    ended: list[tuple[GenerationResult | None, BaseException | None]] = []
    batcher = loaded.new_batcher(pool, lambda _job, _event: None,
                                 lambda _job, result, error: ended.append((result, error)))
    batcher.admit([DetachedJob(request, timeline)])
    while batcher.rows:
        batcher.step()
    result, error = ended[0]
    if error is not None:
        raise error
    assert result is not None  # a batcher reports a result or an error
    return result


class _TokenClock:
    """A generate() streamer that stamps each new token (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.stamps: list[int] = []
        self._seen_prompt = False

    def put(self, _value: torch.Tensor) -> None:
        if self._seen_prompt:
            self.stamps.append(time.perf_counter_ns())
        self._seen_prompt = True

    def end(self) -> None:
        pass


@torch.inference_mode()
def run_hf(loaded: LoadedModel, prompt_ids: list[int], max_tokens: int) -> PeerResult:
    """transformers generate() for exactly max_tokens greedy tokens, timed per token with a
    streamer, so TTFT and decode tok/s follow the same definitions as ours."""
    input_ids = torch.tensor([prompt_ids], device=loaded.device)
    clock = _TokenClock()
    start = time.perf_counter_ns()
    loaded.model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=loaded.tokenizer.eos_token_id,
        streamer=clock,
    )
    return result_from_stamps(start, clock.stamps)


PEERS = ("hf", "llama.cpp")  # what `bench --vs` accepts
PEER_LABELS = {"hf": "transformers generate()", "llama.cpp": "llama.cpp (llama-cpp-python)"}
# llama.cpp runs as two peers, flash attention off (llama-cpp-python's default) and on, and
# the report compares against the faster: which one wins depends on the CPU and the context
# (on a short one, on-by-default costs llama.cpp up to 15%). Runner key -> flash attention.
LLAMA_CPP_CONFIGS = {"llama.cpp fa-off": False, "llama.cpp fa-on": True}


def peer_key(peer: str) -> str:
    """The JSON key prefix of a peer: 'hf', 'llama_cpp' (a runner of one: 'llama_cpp')."""
    return peer.split()[0].replace(".", "_")


def runner_label(runner: str) -> str:
    """A peer runner's name on progress lines."""
    if runner in LLAMA_CPP_CONFIGS:
        return f"{PEER_LABELS['llama.cpp']}, flash attention " \
               f"{'on' if LLAMA_CPP_CONFIGS[runner] else 'off'}"
    return PEER_LABELS[runner]


def _peer_runners(peers: Sequence[str], hf_model: LoadedModel | None, loaded: Runtime,
                  n_ctx: int, stack: ExitStack, about: dict[str, Any],
                  progress: Callable[[str], None]) -> dict[str, PeerRunner]:
    """A run(prompt_ids, max_tokens) callable per requested peer, in PEERS order (llama.cpp:
    one per LLAMA_CPP_CONFIGS); what each peer ran on goes into `about` for the report."""
    runners: dict[str, PeerRunner] = {}
    for peer in (p for p in PEERS if p in peers):
        if peer == "hf":
            if hf_model is None:
                raise InvalidRequestError("--vs hf compares with transformers' generate() on "
                                          "the torch model: load it with --engine torch")
            runners[peer] = partial(run_hf, hf_model)
            about["hf_kernel"] = hf_model.info.kernel
            continue
        gguf = gguf_for(loaded.info)
        threads = loaded.cpu_threads
        about.update(llama_cpp_threads=threads, llama_cpp_gguf=gguf.name)
        for runner, flash_attn in LLAMA_CPP_CONFIGS.items():
            try:
                llama = stack.enter_context(LlamaCppPeer(gguf, n_threads=threads, n_ctx=n_ctx,
                                                         flash_attn=flash_attn))
            except NativeCrashError as exc:
                _peer_crashed(runner, exc, about, progress)
                continue
            runners[runner] = llama.run
            about.update(llama_cpp_version=llama.version, llama_cpp_build=llama.system_info)
    return runners


def _peer_crashed(runner: str, crash: NativeCrashError, about: dict[str, Any],
                  progress: Callable[[str], None]) -> None:
    """A peer's child process died: one line in the report (<peer>_error) and on progress,
    once per peer (llama.cpp's two configurations share a build)."""
    key = f"{peer_key(runner)}_error"
    if key not in about:
        about[key] = str(crash)
        progress(str(crash))


def _run_peers(runners: dict[str, PeerRunner], prompt_ids: list[int], max_tokens: int,
               about: dict[str, Any], progress: Callable[[str], None],
               results: dict[str, list[PeerResult]] | None = None,
               stage: str = "") -> None:
    """One run of each peer, appended to results; a peer that crashes is reported, dropped
    from runners and results (no partial numbers), and the others carry on."""
    for peer, run in list(runners.items()):
        if stage:
            progress(f"{stage}: {runner_label(peer)}")
        try:
            result = run(prompt_ids, max_tokens)
        except NativeCrashError as exc:
            _peer_crashed(peer, exc, about, progress)
            del runners[peer]
            if results is not None:
                results.pop(peer, None)
            continue
        if results is not None:
            results[peer].append(result)


def bench_decode(
    loaded: Runtime,
    *,
    prompt_tokens: int = 128,
    max_tokens: int = 64,
    repeats: int = 3,
    peers: Sequence[str] = (),
    speculative: bool = False,
    draft: TokenProposer | None = None,
    hf_reference: LoadedModel | None = None,
    progress: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """Cold TTFT, prefill tok/s, decode tok/s and ITL percentiles; medians over repeats.

    peers ('hf', 'llama.cpp') decode the same prompt ids for the same token count. Runs
    alternate ours / each peer (/ ours with speculative drafts) so drift in machine load hits
    all alike. generate() runs on hf_reference (the torch model as loaded, before a fast
    kernel), so the ratio is against stock transformers; llama.cpp runs the model's GGUF file.
    """
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise InvalidRequestError(f"unknown bench peer {unknown[0]!r} (choose from "
                                  f"{', '.join(PEERS)})")
    prompt_ids = fixed_prompt_ids(loaded, prompt_tokens)
    about: dict[str, Any] = {}
    with ExitStack() as stack:
        runners = _peer_runners(peers, hf_reference, loaded,
                                prompt_tokens + max_tokens + 8, stack, about, progress)
        progress("warm-up")
        run_ours(loaded, prompt_ids[:16], 4)
        _run_peers(runners, prompt_ids[:16], 4, about, progress)
        ours: list[GenerationResult] = []
        theirs: dict[str, list[PeerResult]] = {peer: [] for peer in runners}
        spec: list[GenerationResult] = []
        drafted: list[GenerationResult] = []
        for i in range(repeats):
            progress(f"run {i + 1}/{repeats}: phasewise")
            ours.append(run_ours(loaded, prompt_ids, max_tokens))
            _run_peers(runners, prompt_ids, max_tokens, about, progress, theirs,
                       stage=f"run {i + 1}/{repeats}")
            if speculative:
                progress(f"run {i + 1}/{repeats}: phasewise, speculative (ngram)")
                spec.append(run_ours(loaded, prompt_ids, max_tokens, speculative="ngram"))
            if speculative and draft is not None:
                progress(f"run {i + 1}/{repeats}: phasewise, speculative (draft model)")
                drafted.append(run_ours(loaded, prompt_ids, max_tokens, speculative="draft",
                                        draft=draft))
    report = decode_summary(loaded, ours, prompt_tokens, max_tokens, repeats) | about
    report["decode_path"] = decode_path(loaded, GenerationRequest([], SamplingParams()))
    # what a sampled reply's weights are computed with (bench's own replies are greedy)
    report["sampling_weights"] = weights_kernel()
    if "hf" in theirs:
        report.update(peer_summary("hf", theirs["hf"], report))
    report.update(llama_cpp_summary(theirs, report))
    if speculative:
        report.update(speculative_summary(ours, spec))
    if drafted and draft is not None:
        report.update(speculative_summary(ours, drafted, "draft", prefix="draft_"))
        report["draft_model"] = draft.name
        report["draft_kernel"] = draft.info.kernel
    return report


def decode_summary(loaded: Runtime, ours: list[GenerationResult], prompt_tokens: int,
                   max_tokens: int, repeats: int) -> dict[str, Any]:
    """Our side of bench_decode's report: medians over runs, ITL percentiles over all."""
    itl = [x for r in ours for x in r.metrics.itl_s]
    itl_p50, itl_p90, itl_p99 = percentiles(itl, (50, 90, 99))
    med = statistics.median
    return {
        "model": loaded.info.name,
        "device": loaded.info.device,
        "dtype": loaded.info.dtype,
        "kernel": loaded.info.kernel,
        "engine": loaded.info.engine,
        "system_info": loaded.system_info,
        "memory_pages": loaded.memory_pages,
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


def peer_summary(peer: str, runs: list[PeerResult], ours: dict[str, Any]) -> dict[str, Any]:
    """A peer's medians under its key prefix, and ratios where above 1 means ours is better:
    decode_ratio_vs_<peer> = our decode tok/s / theirs; ttft_ratio_vs_<peer> = their TTFT /
    ours."""
    key = peer_key(peer)
    med = statistics.median
    itl_p50, itl_p99 = percentiles([x for r in runs for x in r.itl_s], (50, 99))
    decode, ttft = med(r.decode_tok_s for r in runs), med(r.ttft_s for r in runs)
    return {
        f"{key}_ttft_s": ttft,
        f"{key}_decode_tok_s": decode,
        f"{key}_itl_p50_s": itl_p50,
        f"{key}_itl_p99_s": itl_p99,
        f"decode_ratio_vs_{key}": ours["decode_tok_s"] / decode if decode else 0.0,
        f"ttft_ratio_vs_{key}": ttft / ours["ttft_s"] if ours["ttft_s"] else 0.0,
    }


def llama_cpp_summary(theirs: dict[str, list[PeerResult]],
                      ours: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's configurations that ran (LLAMA_CPP_CONFIGS): each one's median decode and
    TTFT (llama_cpp_fa_off_decode_tok_s, ...), and the faster one's by decode tok/s as the
    peer (peer_summary's llama_cpp_* keys and ratios), llama_cpp_flash_attn saying which."""
    ran = {runner: runs for runner, runs in theirs.items() if runner in LLAMA_CPP_CONFIGS}
    if not ran:
        return {}
    summary: dict[str, Any] = {}
    for runner, runs in ran.items():
        config = "fa_on" if LLAMA_CPP_CONFIGS[runner] else "fa_off"
        summary[f"llama_cpp_{config}_decode_tok_s"] = statistics.median(
            r.decode_tok_s for r in runs)
        summary[f"llama_cpp_{config}_ttft_s"] = statistics.median(r.ttft_s for r in runs)
    faster = max(ran, key=lambda runner: statistics.median(r.decode_tok_s for r in ran[runner]))
    summary["llama_cpp_flash_attn"] = LLAMA_CPP_CONFIGS[faster]
    return summary | peer_summary("llama.cpp", ran[faster], ours)


def speculative_summary(plain: list[GenerationResult], spec: list[GenerationResult],
                        method: str = "ngram", prefix: str = "spec_") -> dict[str, Any]:
    """Acceptance and speedup of speculative decoding (method "ngram" or "draft") against
    plain runs of the same prompt, keys under prefix; <prefix>output_identical checks the
    greedy outputs match token for token."""
    proposed = sum(r.spec_proposed for r in spec)
    accepted = sum(r.spec_accepted for r in spec)
    rate = statistics.median(r.metrics.decode_tok_s for r in spec)
    plain_rate = statistics.median(r.metrics.decode_tok_s for r in plain)
    summary = {
        "method": method,
        "decode_tok_s": rate,
        "speedup": rate / plain_rate if plain_rate else 0.0,
        "e2e_speedup": (statistics.median(r.metrics.e2e_s for r in plain)
                        / statistics.median(r.metrics.e2e_s for r in spec)),
        "proposed": proposed,
        "accepted": accepted,
        "accept_rate": accepted / proposed if proposed else 0.0,
        "output_identical": all(s.token_ids == plain[0].token_ids for s in spec),
    }
    return {prefix + key: value for key, value in summary.items()}


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
    loaded: Runtime,
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
    pool = loaded.new_prefix_cache(budget_bytes=1 << 40)
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
        result = loaded.new_session(pool).run(request, timeline, threading.Event(),
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
        messages.append(result.as_message())  # the ids it produced: the next turn reuses it all
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


def fixed_text(loaded: Runtime, n_tokens: int) -> str:
    return str(loaded.tokenizer.decode(fixed_prompt_ids(loaded, n_tokens)))


@torch.inference_mode()
def bench_batch(
    loaded: Runtime,
    *,
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8),
    prompt_tokens: int = 64,
    max_tokens: int = 32,
    rounds: int = 2,
    progress: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """Decode B requests at once through the engine's continuous batcher: per-token latency
    and total throughput.

    Each request is a different window of the fixed passage, all of one length; each is
    prefilled on its own and joins the batch, as in the engine, but whole, before any row
    steps (the engine reads a prompt that joins streaming rows inside their steps, so they
    would stream together for only part of the run). A timed step is one forward over all B
    rows plus each row's sampling, detokenizing and events; only steps with all B rows count.
    Batch sizes alternate round by round; each step's time is the median over the rounds.
    """
    stride = 7
    source = fixed_prompt_ids(loaded, prompt_tokens + stride * max(batch_sizes))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    step_s: dict[int, list[float]] = {b: [] for b in batch_sizes}
    for r in range(rounds):
        for b in batch_sizes:
            progress(f"round {r + 1}/{rounds}: batch {b}")
            pool = loaded.new_prefix_cache(budget_bytes=1 << 40)
            batcher = loaded.new_batcher(pool, lambda _job, _event: None,
                                         lambda _job, _result, _error: None,
                                         BatchSchedule(interleave=False))
            for i in range(b):
                ids = source[i * stride : i * stride + prompt_tokens]
                batcher.admit([DetachedJob(GenerationRequest(
                    [], params, prompt_token_ids=ids, reuse_cache=False))])
            if len(batcher.rows) != b:
                raise ValueError(f"{b} rows did not stream at once: max_tokens too small?")
            while len(batcher.rows) == b:
                start = time.perf_counter()
                batcher.step()
                step_s[b].append(time.perf_counter() - start)
    base = statistics.median(step_s[batch_sizes[0]]) / batch_sizes[0]
    rows = []
    for b in batch_sizes:
        step = statistics.median(step_s[b])
        rows.append({"batch": b, "per_token_latency_ms": step * 1e3,
                     "total_tok_s": b / step, "throughput_vs_first": base * b / step,
                     "steps_timed": len(step_s[b])})
    return {"model": loaded.info.name, "device": loaded.info.device,
            "kernel": loaded.info.kernel, "engine": loaded.info.engine,
            "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens, "rounds": rounds, "path": "engine batcher",
            "batches": rows}


# ----- a long prompt's prefill against a streaming chat ----------------------------------------
INTERFERENCE_MODES = ("one_pass", "chunked", "beside")  # report key prefixes
INTERFERENCE_LABELS = {"one_pass": "whole prefill between two steps",
                       "chunked": "chunked, streams keep decoding",
                       "beside": "beside, on its own cores"}


def interference_modes(loaded: Runtime) -> tuple[str, ...]:
    """The schedules an engine has here: with a core to spare, llama.cpp can also prefill on a
    side context and torch on a CPU in a side thread."""
    return INTERFERENCE_MODES if loaded.can_prefill_beside else INTERFERENCE_MODES[:2]


@torch.inference_mode()
def bench_interference(
    loaded: Runtime,
    *,
    prompt_tokens: int = 4000,
    stream_prompt_tokens: int = 64,
    alone_tokens: int = 48,
    rounds: int = 1,
    progress: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """One chat streams through the engine's batcher while another submits a prompt_tokens
    prompt: the streaming chat's ITL p99 while the prompt is prefilled, and over the same
    tokens of the same stream run alone (its baseline; also its ITL before the prompt), with the
    prefill in one pass between two decode steps (the streams wait), in chunks with decode
    steps between them (on llama.cpp, in the rows' own steps) and, on llama.cpp and on a CPU,
    beside the streams with its own cores (the engine's choice for a long prompt), and
    the same prompt's prefill rate with nothing streaming. Modes alternate round by round;
    ITLs are pooled over rounds."""
    source = fixed_prompt_ids(loaded, stream_prompt_tokens + prompt_tokens)
    stream_ids, long_ids = source[:stream_prompt_tokens], source[stream_prompt_tokens:]
    modes = interference_modes(loaded)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    progress("warm-up")
    run_ours(loaded, stream_ids[:16], 4)
    for r in range(rounds):
        for mode in modes:
            progress(f"round {r + 1}/{rounds}: {INTERFERENCE_LABELS[mode]}")
            run = _interference_run(loaded, mode, stream_ids, long_ids, alone_tokens)
            lone = lone_prefill(loaded, long_ids, mode)
            run["lone_prefill_s"], run["lone_progress_gap_s"] = lone.seconds, lone.longest_wait_s
            runs[mode].append(run)
    report: dict[str, Any] = {"model": loaded.info.name, "device": loaded.info.device,
                              "kernel": loaded.info.kernel, "prompt_tokens": prompt_tokens,
                              "stream_prompt_tokens": stream_prompt_tokens, "rounds": rounds,
                              "modes": list(modes)}
    for mode, mode_runs in runs.items():
        report.update({f"{mode}_{key}": value
                       for key, value in _interference_summary(mode_runs).items()})
    return report


def _interference_batcher(loaded: Runtime, mode: str,
                          progress: dict[str, list[int]] | None = None) -> Any:
    """A fresh batcher on a fresh prefix cache (llama.cpp: an empty KV memory). one_pass: the
    prompt is prefilled whole between two steps (torch: one forward; llama.cpp: n_batch
    batches, as before chunking); chunked: chunks between or in the decode steps (torch's
    schedule); beside: the engine's own schedule, a long prompt on a side context (llama.cpp)
    or in a side thread (torch on a CPU). `progress` collects each request's PrefillProgress
    stamps."""
    whole = mode == "one_pass"

    def emit(_job: Any, event: Any) -> None:
        if progress is not None and isinstance(event, PrefillProgress):
            progress.setdefault(event.request_id, []).append(event.t_ns)

    def done(_job: Any, _result: Any, _error: Any) -> None:
        pass

    schedule = BatchSchedule(interleave=not whole, beside=mode == "beside", one_pass=whole)
    return loaded.new_batcher(loaded.new_prefix_cache(budget_bytes=1 << 40), emit, done,
                              schedule)


@dataclass(frozen=True)
class LonePrefill:
    """A prompt prefilled with nothing else running: its time, its PrefillProgress events and
    the longest wait for one (engine clock)."""

    seconds: float
    progress_events: int
    longest_wait_s: float


def lone_prefill(loaded: Runtime, ids: list[int], mode: str = "beside") -> LonePrefill:
    """Prefill ids through a fresh batcher of `mode` (see _interference_batcher; "beside" is
    the engine's own) with nothing else running (what chunking must not slow)."""
    progress: dict[str, list[int]] = {}
    batcher = _interference_batcher(loaded, mode, progress)
    job = DetachedJob(GenerationRequest(
        [], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        prompt_token_ids=ids, reuse_cache=False))
    batcher.admit([job])
    t = job.timeline
    stamps = progress.get(job.request.request_id, [])
    return LonePrefill((t.first_logits_ns - t.prefill_start_ns) * 1e-9, len(stamps),
                       _longest_progress_gap_s(t, stamps))


def _longest_progress_gap_s(timeline: RequestTimeline, stamps: list[int]) -> float:
    """The longest a prefill went without news: from its start to its first progress event,
    between two, and from the last to its first logits."""
    marks = [timeline.prefill_start_ns, *stamps, timeline.first_logits_ns]
    return max(b - a for a, b in pairwise(marks)) * 1e-9


def _interference_run(loaded: Runtime, mode: str, stream_ids: list[int],
                      long_ids: list[int], alone_tokens: int) -> dict[str, Any]:
    """Stream alone for alone_tokens steps, admit the long prompt (the batcher interleaves or
    not), take a few more steps together; return the stream's ITL split by phase, and the
    same gaps of the same stream run again with no prompt to read (its baseline: a step
    costs more as the stream's own context grows, prompt or not)."""
    progress: dict[str, list[int]] = {}
    batcher = _interference_batcher(loaded, mode, progress)
    stream = _stream_job(loaded, stream_ids)
    long = DetachedJob(GenerationRequest(
        [], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        prompt_token_ids=long_ids, reuse_cache=False))
    batcher.admit([stream])
    for _ in range(alone_tokens):
        batcher.step()
    batcher.admit([long])
    for _ in range(4):
        batcher.step()
    stream.cancel.set()
    long.cancel.set()
    batcher.step()
    lt = long.timeline
    gaps = stream.timeline.itl_s()
    during_at = [i for i, (a, b) in enumerate(pairwise(stream.timeline.token_ns))
                 if b > lt.prefill_start_ns and a < lt.first_logits_ns]
    control = _stream_alone_gaps(loaded, mode, stream_ids, during_at[-1] + 1 if during_at else 0)
    return {
        "before": gaps[:alone_tokens],
        "alone": [control[i] for i in during_at],
        "during": [gaps[i] for i in during_at],
        "prefill_s": (lt.first_logits_ns - lt.prefill_start_ns) * 1e-9,
        "prefill_tokens": len(long_ids),
        "progress_gap_s": _longest_progress_gap_s(lt, progress.get(long.request.request_id,
                                                                   [])),
    }


def _stream_job(loaded: Runtime, stream_ids: list[int]) -> DetachedJob:
    room = loaded.info.context_length - len(stream_ids) - 1
    return DetachedJob(GenerationRequest(
        [], SamplingParams(temperature=0.0, max_tokens=room, ignore_eos=True),
        prompt_token_ids=stream_ids, reuse_cache=False))


def _stream_alone_gaps(loaded: Runtime, mode: str, stream_ids: list[int],
                       steps: int) -> list[float]:
    """The stream's first `steps` ITLs with nothing else in the batcher."""
    batcher = _interference_batcher(loaded, mode)
    stream = _stream_job(loaded, stream_ids)
    batcher.admit([stream])
    for _ in range(steps):
        batcher.step()
    stream.cancel.set()
    batcher.step()
    return stream.timeline.itl_s()


def _interference_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    before = [x for r in runs for x in r["before"]]
    alone = [x for r in runs for x in r["alone"]]
    during = [x for r in runs for x in r["during"]]
    (alone_p50, alone_p99), (during_p50, during_p99) = (percentiles(alone, (50, 99)),
                                                        percentiles(during, (50, 99)))
    prefill_s = statistics.median(r["prefill_s"] for r in runs)
    lone_s = statistics.median(r["lone_prefill_s"] for r in runs)
    return {
        "itl_p50_alone_s": alone_p50,
        "itl_p99_alone_s": alone_p99,
        "itl_p50_during_prefill_s": during_p50,
        "itl_p99_during_prefill_s": during_p99,
        "itl_p99_ratio": during_p99 / alone_p99 if alone_p99 else 0.0,
        "itl_p99_before_prefill_s": percentiles(before, (99,))[0],
        "stream_tokens_during_prefill": len(during) // len(runs),
        "prefill_s": prefill_s,
        "prefill_tok_s": runs[0]["prefill_tokens"] / prefill_s if prefill_s else 0.0,
        "lone_prefill_s": lone_s,
        "lone_prefill_tok_s": runs[0]["prefill_tokens"] / lone_s if lone_s else 0.0,
        # the longest the prompt went without a PrefillProgress, beside the stream and alone
        "progress_gap_max_s": max(r["progress_gap_s"] for r in runs),
        "lone_progress_gap_max_s": max(r["lone_progress_gap_s"] for r in runs),
    }
