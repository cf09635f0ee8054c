"""ggml's CPU backend as run-time variants: the best one this CPU runs, loaded before any model.

`make llama-cpp` compiles ggml's CPU backend several times over, never with -march=native
(GGML_BACKEND_DL with GGML_CPU_ALL_VARIANTS, a subset named in the Makefile): x64, haswell
(x86-64-v3), alderlake, skylakex (AVX-512), cascadelake and icelake (+ VNNI), zen4 (+ BF16),
sapphirerapids (+ AMX), each a `libggml-cpu-<variant>` library beside libllama. llama-cpp-python
loads none of them (it does not bind `ggml_backend_load_all`), so this module does, once per
process, before the first model loads:

1. In a child process (engine.native): each variant's `ggml_backend_score()` (0: the CPU lacks an
   instruction set the variant needs; higher: more of them), then the best-scoring variant is
   loaded and smoke-run on the bundled model (known_good_model: a file known to load; the one
   about to load where none is installed): a short prompt and a few tokens, flash
   attention on and off. A variant whose run dies (SIGILL: a VM that advertises AMX and faults
   on tile instructions) is skipped with the reason logged, and the next best is tried in a
   fresh child.
2. The choice is cached per CPU and build (`llama-cpu-backend.json` in the cache root): later
   starts load it directly, without a child.
3. This process loads it (`ggml_backend_load`); `llama_print_system_info()` then lists its
   features, and the kernel label names it (`llama.cpp-zen4-2t-fa`).

A build with the CPU backend linked in (no variants beside libllama: another architecture, a
custom LLAMA_CMAKE_ARGS) needs none of this: its variant is "built-in".
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import importlib.util
import logging
import multiprocessing
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.machine import cpu_fingerprint, read_json, write_json_entry
from engine.model_files import cache_root
from engine.native import ChildError, NativeChild, NativeCrashError

log = logging.getLogger(__name__)

BUILT_IN = "built-in"
CACHE_FILE = "llama-cpu-backend.json"
CACHE_MAX_ENTRIES = 16
SMOKE_TIMEOUT_S = 300.0  # per variant, from the child's start: a large model loads slowly
SMOKE_PROMPT_TOKENS = 16  # a batch: the matrix-matrix kernels (AMX faulted on "a few tokens")
SMOKE_DECODE_STEPS = 3  # single rows: the matrix-vector kernels
# The library names of the CPU backend's variants, per platform (a CMake MODULE library).
_VARIANT_PREFIX = "ggml-cpu-" if sys.platform == "win32" else "libggml-cpu-"
_VARIANT_SUFFIX = ".dll" if sys.platform == "win32" else ".so"
# libggml as libllama loaded it: by its soname, never another copy of the file (the wheel
# carries several), whose registry would be a second one that libllama never reads.
_GGML_NAMES = {"win32": ("ggml.dll",), "darwin": ("libggml.0.dylib", "libggml.dylib")}
_GGML_SONAMES = ("libggml.so.0", "libggml.so")


@dataclass(frozen=True)
class CpuBackend:
    """The CPU backend this process runs llama.cpp on: the variant's name ("zen4", or
    BUILT_IN), its library ("" for built-in), and the variants skipped with why."""

    variant: str
    path: str = ""
    skipped: dict[str, str] = field(default_factory=dict)


_loaded: CpuBackend | None = None
_child_log: Any = None  # the smoke child's log callback (ctypes: kept alive here)


def loaded_backend() -> CpuBackend | None:
    """What ensure_cpu_backend loaded in this process, or None before it ran."""
    return _loaded


def library_dir() -> Path:
    """Where llama-cpp-python loads libllama from (its LLAMA_CPP_LIB_PATH override included),
    found without importing it (that would load native code)."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise ModelLoadError("the llama.cpp engine needs llama-cpp-python: run `make llama-cpp`")
    return Path(spec.origin).parent / "lib"


def variant_files(directory: Path) -> dict[str, Path]:
    """{variant name: library} of the CPU backend variants in directory (none: built-in)."""
    found = {}
    for path in sorted(directory.glob(f"{_VARIANT_PREFIX}*{_VARIANT_SUFFIX}")):
        found[path.name.removeprefix(_VARIANT_PREFIX).removesuffix(_VARIANT_SUFFIX)] = path
    return found


