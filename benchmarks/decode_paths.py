"""Decode tok/s of every kernel path that runs here, as ratios to fp32-eager, one process.

    .venv/bin/python benchmarks/decode_paths.py [--model default] [--tokens 64] [--rounds 3]

Paths run in alternation round by round (machine noise hits all alike); each round is a
greedy decode of --tokens tokens from the same 64-token prompt through the engine's loop.
Also prints each path's perplexity on the fixed reference text (the quality guard).
Measures and prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics

from engine.runtimes.torch.kernels import KERNELS, apply_kernel, configure_threads, eager_name
from engine.runtimes.torch.loader import load_model
from engine.runtimes.torch.quality import perplexity, reference_ids
from engine.tools.bench import fixed_prompt_ids, run_ours


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    threads = configure_threads()
    reference = load_model(args.model)
    paths = {}
    for name, path in KERNELS.items():
        reason = path.unavailable(reference)
        if reason:
            print(f"  skip {name}: {reason}")
            continue
        paths[name] = apply_kernel(reference, name)
    prompt = fixed_prompt_ids(reference, 64)
    for loaded in paths.values():
        run_ours(loaded, prompt[:16], 4)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, loaded in paths.items():
            rates[name].append(run_ours(loaded, prompt, args.tokens).metrics.decode_tok_s)
    text = reference_ids(reference.tokenizer)
    base_name = eager_name(reference)
    base = statistics.median(rates[base_name])
    base_ppl = perplexity(reference.model, text)
    print(f"\n{reference.info.name}: {args.tokens} greedy tokens, median of {args.rounds} "
          f"alternating rounds, {threads} threads")
    print(f"  {'kernel':<14} {'tok/s':>7} {'vs ' + base_name:>15} {'MB/step':>8} {'ppl':>8}"
          f" {'ppl vs ref':>10}")
    for name, loaded in paths.items():
        rate = statistics.median(rates[name])
        ppl = perplexity(loaded.model, text)
        print(f"  {name:<14} {rate:>7.1f} {rate / base:>14.2f}x "
              f"{loaded.info.weight_bytes_per_step / 1e6:>8.0f} {ppl:>8.3f} "
              f"{ppl / base_ppl - 1:>+9.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
