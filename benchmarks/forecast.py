"""The wait forecast against the wait: predicted vs measured time to first token.

One engine, as the window runs it: each message is forecast before it is sent (the cached
prefix from peek_prefix, the prefill cost line fitted to the replies so far), then sent, and
its reply becomes the next observation. A few short chats start the session (the window too
says no time until it has seen three replies); then new chats of --sizes prompt tokens, each
followed by a short next turn in the same chat (mostly cached). Prints forecast, actual and
their ratio per message, and the distribution of ratios for prompts of 1,000 tokens or more.

    .venv/bin/python benchmarks/forecast.py --engine llama.cpp [--sizes 1000 2000 4000 6000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from resume import long_text

from engine import ChatMessage, GenerationRequest, SamplingParams
from engine.forecast import PrefillCost
from engine.worker import Engine

WORDS_PER_TOKEN = 1 / 1.15


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="llama.cpp", choices=("llama.cpp", "torch"))
    parser.add_argument("--model", default="default")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000, 3000, 4000, 6000])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cost, rows = PrefillCost(), []
    with Engine() as engine:
        engine.load_model_sync(args.model, engine=args.engine)

        def send(conv: str, messages: list[ChatMessage]) -> None:
            request = GenerationRequest(messages, params, conversation_id=conv)
            peek = engine.peek_prefix(request)
            assert peek is not None
            forecast = cost.seconds(peek.cached_tokens, peek.prompt_tokens, peek.from_disk)
            result = engine.submit(request).wait(900)
            m = result.metrics
            rows.append({"prompt": m.prompt_tokens, "cached": m.cached_tokens,
                         "forecast_s": forecast, "ttft_s": m.ttft_s,
                         "ratio": m.ttft_s / forecast if forecast else None})
            cost.add(m.cached_tokens, m.prompt_tokens, m.prefill_s, m.restored_tokens,
                     m.restore_s)
            messages.append(result.as_message())

        for i, words in enumerate((60, 200, 400)):  # the session's first replies
            send(f"warm{i}", [ChatMessage("user", long_text(words, seed=i))])
        for size in args.sizes:
            chat = [ChatMessage("user", long_text(int(size * WORDS_PER_TOKEN), seed=size))]
            send(f"chat{size}", chat)
            chat.append(ChatMessage("user", "And in one sentence?"))
            send(f"chat{size}", chat)
    long = [r["ratio"] for r in rows if r["ratio"] and r["prompt"] - r["cached"] >= 1000]
    summary = {"engine": args.engine, "rows": rows,
               "long_prompts": {"n": len(long), "min": min(long, default=None),
                                "median": statistics.median(long) if long else None,
                                "max": max(long, default=None)}}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"engine {args.engine}: forecast vs actual time to first token")
    print(f"{'prompt':>8} {'cached':>8} {'forecast':>10} {'actual':>10} {'actual/forecast':>16}")
    for r in rows:
        f = f"{r['forecast_s'] * 1e3:8.0f} ms" if r["forecast_s"] else "      none"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        print(f"{r['prompt']:8,} {r['cached']:8,} {f:>10} {r['ttft_s'] * 1e3:7.0f} ms "
              f"{ratio:>16}")
    s = summary["long_prompts"]
    if s["n"]:
        print(f"new prompts of 1,000+ tokens: {s['n']}, actual/forecast min {s['min']:.2f} "
              f"median {s['median']:.2f} max {s['max']:.2f}")


if __name__ == "__main__":
    main()
