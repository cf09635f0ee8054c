"""Flash attention on the llama.cpp engine against the same engine without it, in one process.

Two loads of the default GGUF, one per attention kernel; runs alternate (off, on, off, ...)
so drift in machine load hits both alike. Measures a short chat's decode, a cold long
prompt's prefill, and the short chat's decode while the prefix cache holds other chats' KV:
the KV memory is one pool of cells, and without flash attention every decode step attends
over all used cells (masked), so cached chats slow every reply. Prints medians and ratios
(above 1: flash attention is better) and whether greedy replies agree. Measures, never
asserts.

    .venv/bin/python benchmarks/llamacpp_attention.py [--repeats 3] [--cached-chats 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
from typing import Any

from engine.metrics import RequestTimeline, now_ns
from engine.model_files import default_gguf_path
from engine.params import GenerationRequest, SamplingParams
from engine.runtimes.llamacpp.model import load_gguf
from engine.runtimes.llamacpp.runtime import LlamaRuntime
from engine.runtimes.torch.kernels import cpu_name
from engine.tools.bench import fixed_prompt_ids

KERNELS = {"off": False, "on": True}


def run(runtime: Any, pool: Any, ids: list[int], max_tokens: int,
        conversation: str | None = None) -> Any:
    request = GenerationRequest(
        [], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        prompt_token_ids=ids, reuse_cache=conversation is not None,
        conversation_id=conversation)
    return runtime.new_session(pool).run(request, RequestTimeline(now_ns()), threading.Event(),
                                         lambda _e: None)


def fill_cache(runtime: Any, pool: Any, source: list[int], chats: int, tokens: int) -> int:
    """Leave `chats` other conversations of `tokens` prompt tokens cached in the pool."""
    for i in range(chats):
        start = (i * 97) % max(1, len(source) - tokens)
        run(runtime, pool, source[start : start + tokens], 1, conversation=f"other-{i}")
    return chats * tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--long-prompt-tokens", type=int, default=2000)
    parser.add_argument("--cached-chats", type=int, default=4)
    parser.add_argument("--cached-tokens", type=int, default=1500)
    args = parser.parse_args()

    models = {name: LlamaRuntime(load_gguf(default_gguf_path(), name="default", source="bundled",
                                           flash_attn=flash)) for name, flash in KERNELS.items()}
    source = fixed_prompt_ids(models["off"], args.long_prompt_tokens + args.prompt_tokens)
    short, long = source[: args.prompt_tokens], source[args.prompt_tokens :]
    runs: dict[str, dict[str, list[Any]]] = {k: {"short": [], "long": [], "busy": []}
                                             for k in KERNELS}
    for runtime in models.values():
        run(runtime, runtime.new_prefix_cache(1 << 40), short[:16], 4)  # warm-up
    for _ in range(args.repeats):
        for name, runtime in models.items():
            runs[name]["short"].append(run(runtime, runtime.new_prefix_cache(1 << 40), short,
                                           args.max_tokens))
            runs[name]["long"].append(run(runtime, runtime.new_prefix_cache(1 << 40), long, 1))
    cached = 0
    for name, runtime in models.items():
        pool = runtime.new_prefix_cache(1 << 40)
        cached = fill_cache(runtime, pool, source, args.cached_chats, args.cached_tokens)
        for _ in range(args.repeats):
            runs[name]["busy"].append(run(runtime, pool, short, args.max_tokens))
    print(json.dumps(report(models["off"], runs, args, cached), indent=1))


def report(runtime: Any, runs: dict[str, dict[str, list[Any]]], args: argparse.Namespace,
           cached: int) -> dict[str, Any]:
    med = statistics.median
    out: dict[str, Any] = {"cpu": cpu_name(), "threads": runtime.cpu_threads,
                           "repeats": args.repeats, "cached_tokens_of_other_chats": cached}
    for name, kinds in runs.items():
        out[f"{name}_decode_tok_s"] = med(r.metrics.decode_tok_s for r in kinds["short"])
        out[f"{name}_prefill_tok_s"] = med(len(r.prompt_token_ids) / r.metrics.prefill_s
                                           for r in kinds["long"])
        out[f"{name}_decode_tok_s_beside_cached_chats"] = med(r.metrics.decode_tok_s
                                                             for r in kinds["busy"])
    for metric in ("decode_tok_s", "prefill_tok_s", "decode_tok_s_beside_cached_chats"):
        out[f"ratio_{metric}"] = out[f"on_{metric}"] / out[f"off_{metric}"]
    out["greedy_identical"] = runs["on"]["short"][0].token_ids == runs["off"]["short"][0].token_ids
    out["greedy_same_first_token_long"] = (runs["on"]["long"][0].token_ids
                                           == runs["off"]["long"][0].token_ids)
    return out


if __name__ == "__main__":
    main()
