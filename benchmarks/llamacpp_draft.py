"""Draft-model speculation on the llama.cpp engine: one model in two quantizations.

The bundled SmolLM2-135M Q4_1 GGUF drafts for bigger quantizations of itself, written once
into a scratch folder with llama.cpp's own quantizer (F16 and Q8_0, requantized from the
Q4_1 file, so their weights hold the Q4_1 values: the pair agrees more often than a true
F16/Q4 pair would). For each target, runs alternate plain greedy / greedy with the draft on
the same prompt ids, so drift in machine load hits both alike. Prints decode tok/s of both,
their ratio, end-to-end ratio and the acceptance rate. Measures, never asserts.

    .venv/bin/python benchmarks/llamacpp_draft.py [--repeats 5] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from engine.model_files import default_gguf_path
from engine.runtimes import LLAMA_CPP, load
from engine.runtimes.torch.kernels import cpu_name
from engine.tools.bench import fixed_prompt_ids, run_ours, speculative_summary

TARGETS = ("F16", "Q8_0")


def requantize(source: Path, folder: Path, kind: str) -> Path:
    """source requantized to kind (a LLAMA_FTYPE_MOSTLY_* suffix) with llama.cpp's quantizer."""
    import llama_cpp

    target = folder / f"{source.stem}.{kind}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
                    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[kind]
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params):
        raise RuntimeError(f"llama.cpp could not write {target.name}")
    return target


def compare(target: Path, args: argparse.Namespace) -> dict[str, Any]:
    runtime = load(str(target), LLAMA_CPP)
    loaded = runtime.model
    draft = runtime.load_draft("default")
    ids = fixed_prompt_ids(loaded, args.prompt_tokens)
    run_ours(loaded, ids[:16], 4)
    run_ours(loaded, ids[:16], 4, speculative="draft", draft=draft)
    plain, drafted = [], []
    for _ in range(args.repeats):
        plain.append(run_ours(loaded, ids, args.max_tokens))
        draft.reset()  # a new prompt: the draft prefills it too (inside the request's prefill)
        drafted.append(run_ours(loaded, ids, args.max_tokens, speculative="draft", draft=draft))
    report = {"target": loaded.info.dtype, "target_mb": target.stat().st_size / 2**20,
              "draft": draft.loaded.info.dtype,
              "draft_mb": Path(draft.loaded.info.path).stat().st_size / 2**20,
              "plain_decode_tok_s": statistics.median(r.metrics.decode_tok_s for r in plain)}
    report.update(speculative_summary(plain, drafted, "draft", prefix="draft_"))
    draft.close()
    loaded.close()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="phasewise-draft-") as scratch:
        for kind in args.targets:
            target = requantize(default_gguf_path(), Path(scratch), kind)
            rows.append(compare(target, args))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # survives a later kill
    print(json.dumps({"cpu": cpu_name(), "prompt_tokens": args.prompt_tokens,
                      "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows},
                     indent=1))


if __name__ == "__main__":
    main()
