"""A decode step's cost by the chat's own length, flash attention off and on, on one load.

One model, two contexts made with the app's own context parameters (flash attention off in
one, on in the other), so the weights and their placement are shared: two loads of one GGUF
decode up to 5-10% apart on placement alone, which hides a difference this size. For each
length, each context holds one chat of that many tokens and times single-token steps after it;
the contexts alternate, their order flipping each round. Without flash attention a step
attends over the used cells padded up to a multiple of 256 (masked); with it, over the cells
themselves, at another cost per cell: where the two cross depends on the CPU's kernels
(llama.cpp's `haswell` variant on Zen 5: at ~128 cells, which is where attention.py's probe
looks alone). Measures, never asserts.

    .venv/bin/python benchmarks/attention_by_length.py [--model default] [--lengths 128,192,384,768]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from engine.machine import cpu_name
from engine.runtimes import LLAMA_CPP, load
from engine.runtimes.llamacpp.decode import BatchWriter
from engine.runtimes.llamacpp.model import LlamaCppModel
from engine.runtimes.llamacpp.runtime import LlamaRuntime
from engine.tools.bench import fixed_prompt_ids, settle

SETTINGS = ("off", "on")  # flash attention


def context(loaded: LlamaCppModel, flash: bool) -> Any:
    """A context like the app's (size, sequences, threads, KV types), attention as asked."""
    lib = loaded.llama_cpp
    params = type(loaded.context_params).from_buffer_copy(loaded.context_params)
    params.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash
                              else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    ctx = lib.llama_init_from_model(loaded.model, params)
    if not ctx:
        raise SystemExit(f"llama.cpp could not make a context with flash attention {flash}")
    return ctx


def step_ms(loaded: LlamaCppModel, ctx: Any, ids: list[int], steps: int) -> float:
    """The median single-token step after a chat of len(ids) tokens (prefilled in batches)."""
    lib = loaded.llama_cpp
    lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
    size = int(loaded.context_params.n_batch)
    batch = lib.llama_batch_init(size, 0, 1)
    writer = BatchWriter(batch, size)

    def decode(tokens: list[int], start: int) -> None:
        n = len(tokens)
        writer.fill(tokens, range(start, start + n), [0] * n, [i == n - 1 for i in range(n)])
        if lib.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")

    times = []
    try:
        for start in range(0, len(ids), size):
            decode(ids[start:start + size], start)
        for k in range(steps):
            began = time.perf_counter()
            decode([ids[k % len(ids)]], len(ids) + k)
            lib.llama_get_logits_ith(ctx, -1)
            times.append(time.perf_counter() - began)
    finally:
        lib.llama_batch_free(batch)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--lengths", default="128,192,384,768")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    runtime = load(args.model, LLAMA_CPP)
    if not isinstance(runtime, LlamaRuntime):
        raise SystemExit("not a llama.cpp model")
    settle(runtime)  # as the app's engine does while idle
    loaded = runtime.model
    lengths = [int(n) for n in args.lengths.split(",")]
    source = fixed_prompt_ids(runtime, max(lengths))
    contexts = {name: context(loaded, name == "on") for name in SETTINGS}
    times: dict[int, dict[str, list[float]]] = {n: {s: [] for s in SETTINGS} for n in lengths}
    try:
        for round_ in range(args.repeats):
            order = SETTINGS if round_ % 2 == 0 else SETTINGS[::-1]
            for n in lengths:
                for name in order:
                    times[n][name].append(step_ms(loaded, contexts[name], source[:n], args.steps))
    finally:
        for ctx in contexts.values():
            loaded.llama_cpp.llama_free(ctx)
    out: dict[str, Any] = {"cpu": cpu_name(), "kernel": runtime.info.kernel,
                           "model": runtime.info.name, "steps": args.steps,
                           "repeats": args.repeats, "step_ms": {}}
    for n in lengths:
        off, on = (statistics.median(times[n][s]) for s in ("off", "on"))
        out["step_ms"][n] = {"off": round(off, 3), "on": round(on, 3),
                             "on_over_off": round(on / off, 3)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
