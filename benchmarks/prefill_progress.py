"""How often a lone long prompt reports its progress, and how fast it goes in.

A --tokens prompt (default 4,000) is prefilled through the engine's batcher with nothing else
running, on the bundled model, --repeats times. For each run: the prefill's time and rate, the
number of PrefillProgress events, and the longest wait for one (from the prefill's start, between
two, and from the last to the first logits), all on the engine thread's clock. Prints numbers,
asserts nothing. To compare two builds, run it in a checkout of each, alternating.

    .venv/bin/python benchmarks/prefill_progress.py --engine llama.cpp [--tokens 4000]
"""

from __future__ import annotations

import argparse
import sys
from itertools import pairwise
from pathlib import Path

# The engine of the checkout this file is in, not the installed one: two builds compared.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import bench, runtimes
from engine.batching import DetachedJob
from engine.events import PrefillProgress
from engine.kernels import cpu_name
from engine.params import GenerationRequest, SamplingParams


def one_run(loaded: runtimes.Model, ids: list[int]) -> str:
    stamps: list[int] = []

    def emit(_job: object, event: object) -> None:
        if isinstance(event, PrefillProgress):
            stamps.append(event.t_ns)

    pool = runtimes.new_prefix_cache(loaded, budget_bytes=1 << 40)
    batcher = runtimes.new_batcher(loaded, pool, emit, lambda _j, _r, _e: None)
    job = DetachedJob(GenerationRequest(
        [], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        prompt_token_ids=ids, reuse_cache=False))
    batcher.admit([job])
    t = job.timeline
    seconds = (t.first_logits_ns - t.prefill_start_ns) * 1e-9
    marks = [t.prefill_start_ns, *stamps, t.first_logits_ns]
    longest = max(b - a for a, b in pairwise(marks)) * 1e-9
    return (f"{len(ids)} tokens in {seconds:.1f} s ({len(ids) / seconds:.0f} tok/s), "
            f"{len(stamps)} progress events, longest wait {longest:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("llama.cpp", "torch"), default="llama.cpp")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    loaded = runtimes.load("default", args.engine)
    print(f"{loaded.info.name} on {loaded.info.device} ({loaded.info.kernel}), {cpu_name()}")
    ids = bench.fixed_prompt_ids(loaded, args.tokens)
    for _ in range(args.repeats):
        print(one_run(loaded, ids), flush=True)


if __name__ == "__main__":
    main()
