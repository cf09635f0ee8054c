"""How many next turns reuse the whole previous reply (issue 28, item 0).

For each seed: a sampled reply (temperature 0.7, up to --tokens tokens) to PROMPT, then
"Now make it shorter." as the next turn, on the bundled model, sending the reply with the ids
its model produced (GenerationResult.as_message): "after". "Before" is the same next turn with
the reply as text only (re-tokenized, as before the fix), counted by the ledger's own rule on
the same cache (the longest common prefix of the ids the cache holds and that prompt): two runs
of one seed need not sample the same 400 tokens (llama.cpp's sums vary with where a sequence
sits in the KV memory), so it is not run. A next turn reuses the whole reply when its cached
tokens are everything the first turn left in the cache: its prompt and every reply token fed
back. Prints counts (not times: they hold on a loaded machine).

    .venv/bin/python benchmarks/reply_reuse.py [--engine llama.cpp] [--seeds 8] [--tokens 400]
        [--temperature 0.7]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import threading
from pathlib import Path
from typing import Any

# The engine of the checkout this file is in, not the installed one: two builds compared.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import runtimes
from engine.core.ledger import common_prefix_len
from engine.core.prompt import prepare_prompt
from engine.events import GenerationResult
from engine.metrics import RequestTimeline, now_ns
from engine.params import ChatMessage, GenerationRequest, SamplingParams

PROMPT = "Write a long, detailed story about a lighthouse keeper and a storm."
NEXT = "Now make it shorter."


def turn(runtime: Any, pool: Any, messages: list[ChatMessage], seed: int, conversation: str,
         params: SamplingParams) -> GenerationResult:
    request = GenerationRequest(list(messages), dataclasses.replace(params, seed=seed),
                                conversation_id=conversation)
    return runtime.new_session(pool).run(request, RequestTimeline(now_ns()),
                                                  threading.Event(), lambda _e: None)


def next_turn(runtime: Any, pool: Any, seed: int,
              params: SamplingParams) -> dict[bool, dict[str, Any]]:
    """A first turn on its own chat, then the next turn: what it reused without the reply's
    ids (counted) and with them (run)."""
    first_messages = [ChatMessage("user", PROMPT)]
    first = turn(runtime, pool, first_messages, seed, f"seed{seed}", params)
    held = first.prompt_token_ids + first.token_ids[:-1]  # what the cache holds now
    rows = {}
    text_only = [*first_messages, ChatMessage("assistant", first.text), ChatMessage("user", NEXT)]
    before = prepare_prompt(runtime, GenerationRequest(text_only)).ids
    cached = min(common_prefix_len(held, before), len(before) - 1)
    rows[False] = {"prompt": len(before), "cached": cached,
                   "reason": "none" if cached == len(held) else "template_mismatch"}
    second = turn(runtime, pool, [*first_messages, first.as_message(), ChatMessage("user", NEXT)],
                  seed, f"seed{seed}", dataclasses.replace(params, max_tokens=1))
    m = second.metrics
    rows[True] = {"prompt": m.prompt_tokens, "cached": m.cached_tokens,
                  "reason": m.cache_miss_reason}
    for row in rows.values():
        row.update(reply_tokens=len(first.token_ids), held=len(held),
                   whole=row["cached"] == len(held))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("llama.cpp", "torch"), default="llama.cpp")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens)
    runtime = runtimes.load("default", args.engine)
    pool = runtime.new_prefix_cache(budget_bytes=1 << 40)
    print(f"{runtime.info.name} on {args.engine}, {args.seeds} seeds, replies of up to "
          f"{args.tokens} tokens, temperature {args.temperature}")
    whole = {False: 0, True: 0}
    for seed in range(args.seeds):
        rows = next_turn(runtime, pool, seed, params)
        for with_ids, row in rows.items():
            whole[with_ids] += row["whole"]
            print(f"seed {seed} {'after ' if with_ids else 'before'}: reply "
                  f"{row['reply_tokens']} tokens, next prompt {row['prompt']}, cached "
                  f"{row['cached']} of {row['held']} held ({row['cached'] / row['prompt']:.0%}"
                  f" of the prompt), {row['reason']}", flush=True)
    print(f"whole reply reused: before {whole[False]} of {args.seeds}, "
          f"after {whole[True]} of {args.seeds}")


if __name__ == "__main__":
    main()
