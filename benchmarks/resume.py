"""A long chat's next turn after a restart: read back from its KV snapshot vs read again.

Each "app start" is a new process with a new Engine on the same snapshot folder:

  start 1: a chat of --words words (~1.15 tokens each) gets its first reply; its snapshot
           is written (the time from the reply's end until the file is on disk is reported);
  start 2: the chat's next turn (restored from disk), then the same turn cold (another chat,
           reuse off): the restored reply must equal the one start 1 gave the same turn from
           memory (the same KV, another chat borrowing the prefix), and is set against the cold
           one (greedy replies may part at a near-tie: a cold prefill batches the prompt
           otherwise, so its KV differs in the last bits); then a reply streamed --rounds
           times just after the long chat's next turn ended (its snapshot taken and being
           written: the writer works only while the engine is idle), and as many times with
           the shelf off, alternating: the streaming reply's ITL p99 with and without.

Prints a table (and --json).

    .venv/bin/python benchmarks/resume.py --engine llama.cpp [--words 5200]
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

NEXT = "Now say it in one sentence."
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
    from engine.worker import Engine

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
    while not (files := list(Path(folder).rglob("*.kv"))):  # taken once idle, then written
        time.sleep(0.01)
    write_s = time.perf_counter() - ended
    file_bytes = files[0].stat().st_size
    history = [*messages, first.as_message()]
    memory = _ask(engine, "borrower", [*history, ChatMessage("user", NEXT)], 24)
    shelf.flush(300)
    engine.shutdown()
    return {"messages": history, "write_s": write_s, "memory_ids": memory.token_ids,
            "file_bytes": file_bytes,
            "tokens": first.metrics.prompt_tokens + len(first.token_ids) - 1,
            "cold_first_ttft_s": first.metrics.ttft_s}


def start_two(folder: str, spec: str, runtime: str, history: list, rounds: int) -> dict:
    from engine import ChatMessage

    engine = _engine(folder, spec, runtime)
    turn = [*history, ChatMessage("user", NEXT)]
    warm = _ask(engine, "diary", turn, 24)
    cold = _ask(engine, "cold", turn, 24, reuse=False)
    itl = _itl_while_writing(engine, turn, rounds)
    engine.shutdown()
    m = warm.metrics
    return {"warm_ttft_s": m.ttft_s, "cold_ttft_s": cold.metrics.ttft_s,
            "reason": m.cache_miss_reason, "restored_tokens": m.restored_tokens,
            "restored_bytes": m.restored_bytes, "restore_s": m.restore_s,
            "prompt_tokens": m.prompt_tokens, "restored_ids": warm.token_ids,
            "cold_ids": cold.token_ids, **itl}


def _itl_while_writing(engine: Any, turn: list, rounds: int) -> dict:
    """A reply's ITL p99 when it starts just as the long chat's next turn ended (its snapshot
    taken and being written: shelf on) and the same with the shelf off; alternating rounds."""
    from engine import ChatMessage, GenerationRequest, SamplingParams
    from engine.metrics import percentiles

    pool = engine.prefix_cache
    shelf = pool.shelf
    p99: dict[str, list[float]] = {"with": [], "without": []}
    stream = [ChatMessage("user", "Write a long story about a lighthouse keeper.")]
    params = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    for i in range(rounds):
        for kind in ("with", "without") if i % 2 == 0 else ("without", "with"):
            pool.shelf = shelf if kind == "with" else None  # the engine is idle here
            ask = [*turn, ChatMessage("assistant", "Fine."), ChatMessage("user", f"#{i}")]
            _ask(engine, "diary", ask, 1)
            time.sleep(0.2)  # the idle engine copies the chat's KV out; the writer starts
            handle = engine.submit(GenerationRequest(stream, params, conversation_id=f"s{i}"))
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
    restored, memory, cold = two.pop("restored_ids"), one.pop("memory_ids"), two.pop("cold_ids")
    pairs = enumerate(zip(restored, cold, strict=True))
    agree = next((i for i, (a, b) in pairs if a != b), len(restored))
    return {"engine": runtime, **one, **two, "same_as_memory": restored == memory,
            "agrees_with_cold_for": agree, "reply_tokens": len(restored),
            "restored_vs_cold": two["warm_ttft_s"] / two["cold_ttft_s"],
            "bytes_per_token": one["file_bytes"] / one["tokens"],
            "itl_p99_ratio": two["itl_p99_with_s"] / two["itl_p99_without_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="llama.cpp", choices=("llama.cpp", "torch"))
    parser.add_argument("--model", default="default")
    parser.add_argument("--words", type=int, default=5_200, help="diary words (~1.15 tokens each)")
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
          f"(restore {r['restore_s'] * 1e3:.0f} ms)")
    print(f"  reply          the same as from memory: {r['same_as_memory']}; as cold: "
          f"{r['agrees_with_cold_for']} of {r['reply_tokens']} tokens before they part")
    print(f"  snapshot       {r['file_bytes'] / 1e6:9.1f} MB   {r['bytes_per_token']:,.0f} B/token"
          f"   on disk {r['write_s'] * 1e3:.0f} ms after the reply ended")
    print(f"  ITL p99 of a stream while a snapshot is written: "
          f"{r['itl_p99_with_s'] * 1e3:.1f} ms vs {r['itl_p99_without_s'] * 1e3:.1f} ms "
          f"without (x{r['itl_p99_ratio']:.2f})")


if __name__ == "__main__":
    main()
