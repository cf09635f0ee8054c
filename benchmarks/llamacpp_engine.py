"""The llama.cpp engine against llama-cpp-python's own Llama.generate(), in one process.

Same GGUF, same threads, same prompt ids; runs alternate (ours, theirs, ours, ...) so drift
in machine load hits both alike. Prints medians and ratios (above 1: ours is better), the
prefix cache's multi-turn TTFT against a cold prompt, and prompt-lookup speculation. Measures,
never asserts.

    .venv/bin/python benchmarks/llamacpp_engine.py [--repeats 5] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
from typing import Any

from engine.metrics import RequestTimeline, now_ns
from engine.model_files import default_gguf_path
from engine.params import GenerationRequest, SamplingParams
from engine.runtimes import LLAMA_CPP, load
from engine.tools.bench import fixed_prompt_ids, settle
from engine.tools.peers import greedy_run


def ours(runtime: Any, ids: list[int], max_tokens: int, speculative: str | None = None,
         pool: Any = None, conversation: str | None = None, reuse: bool = False) -> Any:
    request = GenerationRequest(
        [], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        prompt_token_ids=ids, reuse_cache=reuse, speculative=speculative,
        conversation_id=conversation)
    pool = pool or runtime.new_prefix_cache(1 << 40)
    return runtime.new_session(pool).run(request, RequestTimeline(now_ns()), threading.Event(),
                                         lambda _e: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    args = parser.parse_args()
    import llama_cpp

    runtime = load("default", LLAMA_CPP)
    settle(runtime)  # as the app's engine does while idle

    loaded = runtime.model
    llm = llama_cpp.Llama(model_path=str(default_gguf_path()), n_ctx=2048,
                          n_threads=loaded.n_threads, n_threads_batch=loaded.n_threads,
                          flash_attn=loaded.info.kernel.endswith("-fa"),  # as ours
                          verbose=False)
    ids = fixed_prompt_ids(loaded, args.prompt_tokens)
    ours(runtime, ids[:16], 4)
    greedy_run(llm, ids[:16], 4)
    mine, peer, spec = [], [], []
    for _ in range(args.repeats):
        mine.append(ours(runtime, ids, args.max_tokens))
        peer.append(greedy_run(llm, ids, args.max_tokens))
        spec.append(ours(runtime, ids, args.max_tokens, speculative="ngram"))
    med = statistics.median
    decode = med(r.metrics.decode_tok_s for r in mine)
    ttft = med(r.metrics.ttft_s for r in mine)
    peer_decode = med(r.decode_tok_s for r in peer)
    peer_ttft = med(r.ttft_s for r in peer)
    report = {
        "cpu": platform.processor() or platform.machine(), "threads": loaded.n_threads,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "decode_tok_s": decode, "llama_cpp_decode_tok_s": peer_decode,
        "decode_ratio_vs_llama_cpp": decode / peer_decode,
        "ttft_s": ttft, "llama_cpp_ttft_s": peer_ttft, "ttft_ratio_vs_llama_cpp": peer_ttft / ttft,
        "greedy_identical": all(r.token_ids == peer[0].token_ids for r in mine),
        "spec_decode_tok_s": med(r.metrics.decode_tok_s for r in spec),
        "spec_accept_rate": sum(r.spec_accepted for r in spec)
        / max(1, sum(r.spec_proposed for r in spec)),
        "spec_identical": all(r.token_ids == mine[0].token_ids for r in spec),
    }
    report["spec_speedup"] = report["spec_decode_tok_s"] / decode
    report.update(turns(runtime, llm, ids, args))
    llm.close()
    print(json.dumps(report, indent=1))


def turns(runtime: Any, llm: Any, ids: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Turn 2 of a chat whose turn 1 is cached, against llama.cpp prefilling it cold."""
    pool = runtime.new_prefix_cache(1 << 40)
    first = ours(runtime, ids, 16, pool=pool, conversation="chat", reuse=True)
    second_prompt = ids + first.token_ids[:-1] + ids[:32]
    cached, cold = [], []
    for _ in range(args.repeats):
        pool.drop("chat")
        ours(runtime, ids, 16, pool=pool, conversation="chat", reuse=True)
        cached.append(ours(runtime, second_prompt, 2, pool=pool, conversation="chat",
                           reuse=True))
        cold.append(greedy_run(llm, second_prompt, 2))
    med = statistics.median
    return {"turn2_prompt_tokens": len(second_prompt),
            "turn2_cached_tokens": cached[0].metrics.cached_tokens,
            "turn2_ttft_s": med(r.metrics.ttft_s for r in cached),
            "llama_cpp_cold_ttft_s": med(r.ttft_s for r in cold),
            "turn2_ttft_ratio_vs_llama_cpp_cold": med(r.ttft_s for r in cold)
            / med(r.metrics.ttft_s for r in cached)}


if __name__ == "__main__":
    main()
