"""Start-up of `phasewise ask --engine llama.cpp`: the whole command's wall time, CPU time and
peak memory, and what its imports cost, in one or more source trees.

    python benchmarks/ask_startup.py [TREE ...] [--model FILE.gguf] [--repeats 3] [--json]

Each TREE is a source checkout (default: this one); to compare with an older commit, export it
first (`git archive REV | tar -x -C DIR`). Every run is a fresh process,
`python -X importtime -m app ask --engine llama.cpp --model FILE --temperature 0 --max-tokens 32
PROMPT`, with the tree as its working directory and the bytecode compiled once beforehand (one
uncounted run per tree), as an installed app has it. The trees take turns, so a busy machine
slows them alike; the table gives medians and each tree's wall ratio to the first. Import times
are -X importtime's cumulative figures (0 where the module was not imported). On a busy machine
llama.cpp's threads spin at their barriers and wall and CPU times balloon: measure on an idle one.
Measures only; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "What is the capital of France? Answer in one sentence."
TIMED_IMPORTS = ("torch", "transformers", "llama_cpp")


def import_seconds(importtime_log: str) -> dict[str, float]:
    """Cumulative import seconds of each TIMED_IMPORTS package, from -X importtime's lines
    ("import time: self | cumulative | name")."""
    found = dict.fromkeys(TIMED_IMPORTS, 0.0)
    for line in importtime_log.splitlines():
        parts = line.split("|")
        if len(parts) != 3 or not line.startswith("import time:"):
            continue
        name = parts[2].strip()
        if name in found and found[name] == 0.0:
            found[name] = int(parts[1]) / 1e6
    return found


def run_once(tree: Path, model: str, max_tokens: int, pycache: Path) -> dict[str, float]:
    """One `ask` in a fresh process: wall, user+system CPU, peak RSS and import seconds."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(pycache)
    command = [sys.executable, "-X", "importtime", "-m", "app", "ask", "--engine", "llama.cpp",
               "--model", model, "--temperature", "0", "--max-tokens", str(max_tokens), PROMPT]
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        process = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                                   stderr=log)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        imports = import_seconds(log.read())
    if process.returncode != 0:
        raise SystemExit(f"ask failed in {tree} (exit {process.returncode})")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_mb": usage.ru_maxrss / 1024,  # KiB on Linux
            **{f"import_{name}_s": seconds for name, seconds in imports.items()}}


def measure(trees: list[Path], model: str, repeats: int, max_tokens: int) -> dict[str, dict]:
    runs: dict[str, list[dict[str, float]]] = {str(t): [] for t in trees}
    with tempfile.TemporaryDirectory(prefix="phasewise-ask-startup-") as cache:
        caches = {t: Path(cache) / str(i) for i, t in enumerate(trees)}
        for tree in trees:  # compile the bytecode; not counted
            run_once(tree, model, max_tokens, caches[tree])
        for _ in range(repeats):
            for tree in trees:
                runs[str(tree)].append(run_once(tree, model, max_tokens, caches[tree]))
    return {tree: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
            for tree, rs in runs.items()}


def print_table(results: dict[str, dict], model: str) -> None:
    print(f"`ask --engine llama.cpp` on {Path(model).name} "
          f"({Path(model).stat().st_size / 1e6:.0f} MB), medians")
    print("| tree | wall s | vs first | CPU s | peak RSS MB | torch import s "
          "| transformers import s | llama_cpp import s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    first = next(iter(results.values()))["wall_s"]
    for tree, r in results.items():
        print(f"| {tree} | {r['wall_s']:.2f} | x{r['wall_s'] / first:.2f} | {r['cpu_s']:.2f} "
              f"| {r['peak_rss_mb']:.0f} | {r['import_torch_s']:.2f} "
              f"| {r['import_transformers_s']:.2f} | {r['import_llama_cpp_s']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="*", type=Path, help="source trees (default: this one)")
    parser.add_argument("--model", help="a .gguf file (default: the bundled SmolLM2 GGUF)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    trees = [t.resolve() for t in args.trees] or [root]
    if args.model is None:
        sys.path.insert(0, str(root))
        from engine.model_files import default_gguf_path

        args.model = str(default_gguf_path())
    results = measure(trees, args.model, args.repeats, args.max_tokens)
    print_table(results, args.model)
    if args.json:
        print(json.dumps({"model": args.model, "repeats": args.repeats, "results": results}))


if __name__ == "__main__":
    main()