def system_info(llama_cpp: Any) -> str:
    """llama.cpp's CPU features as the loaded backend reports them: 'CPU : SSE3 = 1 | ...'."""
    info = llama_cpp.llama_print_system_info()
    text = info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info)
    return " ".join(text.split()).removesuffix("|").strip()


def ensure_cpu_backend(llama_cpp: Any, smoke_model: Path | None, *,
                       progress: Any = None) -> CpuBackend:
    """Load the CPU backend variant this CPU runs best (once per process; module doc).
    smoke_model: the GGUF a variant's smoke run decodes when the choice is not cached yet and
    the bundled model is not installed; None chooses by score alone (as a process that cannot
    start children must: a test body's, the peer's). ModelLoadError with one line when no
    variant runs here."""
    global _loaded
    if _loaded is not None:
        return _loaded
    directory = library_dir()
    ggml = _libggml(directory)
    files = variant_files(directory)
    if not files or ggml.ggml_backend_reg_by_name(b"CPU"):
        _loaded = CpuBackend(BUILT_IN)
        return _loaded
    entry = read_cache(cache_key(files))
    if entry is None:
        if smoke_model is not None and _can_start_children():
            if progress:
                progress("choosing llama.cpp's CPU kernels (once per machine)")
            entry = choose_and_cache(files, smoke_model)
        else:
            entry = {"order": _by_score(_scores(files)), "skipped": {}}
    for name in entry["order"]:
        if name in entry["skipped"] or name not in files:
            continue
        if ggml.ggml_backend_load(str(files[name]).encode()):
            _loaded = CpuBackend(name, str(files[name]), dict(entry["skipped"]))
            log.info("llama.cpp CPU backend: %s (%s)", name, files[name].name)
            return _loaded
        entry["skipped"][name] = "ggml_backend_load refused it"
    raise ModelLoadError(no_variant_runs(entry["skipped"]))


def no_variant_runs(skipped: dict[str, str]) -> str:
    why = "; ".join(f"{name} {reason}" for name, reason in skipped.items())
    return ("no build of llama.cpp's CPU backend runs on this CPU"
            + (f" ({why})" if why else "") + ": use --engine torch")


def choose_and_cache(files: dict[str, Path], smoke_model: Path,
                     child_main: Callable[..., None] | None = None) -> dict[str, Any]:
    """choose() on the bundled model (known good) when there is one, else on smoke_model;
    cached for the next process unless the smoke model could not load (then its runs proved
    nothing: the next load tries again). Loads no native code here."""
    entry = choose(files, known_good_model() or smoke_model, child_main)
    if entry["unverified"] is None:
        write_cache(cache_key(files), entry)
    return entry


def known_good_model() -> Path | None:
    """The bundled default GGUF, if this installation has it: a file llama.cpp loads, so a
    smoke run's failure is the variant's, never the file's."""
    from engine.model_files import default_gguf_path

    try:
        return default_gguf_path()
    except ModelLoadError:
        return None


def choose(files: dict[str, Path], smoke_model: Path,
           child_main: Callable[..., None] | None = None) -> dict[str, Any]:
    """{"order": variants best first (score > 0), "scores", "skipped": {variant: why},
    "choice", "unverified": None, or why the choice's smoke run could not run} from smoke
    runs in child processes (child_main: a stand-in for tests); this process loads no native
    code. ModelLoadError when no variant runs."""
    skipped: dict[str, str] = {}
    while True:
        child = NativeChild(child_main or _probe_child, {n: str(p) for n, p in files.items()},
                            dict(skipped), str(smoke_model),
                            what="llama.cpp CPU backend smoke run")
        trying: str | None = None
        try:
            scores: dict[str, int] = child.receive(SMOKE_TIMEOUT_S)
            trying = child.receive(SMOKE_TIMEOUT_S)
            if trying is None:
                raise ModelLoadError(no_variant_runs(skipped))
            unverified: str | None = child.receive(SMOKE_TIMEOUT_S)
            if unverified is not None:
                log.info("llama.cpp CPU backend %s loaded, not smoke-run: %s", trying,
                         unverified)
            return {"order": _by_score(scores), "scores": scores, "skipped": skipped,
                    "choice": trying, "unverified": unverified}
        except (NativeCrashError, ChildError) as exc:
            reason = (exc.reason if isinstance(exc, NativeCrashError) else f"failed: {exc}")
            if trying is None:  # the scores themselves: no variant can be judged
                raise ModelLoadError(f"llama.cpp's CPU backend variants could not be probed "
                                     f"here ({reason}): use --engine torch") from None
            skipped[trying] = reason
            log.warning("llama.cpp CPU backend %s is skipped: its smoke run %s", trying, reason)
        finally:
            child.close()


