"""A prompt-lookup chat sent while another chat streams, on the llama.cpp engine.

Chat A (plain, greedy) starts; at its first token chat B (prompt lookup, a prompt it copies
from) is sent. Reports B's time to first token (from its submit), both chats' decode rates,
A's inter-token latency while both stream, and the wall time until both are done. Uses only
the engine's public API, so the same command runs on checkouts before and after a change
(alternate them: `git worktree add /tmp/before REV`, then run this file from each tree).
Measures, never asserts.

    .venv/bin/python benchmarks/speculative_beside.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from typing import Any

from engine import GenerationRequest, SamplingParams
from engine.events import RequestFinished, TokenEmitted
from engine.machine import cpu_name
from engine.params import ChatMessage
from engine.runtimes import LLAMA_CPP
from engine.worker import Engine

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"


def _requests(tokens_a: int, tokens_b: int, run: int, speculative: str | None
              ) -> tuple[GenerationRequest, ...]:
    plain = GenerationRequest([ChatMessage("user", "Write a short poem about the sea.")],
                              SamplingParams(temperature=0.0, max_tokens=tokens_a,
                                             ignore_eos=True), conversation_id=f"a{run}")
    spec = GenerationRequest(
        [ChatMessage("user", f"Repeat these words four times: {WORDS} {WORDS}")],
        SamplingParams(temperature=0.0, max_tokens=tokens_b, ignore_eos=True),
        conversation_id=f"b{run}", speculative=speculative)
    return plain, spec


def one_run(engine: Engine, run: int, tokens_a: int, tokens_b: int,
            speculative: str | None = "ngram") -> dict[str, Any]:
    plain, spec = _requests(tokens_a, tokens_b, run, speculative)
    first = engine.submit(plain)
    stream = first.events(timeout=300)
    a_tokens = [next(e.t_ns for e in stream if isinstance(e, TokenEmitted))]
    second = engine.submit(spec)
    b_events = list(second.events(timeout=300))
    for event in stream:
        if isinstance(event, TokenEmitted):
            a_tokens.append(event.t_ns)
        if isinstance(event, RequestFinished):
            break
    a, b = first.wait(300), second.wait(300)
    b_tokens = [e.t_ns for e in b_events if isinstance(e, TokenEmitted)]
    overlap = [t2 - t1 for t1, t2 in itertools.pairwise(a_tokens)
               if b_tokens[0] <= t1 and t2 <= b_tokens[-1]]
    return {"b_ttft_ms": b.metrics.ttft_s * 1e3,
            "b_decode_tok_s": b.metrics.decode_tok_s,
            "b_accepted": f"{b.spec_accepted}/{b.spec_proposed}",
            "a_decode_tok_s": a.metrics.decode_tok_s,
            "a_itl_while_both_ms": statistics.median(overlap) * 1e-6 if overlap else None,
            "wall_s": (max(a_tokens[-1], b_tokens[-1]) - a_tokens[0]) * 1e-9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens-a", type=int, default=128)
    parser.add_argument("--tokens-b", type=int, default=64)
    parser.add_argument("--plain-b", action="store_true", help="chat B without speculation")
    args = parser.parse_args()
    runs = []
    with Engine() as engine:
        info = engine.load_model_sync("default", engine=LLAMA_CPP)
        one_run(engine, -1, 16, 8)  # warm-up
        for run in range(args.repeats):
            runs.append(one_run(engine, run, args.tokens_a, args.tokens_b,
                                None if args.plain_b else "ngram"))
    medians = {key: statistics.median(r[key] for r in runs) for key in runs[0]
               if all(isinstance(r[key], float) for r in runs)}
    print(json.dumps({"cpu": cpu_name(),
                      "kernel": info.kernel, "runs": runs, "median": medians}, indent=1))


if __name__ == "__main__":
    main()
