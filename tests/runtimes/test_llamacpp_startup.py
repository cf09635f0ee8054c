"""Start-up of the llama.cpp path: `phasewise ask --engine llama.cpp` never imports
transformers (about a second of import time and its memory, for nothing the GGUF path uses).

Each check runs in a spawned child process (a fresh interpreter: the test run itself has
imported transformers long ago), the one that loads llama.cpp through run_in_child so a native
crash is a failed test. No timing is asserted: `-X importtime` and the figures in
docs/benchmarks.md measure.
"""

from __future__ import annotations

import contextlib
import io
import sys

from tests.support.child import needs_llama_cpp, run_in_child

# What the llama.cpp engine runs on: the engine package, the runtime switch, the llama.cpp
# session, batcher and prefix pool, and the CLI that starts them.
LLAMA_CPP_PATH_MODULES = (
    "engine",
    "engine.runtimes",
    "engine.runtimes.llamacpp.model",
    "engine.runtimes.llamacpp.session",
    "engine.runtimes.llamacpp.batcher",
    "engine.runtimes.llamacpp.prefix_pool",
    "app.cli",
)


def _transformers_modules() -> list[str]:
    return sorted(name for name in sys.modules if name.partition(".")[0] == "transformers")


def _import_body() -> list[str]:
    import importlib

    for name in LLAMA_CPP_PATH_MODULES:
        importlib.import_module(name)
    return _transformers_modules()


def _ask_body() -> tuple[int, str, list[str]]:
    from app.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["ask", "--engine", "llama.cpp", "--model", "default", "--temperature", "0",
                     "--max-tokens", "4", "What is the capital of France?"])
    return code, out.getvalue(), _transformers_modules()


def test_the_llama_cpp_modules_import_no_transformers() -> None:
    """Runs where llama-cpp-python is absent too: its library is imported only at load."""
    assert run_in_child(_import_body) == []


@needs_llama_cpp
def test_ask_on_llama_cpp_imports_no_transformers() -> None:
    code, text, imported = run_in_child(_ask_body)
    assert code == 0
    assert text.strip(), "the reply was empty"
    assert imported == [], f"ask --engine llama.cpp imported {imported[:5]}"