def _by_score(scores: dict[str, int]) -> list[str]:
    return sorted((n for n, s in scores.items() if s > 0), key=lambda n: -scores[n])


def _can_start_children() -> bool:
    """A daemonic process (a test body's child, the peer's) may not start children."""
    return not multiprocessing.current_process().daemon


# ----- in the child ---------------------------------------------------------------------------
def _probe_child(conn: Connection, files: dict[str, str], skipped: dict[str, str],
                 smoke_model: str) -> None:
    """Send every variant's score, then the name of the best one not skipped (None if none),
    load it, smoke-run it and send "ok"; a crash on the way is the parent's to name."""
    import llama_cpp

    tail = _quiet_log(llama_cpp)
    paths = {name: Path(path) for name, path in files.items()}
    scores = _scores(paths)
    conn.send(("scores", scores))
    order = [n for n in _by_score(scores) if n not in skipped]
    conn.send(("trying", order[0] if order else None))
    if not order:
        return
    ggml = _libggml(paths[order[0]].parent)
    if not ggml.ggml_backend_load(files[order[0]].encode()):
        raise RuntimeError("ggml_backend_load refused it")
    try:
        smoke_run(llama_cpp, Path(smoke_model))
    except SmokeModelUnreadable as exc:  # the file's fault, not the variant's
        conn.send(("ok", str(exc)))
        return
    except RuntimeError as exc:
        raise RuntimeError(f"{exc} ({tail[-1]})" if tail else str(exc)) from None
    conn.send(("ok", None))


class SmokeModelUnreadable(RuntimeError):
    """llama.cpp could not load the smoke run's model: nothing ran on the variant."""


def _quiet_log(llama_cpp: Any) -> list[str]:
    """Route llama.cpp's log away from the child's stderr: its last lines, for an error."""
    tail: list[str] = []

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def on_log(_level: int, text: bytes, _user: Any) -> None:
        line = text.decode("utf-8", "replace").strip()
        if line:
            tail[:] = [*tail[-9:], line]

    global _child_log
    _child_log = on_log  # alive while llama.cpp may call it
    llama_cpp.llama_log_set(on_log, ctypes.c_void_p(0))
    return tail


def smoke_run(llama_cpp: Any, gguf: Path) -> None:
    """A short prompt and a few single-token steps of gguf, flash attention on and off (their
    kernels differ); RuntimeError when llama.cpp refuses, finite logits checked."""
    import math

    lib = llama_cpp
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(str(gguf).encode(), lib.llama_model_default_params())
    if not model:
        raise SmokeModelUnreadable(f"llama.cpp could not load {gguf.name}")
    try:
        n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        for flash in (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED, lib.LLAMA_FLASH_ATTN_TYPE_DISABLED):
            params = lib.llama_context_default_params()
            params.n_ctx = 64
            params.n_batch = params.n_ubatch = SMOKE_PROMPT_TOKENS
            params.n_threads = params.n_threads_batch = min(4, os.cpu_count() or 1)
            params.flash_attn_type = flash
            ctx = lib.llama_init_from_model(model, params)
            if not ctx:
                continue  # flash attention refused for this model: the other one runs
            try:
                ids = [(7 + 13 * i) % n_vocab for i in range(SMOKE_PROMPT_TOKENS)]
                batches = [ids, *([[ids[i]] for i in range(SMOKE_DECODE_STEPS)])]
                for tokens in batches:
                    array = (lib.llama_token * len(tokens))(*tokens)
                    if lib.llama_decode(ctx, lib.llama_batch_get_one(array, len(tokens))):
                        raise RuntimeError("llama_decode failed")
                logits = lib.llama_get_logits_ith(ctx, -1)
                if not all(math.isfinite(logits[i]) for i in range(min(n_vocab, 256))):
                    raise RuntimeError("logits are not finite")
            finally:
                lib.llama_free(ctx)
    finally:
        lib.llama_model_free(model)


