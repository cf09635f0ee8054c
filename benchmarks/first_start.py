"""First start of frozen Phasewise bundles: `ask` on the default model with an empty HOME.

    python benchmarks/first_start.py BUNDLE_DIR [BUNDLE_DIR ...] [--repeats 3]

Each BUNDLE_DIR is a PyInstaller folder (build/dist/phasewise, or opt/phasewise of an unpacked
.deb). Every run gets a new empty HOME and a minimal environment, as a user's first start does:
no converted model, no kernel choice, no settings cached. The bundles take turns, so a busy
machine slows them alike; the table gives medians and each bundle's ratio to the first one.
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


def run_once(bundle: Path, max_tokens: int) -> dict:
    """Wall time, peak RSS of the app's process, and its JSON line, for one first start."""
    with tempfile.TemporaryDirectory(prefix="phasewise-first-start-") as home:
        env = {"HOME": home, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        command = [str(bundle / "phasewise"), "ask", PROMPT, "--json", "--temperature", "0",
                   "--max-tokens", str(max_tokens)]
        start = time.perf_counter()
        proc = subprocess.Popen(command, env=env, cwd=home, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"{bundle}: exit {proc.returncode}: {err.strip()[-500:]}")
        result = json.loads(out.strip().splitlines()[-1])
        return {"wall_s": wall, "rss_mb": usage.ru_maxrss / 1024, "engine": result["engine"],
                "dtype": result["dtype"], "text": result["text"]}


def tree_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()
               and not p.is_symlink()) / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    runs: dict[Path, list[dict]] = {b: [] for b in args.bundles}
    for repeat in range(args.repeats):
        for bundle in args.bundles:
            runs[bundle].append(run_once(bundle, args.max_tokens))
            last = runs[bundle][-1]
            print(f"run {repeat + 1}: {bundle}: {last['wall_s']:.1f} s, {last['engine']}",
                  flush=True)
    base = statistics.median(r["wall_s"] for r in runs[args.bundles[0]])
    print(f"{'bundle':<40} {'MB':>7} {'engine':>10} {'first start s':>14} {'x first':>8} "
          f"{'peak RSS MB':>12}")
    for bundle, results in runs.items():
        wall = statistics.median(r["wall_s"] for r in results)
        rss = statistics.median(r["rss_mb"] for r in results)
        print(f"{bundle!s:<40} {tree_mb(bundle):>7.0f} {results[0]['engine']:>10} "
              f"{wall:>14.1f} {wall / base:>8.2f} {rss:>12.0f}")
        walls = ", ".join(f"{r['wall_s']:.1f}" for r in results)
        print(f"  runs: {walls} s; reply: {results[0]['text'].strip()[:60]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
