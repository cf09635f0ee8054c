"""Soak: one long conversation plus many short ones, scripted through the engine.

Checks, per turn, that the prefix cache stays within its byte budget; samples cached-vs-cold
agreement (greedy token ids identical); records resident memory every N turns and prints the
curve. Asserts nothing about time. Exit code 1 if the budget was exceeded or a sample disagreed.

    .venv/bin/python benchmarks/soak.py                   # tiny random model (built in a temp dir)
    .venv/bin/python benchmarks/soak.py --model default   # the bundled SmolLM2-135M
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import ChatMessage, GenerationRequest, SamplingParams
from engine.events import GenerationResult
from engine.worker import Engine

SYSTEM = ChatMessage("system", "You are a concise assistant. Answer in one short sentence.")


def rss_bytes() -> int:
    """Resident set size of this process (psutil if installed, else /proc/self/statm)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class SoakLog:
    budget: int
    turns: int = 0
    max_used: int = 0
    over_budget: int = 0
    samples: int = 0
    disagreements: int = 0
    miss_reasons: dict[str, int] = field(default_factory=dict)
    rss: list[tuple[int, float]] = field(default_factory=list)


class Soak:
    def __init__(self, engine: Engine, params: SamplingParams, sample_every: int,
                 rss_every: int) -> None:
        self.engine = engine
        self.params = params
        self.sample_every = sample_every
        self.rss_every = rss_every
        self.log = SoakLog(budget=engine.prefix_cache.budget_bytes)

    def turn(self, conv: str, history: list[ChatMessage], text: str) -> GenerationResult:
        history.append(ChatMessage("user", text))
        request = GenerationRequest(list(history), self.params, conversation_id=conv,
                                    overflow="drop_oldest")
        result = self.engine.submit(request).wait(600)
        history.append(ChatMessage("assistant", result.text))
        self._check(request, result)
        return result

    def _check(self, request: GenerationRequest, result: GenerationResult) -> None:
        log = self.log
        log.turns += 1
        reason = result.metrics.cache_miss_reason
        log.miss_reasons[reason] = log.miss_reasons.get(reason, 0) + 1
        used = self.engine.prefix_cache.used_bytes  # the engine is idle between turns
        log.max_used = max(log.max_used, used)
        log.over_budget += used > log.budget
        if log.turns % self.sample_every == 0:
            cold = GenerationRequest(request.messages, self.params, overflow="drop_oldest",
                                     reuse_cache=False)
            log.samples += 1
            log.disagreements += self.engine.submit(cold).wait(600).token_ids != result.token_ids
        if log.turns % self.rss_every == 0:
            log.rss.append((log.turns, rss_bytes() / 2**20))

    def long_conversation(self, turns: int) -> None:
        history = [SYSTEM]
        for i in range(turns):
            self.turn("long", history, f"Question {i}: what is item {i} about?")

    def many_conversations(self, count: int, turns_each: int) -> None:
        for c in range(count):
            history = [SYSTEM]
            for t in range(turns_each):
                self.turn(f"chat-{c}", history, f"Chat {c}, turn {t}: hello again")


def tiny_model_folder(root: Path) -> Path:
    from tests.support.tiny_model import build_tiny_model

    return build_tiny_model(root / "tiny-model")


def report(log: SoakLog, evictions: int) -> None:
    print("\nresident memory (MiB) by turn:")
    for turn, mib in log.rss:
        print(f"  {turn:5d}  {mib:8.1f}  {'#' * max(1, int(mib / 20))}")
    warm = log.rss[len(log.rss) // 4][1] if log.rss else 0.0
    end = log.rss[-1][1] if log.rss else 0.0
    print("\nsummary:")
    print(f"  turns                 {log.turns}")
    print(f"  cache budget          {log.budget / 2**20:.2f} MiB; max used "
          f"{log.max_used / 2**20:.2f} MiB; turns over budget: {log.over_budget}")
    print(f"  evictions             {evictions}")
    print(f"  miss reasons          {dict(sorted(log.miss_reasons.items()))}")
    print(f"  cached vs cold        {log.samples - log.disagreements}/{log.samples} agree")
    if log.rss:
        print(f"  RSS start / after warm-up (25%) / end: {log.rss[0][1]:.1f} / {warm:.1f} / "
              f"{end:.1f} MiB; growth after warm-up {end - warm:+.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (default), 'default', or a path")
    parser.add_argument("--turns", type=int, default=200, help="turns in the long conversation")
    parser.add_argument("--conversations", type=int, default=50)
    parser.add_argument("--turns-each", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="prefix cache budget (default: 1 MiB for tiny, the engine's own else)")
    parser.add_argument("--sample-every", type=int, default=10, help="cold check every N turns")
    parser.add_argument("--rss-every", type=int, default=20)
    args = parser.parse_args(argv)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    with tempfile.TemporaryDirectory(prefix="phasewise-soak-") as scratch:
        spec = str(tiny_model_folder(Path(scratch))) if args.model == "tiny" else args.model
        budget_mib = args.budget_mib if args.budget_mib else (1.0 if args.model == "tiny" else None)
        budget = int(budget_mib * 2**20) if budget_mib else None
        with Engine(cache_budget_bytes=budget) as engine:
            info = engine.load_model_sync(spec)
            print(f"model {info.name} ({info.parameters:,} parameters, context "
                  f"{info.context_length}) on {info.device}")
            soak = Soak(engine, params, args.sample_every, args.rss_every)
            soak.log.rss.append((0, rss_bytes() / 2**20))
            soak.long_conversation(args.turns)
            soak.many_conversations(args.conversations, args.turns_each)
            report(soak.log, engine.prefix_cache.evictions)
            failed = soak.log.over_budget or soak.log.disagreements
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
