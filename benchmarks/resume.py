"""A long chat's next turn after a restart: read back from its KV snapshot vs read again.

Each "app start" is a new process with a new Engine on the same snapshot folder:

  start 1: a chat of --tokens prompt tokens gets its first reply; its snapshot is written
           (the time from the reply's end until the file is on disk is reported);
  start 2: the chat's next turn (restored from disk), then the same turn cold (another chat,
           reuse off); then a reply streamed --rounds times while a snapshot of the long chat
           is written beside it, and as many times with the shelf off, alternating: the
           streaming reply's ITL p99 with and without.

Greedy replies: the restored reply must equal the cold one. Prints a table (and --json).

    .venv/bin/python benchmarks/resume.py --engine llama.cpp [--tokens 6000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = ["river", "stone", "market", "winter", "garden", "letter", "engine", "window",
         "harbor", "mountain", "lantern", "village", "morning", "silver", "thunder", "meadow",
         "bridge", "candle", "forest", "journey", "ocean", "castle", "whisper", "shadow",
         "orchard", "compass", "festival", "library", "painter", "sailor", "weaver"]


def long_text(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        n = rng.randint(8, 16)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
    return " ".join(sentences)


def _engine(folder: str, spec: str, runtime: str) -> Any:
    from engine import Engine

    engine = Engine(snapshot_dir=Path(folder)).start()
    engine.load_model_sync(spec, engine=runtime)
    return engine


def _ask(engine: Any, conv: str, messages: list, tokens: int, reuse: bool = True) -> Any:
    from engine import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return engine.submit(GenerationRequest(list(messages), params, conversation_id=conv,
                                           reuse_cache=reuse)).wait(900)


def start_one(folder: str, spec: str, runtime: str, words: int) -> dict:
    from engine import ChatMessage

    engine = _engine(folder, spec, runtime)
    messages = [ChatMessage("system", "You are a patient reader."),
                ChatMessage("user", "Here is my diary:\n\n" + long_text(words) +
                            "\n\nWhat is it about?")]
    first = _ask(engine, "diary", messages, 16)
    ended = time.perf_counter()
    shelf = engine.prefix_cache.shelf
    shelf.flush(300)
    write_s = time.perf_counter() - ended
    engine.shutdown()
    files = list(Path(folder).rglob("*.kv"))
    return {"messages": [*messages, first.as_message()], "write_s": write_s,
            "file_bytes": sum(f.stat().st_size for f in files),
            "tokens": first.metrics.prompt_tokens + len(first.token_ids) - 1,
            "cold_first_ttft_s": first.metrics.ttft_s}


def start_two(folder: str, spec: str, runtime: str, history: list, rounds: int) -> dict:
    from engine import ChatMessage

    engine = _engine(folder, spec, runtime)
    turn = [*history, ChatMessage("user", "Now say it in one sentence.")]
    warm = _ask(engine, "diary", turn, 24)
    cold = _ask(engine, "cold", turn, 24, reuse=False)
    itl = _itl_while_writing(engine, turn, rounds)
    engine.shutdown()
    m = warm.metrics
    return {"warm_ttft_s": m.ttft_s, "cold_ttft_s": cold.metrics.ttft_s,
            "reason": m.cache_miss_reason, "restored_tokens": m.restored_tokens,
            "restored_bytes": m.restored_bytes, "restore_s": m.restore_s,
            "prompt_tokens": m.prompt_tokens, "same_reply": warm.token_ids == cold.token_ids,
            **itl}


def _itl_while_writing(engine: Any, turn: list, rounds: int) -> dict:
    """A streaming reply's ITL p99 while the long chat's next turn ends and its snapshot is
    written (shelf on), and the same with the shelf off; alternating rounds."""
    from engine import ChatMessage, GenerationRequest, SamplingParams
    from engine.metrics import percentiles

    pool = engine.prefix_cache
    shelf = pool.shelf
    p99: dict[str, list[float]] = {"with": [], "without": []}
    stream = [ChatMessage("user", "Write a long story about a lighthouse keeper.")]
    params = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    for i in range(rounds):
        for kind in ("with", "without") if i % 2 == 0 else ("without", "with"):
            pool.shelf = shelf if kind == "with" else None
            pool._on_shelf.clear()  # write the long chat again each round
            handle = engine.submit(GenerationRequest(stream, params, conversation_id=f"s{i}"))
            time.sleep(0.3)  # the stream is decoding
            ask = [*turn, ChatMessage("assistant", "Fine."), ChatMessage("user", f"#{i}")]
            _ask(engine, "diary", ask, 1)
            result = handle.wait(900)
            shelf.flush(300)
            p99[kind].append(percentiles(result.metrics.itl_s, (99,))[0])
    pool.shelf = shelf
    return {"itl_p99_with_s": statistics.median(p99["with"]),
            "itl_p99_without_s": statistics.median(p99["without"])}


def run(spec: str, runtime: str, words: int, rounds: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="phasewise-resume-") as folder, \
            ctx.Pool(1, maxtasksperchild=1) as pool:
        one = pool.apply(start_one, (folder, spec, runtime, words))
        two = pool.apply(start_two, (folder, spec, runtime, one["messages"], rounds))
    one.pop("messages")
    return {"engine": runtime, **one, **two,
            "restored_vs_cold": two["warm_ttft_s"] / two["cold_ttft_s"],
            "bytes_per_token": one["file_bytes"] / one["tokens"],
            "itl_p99_ratio": two["itl_p99_with_s"] / two["itl_p99_without_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="llama.cpp", choices=("llama.cpp", "torch"))
    parser.add_argument("--model", default="default")
    parser.add_argument("--words", type=int, default=4_000, help="diary words (~1.5 tokens each)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    r = run(args.model, args.engine, args.words, args.rounds)
    if args.json:
        print(json.dumps(r, indent=2))
        return
    print(f"engine {r['engine']}: a {r['prompt_tokens']:,}-token turn after a restart "
          f"({r['reason']}, {r['restored_tokens']:,} tokens restored)")
    print(f"  TTFT cold      {r['cold_ttft_s'] * 1e3:9.0f} ms")
    print(f"  TTFT restored  {r['warm_ttft_s'] * 1e3:9.0f} ms   x{r['restored_vs_cold']:.3f} "
          f"(restore {r['restore_s'] * 1e3:.0f} ms)   same reply: {r['same_reply']}")
    print(f"  snapshot       {r['file_bytes'] / 1e6:9.1f} MB   {r['bytes_per_token']:,.0f} B/token"
          f"   written {r['write_s'] * 1e3:.0f} ms after the reply")
    print(f"  ITL p99 of a stream while a snapshot is written: "
          f"{r['itl_p99_with_s'] * 1e3:.1f} ms vs {r['itl_p99_without_s'] * 1e3:.1f} ms "
          f"without (x{r['itl_p99_ratio']:.2f})")


if __name__ == "__main__":
    main()
