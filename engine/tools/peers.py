"""Peers for `phasewise bench --vs`: other inference stacks timed like our decode loop.

Each peer decodes the same prompt ids greedily for exactly max_tokens tokens and is timed on
one monotonic clock (perf_counter_ns) with a stamp per token, so TTFT (first token - start),
ITL (gaps between tokens) and decode tok/s follow the definitions in engine.metrics.

The llama.cpp peer runs the same GGUF file our default model is converted from, through
llama-cpp-python (an optional dependency: `make peers`), in a child process (engine.native):
this process never loads llama.cpp's native code, so a crash there cannot take it down.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.events import ModelInfo
from engine.model_files import default_gguf_path
from engine.native import ChildError, NativeChild, NativeCrashError, recorded_llama_cpp_build
from engine.runtimes.llamacpp.cpu_backend import ensure_cpu_backend, system_info

LLAMA_CPP_MISSING = "llama.cpp peer needs llama-cpp-python: run `make peers`"
PEER_SEED = 1234  # fixed, although greedy decoding never draws from it
PEER_NAME = "llama.cpp peer"
LOAD_TIMEOUT_S = 300.0  # generous: a 2-core machine under load
RUN_TIMEOUT_S = 600.0


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


def require_llama_cpp() -> None:
    """ModelLoadError unless llama-cpp-python is installed; checked without importing it, so
    no native code runs in this process."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise ModelLoadError(LLAMA_CPP_MISSING)


class LlamaCppPeer:
    """llama.cpp on one GGUF with a fixed thread count, run in a child process; each run
    starts cold.

    llama.cpp picks its kernels by itself, and a CPU may fault on one it advertises (AMX in a
    VM: SIGILL). In a child, such a crash raises NativeCrashError here, naming the signal and
    llama.cpp's compiled CPU features, and this process carries on. The child reports those
    features before it loads the model, so even a crash while loading names them.
    """

    def __init__(self, gguf: Path, *, n_threads: int, n_ctx: int, flash_attn: bool = False,
                 child_main: Callable[..., None] | None = None) -> None:
        self.n_threads = n_threads
        self.flash_attn = flash_attn
        self._child = NativeChild(child_main or serve_llama_cpp, str(gguf), n_threads, n_ctx,
                                  flash_attn, what=PEER_NAME,
                                  build=recorded_llama_cpp_build())
        try:
            about = self._child.receive(LOAD_TIMEOUT_S)
            self.version: str = about["version"]
            self.system_info: str = about["system_info"] or self._child.build
            self._child.build = self.system_info
            self._child.receive(LOAD_TIMEOUT_S)  # loaded
        except ChildError as exc:
            self._child.close()
            raise ModelLoadError(str(exc)) from None
        except NativeCrashError:
            self._child.close()
            raise

    def run(self, prompt_ids: list[int], max_tokens: int) -> PeerResult:
        """Exactly max_tokens greedy tokens (EOS does not stop it), prompt prefilled cold;
        timed in the child."""
        result: PeerResult = self._child.call((list(prompt_ids), max_tokens), RUN_TIMEOUT_S)
        return result

    def close(self) -> None:
        self._child.close()

    def __enter__(self) -> LlamaCppPeer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


# ----- in the child -------------------------------------------------------------------------
def serve_llama_cpp(conn: Connection, gguf: str, n_threads: int, n_ctx: int,
                    flash_attn: bool) -> None:
    """The child's main: report version and CPU features, load, then answer (prompt_ids,
    max_tokens) requests with PeerResults until a None arrives."""
    llama_cpp = import_llama_cpp()
    # The CPU backend variant ours runs (cached when ours loaded; chosen by score if not: this
    # daemonic child cannot start the smoke runs' children).
    ensure_cpu_backend(llama_cpp, None)
    conn.send(("about", {"version": getattr(llama_cpp, "__version__", "unknown"),
                         "system_info": system_info(llama_cpp)}))
    llm = _load(llama_cpp, Path(gguf), n_threads=n_threads, n_ctx=n_ctx, flash_attn=flash_attn)
    conn.send(("loaded", None))
    try:
        while (request := conn.recv()) is not None:
            prompt_ids, max_tokens = request
            conn.send(("result", greedy_run(llm, prompt_ids, max_tokens)))
    finally:
        llm.close()


def _load(llama_cpp: Any, gguf: Path, *, n_threads: int, n_ctx: int, flash_attn: bool) -> Any:
    try:
        return llama_cpp.Llama(
            model_path=str(gguf), n_ctx=n_ctx, n_threads=n_threads,
            n_threads_batch=n_threads, seed=PEER_SEED, verbose=False, flash_attn=flash_attn,
        )
    except (ValueError, RuntimeError) as exc:  # llama-cpp-python's load failures
        raise ModelLoadError(f"llama.cpp could not load {gguf}: {exc}") from None


def greedy_run(llm: Any, prompt_ids: list[int], max_tokens: int) -> PeerResult:
    """Exactly max_tokens greedy tokens from a llama_cpp.Llama, each stamped as it arrives."""
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
