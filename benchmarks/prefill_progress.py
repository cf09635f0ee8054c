"""How often a lone long prompt reports its progress, and how fast it goes in.

A --tokens prompt (default 4,000) is prefilled through the engine's batcher with nothing else
running (engine.tools.bench.lone_prefill, what `bench --interference` measures "alone"), on the
bundled model, --repeats times. For each run: the prefill's time and rate, the number of
PrefillProgress events, and the longest wait for one (from the prefill's start, between two,
and from the last to the first logits), all on the engine thread's clock. Prints numbers,
asserts nothing. To compare two builds, run it in a checkout of each (from this one on),
alternating.

    .venv/bin/python benchmarks/prefill_progress.py --engine llama.cpp [--tokens 4000]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The engine of the checkout this file is in, not the installed one: two builds compared.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import runtimes
from engine.runtimes.torch.kernels import cpu_name
from engine.tools import bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("llama.cpp", "torch"), default="llama.cpp")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    runtime = runtimes.load("default", args.engine)
    print(f"{runtime.info.name} on {runtime.info.device} ({runtime.info.kernel}), {cpu_name()}")
    ids = bench.fixed_prompt_ids(runtime, args.tokens)
    for _ in range(args.repeats):
        run = bench.lone_prefill(runtime, ids)
        print(f"{len(ids)} tokens in {run.seconds:.1f} s ({len(ids) / run.seconds:.0f} tok/s), "
              f"{run.progress_events} progress events, longest wait {run.longest_wait_s:.2f} s",
              flush=True)


if __name__ == "__main__":
    main()
