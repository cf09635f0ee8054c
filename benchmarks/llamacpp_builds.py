"""llama.cpp builds side by side: prefill and decode of the same GGUF files through
llama-cpp-python's `Llama`, one child process per (build, file) run, builds alternating.

A build is a folder of llama.cpp libraries (a wheel's `llama_cpp/lib`), which the child loads
through llama-cpp-python's LLAMA_CPP_LIB_PATH: the installed one ("installed"), or others
unpacked from other wheels (the portable x86-64-v3 one, a -march=native yardstick). A build
whose CPU backend comes as run-time variants gets the variant Phasewise would load
(engine/llamacpp/cpu_backend.py). Prints medians per build and file and each build's ratio to
the first. Measures, never asserts.

    .venv/bin/python benchmarks/llamacpp_builds.py --build native=DIR --build installed \\
        --model default --model FILE.gguf [--repeats 3] [--flash-attn off]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from engine.machine import cpu_name
from engine.native import NativeChild
from engine.runtime_choice import gguf_path
from engine.tools.bench import fixed_prompt_ids

DECODE_TOKENS = 64


def run_build(conn: Connection, lib_dir: str, gguf: str, prompts: dict[str, list[int]],
              threads: int, flash_attn: bool) -> None:
    """In the child: load gguf on the build in lib_dir; prefill each prompt cold (tok/s),
    then decode DECODE_TOKENS greedy tokens after the first one (tok/s)."""
    if lib_dir:
        os.environ["LLAMA_CPP_LIB_PATH"] = lib_dir
    import llama_cpp

    from engine.runtimes.llamacpp.cpu_backend import ensure_cpu_backend, system_info

    backend = ensure_cpu_backend(llama_cpp, None)  # cached by the parent's own load
    n_ctx = max(len(p) for p in prompts.values()) + DECODE_TOKENS + 8
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, flash_attn=flash_attn, verbose=False)
    out: dict[str, Any] = {"variant": backend.variant, "system_info": system_info(llama_cpp)}
    llm.eval(prompts["short"][:8])  # warm-up
    for name, ids in prompts.items():
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)
        out[f"prefill_{name}_tok_s"] = len(ids) / (time.perf_counter() - start)
    llm.reset()
    llm.eval(prompts["short"])
    start = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        token = int(llm.scores[llm.n_tokens - 1].argmax())
        llm.eval([token])
    out["decode_tok_s"] = DECODE_TOKENS / (time.perf_counter() - start)
    llm.close()
    conn.send(("result", out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="append", required=True,
                        help="NAME=LIBDIR, or 'installed' for this environment's llama_cpp")
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--short-tokens", type=int, default=128)
    parser.add_argument("--flash-attn", choices=("off", "on"), default="off")
    args = parser.parse_args()
    builds = dict(b.split("=", 1) if "=" in b else (b, "") for b in args.build)
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for spec in args.model:
        path, name, _source = gguf_path(spec)
        from engine.runtimes.llamacpp.model import (
            load_gguf,  # the tokenizer, and the variant's cache
        )

        loaded = load_gguf(path, name=name, source="gguf", n_threads=args.threads,
                           context_length=args.long_tokens + 256, flash_attn=False)
        ids = fixed_prompt_ids(loaded, args.long_tokens)
        loaded.close()
        prompts = {"short": ids[: args.short_tokens], "long": ids}
        for _ in range(args.repeats):
            for build, lib_dir in builds.items():
                child = NativeChild(run_build, lib_dir, str(path), prompts, args.threads,
                                    args.flash_attn == "on", what=f"llama.cpp build {build}")
                try:
                    run = child.receive(600)
                finally:
                    child.close()
                results.setdefault((build, path.name), []).append(run)
                print(json.dumps({"build": build, "model": path.name, "loadavg": os.getloadavg()[0],
                                  **{k: round(v, 1) for k, v in run.items()
                                     if isinstance(v, float)}}), file=sys.stderr, flush=True)
    print(json.dumps(report(results, builds, args), indent=1))


def report(results: dict[tuple[str, str], list[dict[str, Any]]], builds: dict[str, str],
           args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"cpu": cpu_name(), "threads": args.threads,
                           "flash_attn": args.flash_attn, "repeats": args.repeats,
                           "loadavg": os.getloadavg(), "runs": {}}
    first = next(iter(builds))
    metrics = ("prefill_short_tok_s", "prefill_long_tok_s", "decode_tok_s")
    for (build, model), runs in results.items():
        row: dict[str, Any] = {m: statistics.median(r[m] for r in runs) for m in metrics}
        row["variant"] = runs[0]["variant"]
        row["system_info"] = runs[0]["system_info"]
        out["runs"][f"{build} {model}"] = row
    for (build, model) in results:
        base = out["runs"][f"{first} {model}"]
        row = out["runs"][f"{build} {model}"]
        row.update({f"ratio_{m}": row[m] / base[m] for m in metrics})
    return out


if __name__ == "__main__":
    main()