# ----- ggml through ctypes --------------------------------------------------------------------
def _scores(files: dict[str, Path]) -> dict[str, int]:
    """ggml's score of each variant for this CPU: its feature check, compiled without the
    variant's instruction sets, so any CPU may run it (ggml's own loader does the same)."""
    scores = {}
    for name, path in files.items():
        try:
            score = ctypes.CDLL(str(path)).ggml_backend_score
        except (OSError, AttributeError) as exc:
            log.warning("llama.cpp CPU backend %s cannot be opened: %s", name, exc)
            scores[name] = 0
            continue
        score.restype = ctypes.c_int
        score.argtypes = []
        scores[name] = int(score())
    return scores


def _libggml(directory: Path) -> Any:
    """libggml as already loaded by libllama (RTLD_NOLOAD: never a second copy)."""
    names = _GGML_NAMES.get(sys.platform, _GGML_SONAMES)
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LOCAL", 0)
    for name in names:
        try:
            lib = (ctypes.CDLL(str(directory / name)) if sys.platform == "win32"
                   else ctypes.CDLL(name, mode=mode))
        except OSError:
            continue
        lib.ggml_backend_load.restype = ctypes.c_void_p
        lib.ggml_backend_load.argtypes = [ctypes.c_char_p]
        lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
        lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
        return lib
    raise ModelLoadError(f"llama.cpp's libggml is not loaded from {directory} (tried "
                         f"{', '.join(names)}): reinstall llama-cpp-python (`make llama-cpp`)")


# ----- the cache ------------------------------------------------------------------------------
def cache_key(files: dict[str, Path]) -> str:
    """Identifies (CPU, llama-cpp-python, the variant libraries as built): a new one smoke-runs."""
    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:  # a frozen app without its metadata
        version = "?"
    parts = [cpu_fingerprint(), version]
    parts += [f"{name}:{library_stamp(path)}" for name, path in sorted(files.items())]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def library_stamp(path: Path) -> str:
    """A library as built (size, modification time): a rebuild changes it."""
    stat = path.stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def cache_path() -> Path:
    return cache_root() / CACHE_FILE


def read_cache(key: str) -> dict[str, Any] | None:
    entry = read_json(cache_path()).get(key)
    if (isinstance(entry, dict) and isinstance(entry.get("order"), list)
            and isinstance(entry.get("skipped"), dict)):
        return entry
    return None


def write_cache(key: str, entry: dict[str, Any]) -> None:
    """Best effort: an unwritable cache dir only means smoke runs again next start."""
    write_json_entry(cache_path(), key, entry, CACHE_MAX_ENTRIES)


# ----- python -m engine.runtimes.llamacpp.cpu_backend [--smoke-model GGUF] MODULE [ARGS...] ----
def main(argv: list[str] | None = None) -> None:
    """Run a Python module that uses llama-cpp-python (llama_cpp.server) with the CPU backend
    variant loaded first: llama-cpp-python loads none by itself."""
    import runpy

    args = list(sys.argv[1:] if argv is None else argv)
    smoke_model = None
    if args[:1] == ["--smoke-model"] and len(args) >= 2:
        smoke_model, args = Path(args[1]), args[2:]
    if not args:
        raise SystemExit("usage: python -m engine.runtimes.llamacpp.cpu_backend "
                         "[--smoke-model GGUF] MODULE [ARGS...]   (e.g. llama_cpp.server "
                         "--model FILE.gguf)")
    import llama_cpp

    try:
        backend = ensure_cpu_backend(llama_cpp, smoke_model or known_good_model())
    except ModelLoadError as exc:
        raise SystemExit(f"phasewise: {exc}") from None
    print(f"llama.cpp CPU backend: {backend.variant}; {system_info(llama_cpp)}",
          file=sys.stderr, flush=True)
    sys.argv = [args[0], *args[1:]]
    runpy.run_module(args[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
