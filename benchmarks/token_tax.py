"""Phasewise's own per-token work on llama.cpp: the share of a decode step spent outside
llama_decode (logits view, checks, sampling, detokenizing, events), greedy and sampled.

Wraps llama_decode with a clock; a reply's decode span (first token to last, the engine's own
stamps) less the time inside llama_decode after the first token is the tax (`tax_share`: every
interruption outside llama_decode counts, so it moves with the machine's noise). `gap_share`:
the median gap between one llama_decode's end and the next one's start against the median step
(a typical token's work, robust to a stray preemption). Largest on a large vocabulary: make
one with benchmarks/synthetic_gguf.py --arch gemma3 --vocab 262144. Measures,
never asserts.

    .venv/bin/python benchmarks/token_tax.py [--model FILE.gguf] [--repeats 3] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import threading
import time
from typing import Any

from engine.core.sampling import weights_kernel
from engine.machine import cpu_name
from engine.metrics import RequestTimeline, now_ns
from engine.params import GenerationRequest, SamplingParams
from engine.runtimes import LLAMA_CPP, load
from engine.tools.bench import fixed_prompt_ids, settle

SAMPLINGS = {"greedy": SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
             "sampled": SamplingParams(temperature=0.7, max_tokens=64, ignore_eos=True, seed=1),
             "top-p 0.95": SamplingParams(temperature=0.7, top_p=0.95, max_tokens=64,
                                          ignore_eos=True, seed=1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries")
    parser.add_argument("--profile-sort", choices=("tottime", "cumulative"), default="tottime")
    args = parser.parse_args()
    runtime = load(args.model, LLAMA_CPP, context_length=1024)
    settle(runtime)  # as the app's engine does while idle
    model = runtime.model
    lib = model.llama_cpp
    calls: list[tuple[float, float]] = []  # each llama_decode's start and end
    real_decode = lib.llama_decode

    def timed(ctx: Any, batch: Any) -> int:
        start = time.perf_counter()
        code = int(real_decode(ctx, batch))
        calls.append((start, time.perf_counter()))
        return code

    lib.llama_decode = timed
    pool = runtime.new_prefix_cache(1 << 30)
    ids = fixed_prompt_ids(runtime, 64)
    out: dict[str, Any] = {"cpu": cpu_name(), "loadavg": os.getloadavg()[0],
                           "model": runtime.info.name, "vocab": model.n_vocab,
                           "kernel": runtime.info.kernel, "sampling_weights": weights_kernel()}
    for name, params in SAMPLINGS.items():
        shares, steps, gap_shares = [], [], []
        for i in range(args.repeats + 1):
            calls.clear()
            profile = cProfile.Profile() if args.profile and i == args.repeats else None
            timeline = RequestTimeline(now_ns())
            request = GenerationRequest([], params, prompt_token_ids=ids, reuse_cache=False)
            if profile:
                profile.enable()
            runtime.new_session(pool).run(request, timeline, threading.Event(), lambda _e: None)
            if profile:
                profile.disable()
                pstats.Stats(profile).sort_stats(args.profile_sort).print_stats(24)
                continue
            if i == 0:
                continue  # warm-up
            span = (timeline.token_ns[-1] - timeline.token_ns[0]) / 1e9
            n = len(timeline.token_ns) - 1
            inside = [end - start for start, end in calls[-n:]]  # the steps after the first token
            shares.append(1 - sum(inside) / span)
            steps.append(span / n * 1e3)
            gaps = [start - end for (_, end), (start, _)
                    in zip(calls[-n - 1:-1], calls[-n:], strict=True)]
            gap, decode = statistics.median(gaps), statistics.median(inside)
            gap_shares.append(gap / (gap + decode))
        out[name] = {"step_ms": statistics.median(steps), "tax_share": statistics.median(shares),
                     "gap_share": statistics.median(gap_shares)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
