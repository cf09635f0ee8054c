"""Peers for `phasewise bench --vs`: other inference stacks timed like our decode loop.

Each peer decodes the same prompt ids greedily for exactly max_tokens tokens and is timed on
one monotonic clock (perf_counter_ns) with a stamp per token, so TTFT (first token - start),
ITL (gaps between tokens) and decode tok/s follow the definitions in engine.metrics.

The llama.cpp peer runs the same GGUF file our default model is converted from, through
llama-cpp-python (an optional dependency: `make peers`), imported only when asked for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.events import ModelInfo
from engine.loader import default_gguf_path

LLAMA_CPP_MISSING = "llama.cpp peer needs llama-cpp-python: run `make peers`"
PEER_SEED = 1234  # fixed, although greedy decoding never draws from it


@dataclass
class PeerResult:
    """One peer run: TTFT and decode speed by the engine's definitions, plus the raw ITL."""

    ttft_s: float
    decode_tok_s: float
    itl_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # when the peer exposes them


def result_from_stamps(start_ns: int, token_ns: list[int]) -> PeerResult:
    """TTFT = first token - start; ITL = gaps between tokens; decode = (n - 1) / span."""
    if not token_ns:
        return PeerResult(ttft_s=0.0, decode_tok_s=0.0)
    itl = [(b - a) / 1e9 for a, b in pairwise(token_ns)]
    span_s = (token_ns[-1] - token_ns[0]) / 1e9
    return PeerResult(ttft_s=(token_ns[0] - start_ns) / 1e9,
                      decode_tok_s=len(itl) / span_s if span_s > 0 else 0.0, itl_s=itl)


def import_llama_cpp() -> Any:
    """The llama_cpp module, or ModelLoadError with the one line that says how to get it."""
    try:
        import llama_cpp
    except ImportError:
        raise ModelLoadError(LLAMA_CPP_MISSING) from None
    return llama_cpp


def gguf_for(info: ModelInfo) -> Path:
    """The GGUF file behind a loaded model: llama.cpp can only run the same weights from one."""
    if info.source == "default":
        return default_gguf_path()
    if info.source == "gguf":
        return Path(info.path)
    raise ModelLoadError(f"the llama.cpp peer needs a GGUF model; {info.name} came from a "
                         f"{info.source} (use --model default or --model FILE.gguf)")


class LlamaCppPeer:
    """A llama_cpp.Llama on one GGUF with a fixed thread count; each run starts cold."""

    def __init__(self, gguf: Path, *, n_threads: int, n_ctx: int) -> None:
        llama_cpp = import_llama_cpp()
        try:
            self._llm = llama_cpp.Llama(
                model_path=str(gguf), n_ctx=n_ctx, n_threads=n_threads,
                n_threads_batch=n_threads, seed=PEER_SEED, verbose=False,
            )
        except (ValueError, RuntimeError) as exc:  # llama-cpp-python's load failures
            raise ModelLoadError(f"llama.cpp could not load {gguf}: {exc}") from None
        self.n_threads = n_threads
        self.version = getattr(llama_cpp, "__version__", "unknown")

    def run(self, prompt_ids: list[int], max_tokens: int) -> PeerResult:
        """Exactly max_tokens greedy tokens (EOS does not stop it), prompt prefilled cold."""
        llm = self._llm
        llm.reset()  # drop the previous run's KV entries: no prefix reuse across runs
        stamps: list[int] = []
        tokens: list[int] = []
        start = time.perf_counter_ns()
        for token in llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                  repeat_penalty=1.0):
            stamps.append(time.perf_counter_ns())
            tokens.append(token)
            if len(tokens) >= max_tokens:
                break
        result = result_from_stamps(start, stamps)
        result.token_ids = tokens
        return result

    def close(self) -> None:
        self._llm.close()

    def __enter__(self) -> LlamaCppPeer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
