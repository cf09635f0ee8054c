"""How many next turns reuse the whole previous reply (issue 28, item 0).

For each seed: a sampled reply (temperature 0.7, up to --tokens tokens) to PROMPT, then
"Now make it shorter." as the next turn, on the bundled model. The next turn runs twice on
the same cached first turn: "before", the reply sent as text only (re-tokenized, as before the
fix), and "after", the reply with the ids its model produced (GenerationResult.as_message).
A next turn reuses the whole reply when its cached tokens are everything the first turn left
in the cache: its prompt and every reply token fed back. Prints counts (not times: they hold on
a loaded machine).

    .venv/bin/python benchmarks/reply_reuse.py [--engine llama.cpp] [--seeds 8] [--tokens 400]
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

# The engine of the checkout this file is in, not the installed one: two builds compared.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import runtimes
from engine.events import GenerationResult
from engine.metrics import RequestTimeline, now_ns
from engine.params import ChatMessage, GenerationRequest, SamplingParams

PROMPT = "Write a long, detailed story about a lighthouse keeper and a storm."
NEXT = "Now make it shorter."


def turn(loaded: Any, pool: Any, messages: list[ChatMessage], seed: int, conversation: str,
         tokens: int, *, reuse: bool = True) -> GenerationResult:
    request = GenerationRequest(list(messages),
                                SamplingParams(temperature=0.7, max_tokens=tokens, seed=seed),
                                conversation_id=conversation, reuse_cache=reuse)
    return runtimes.new_session(loaded, pool).run(request, RequestTimeline(now_ns()),
                                                  threading.Event(), lambda _e: None)


def next_turn(loaded: Any, pool: Any, seed: int, tokens: int, with_ids: bool) -> dict[str, Any]:
    """A first turn on its own chat, then the next turn; what the next turn reused."""
    conversation = f"seed{seed}-{'after' if with_ids else 'before'}"
    first_messages = [ChatMessage("user", PROMPT)]
    # Cold, so both runs of a seed compute the same logits and sample the same reply (a
    # prefix borrowed from the other run's chat would shift near-ties); kept as the chat's own.
    first = turn(loaded, pool, first_messages, seed, conversation, tokens, reuse=False)
    reply = first.as_message() if with_ids else ChatMessage("assistant", first.text)
    second = turn(loaded, pool, [*first_messages, reply, ChatMessage("user", NEXT)], seed,
                  conversation, 1)
    held = len(first.prompt_token_ids) + len(first.token_ids) - 1  # what the cache holds
    m = second.metrics
    return {"reply_tokens": len(first.token_ids), "held": held, "prompt": m.prompt_tokens,
            "cached": m.cached_tokens, "reason": m.cache_miss_reason,
            "whole": m.cached_tokens == held, "reply_ids": first.token_ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("llama.cpp", "torch"), default="llama.cpp")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=400)
    args = parser.parse_args()
    loaded = runtimes.load("default", args.engine)
    pool = runtimes.new_prefix_cache(loaded, budget_bytes=1 << 40)
    print(f"{loaded.info.name} on {args.engine}, {args.seeds} seeds, replies of up to "
          f"{args.tokens} tokens, temperature 0.7")
    whole = {False: 0, True: 0}
    for seed in range(args.seeds):
        rows = {with_ids: next_turn(loaded, pool, seed, args.tokens, with_ids)
                for with_ids in (False, True)}
        # Both runs sample the same reply (same seed, same prompt); else the seeds compare
        # nothing.
        assert rows[False]["reply_ids"] == rows[True]["reply_ids"], seed
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
