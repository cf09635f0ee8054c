"""The runner contract (tests/support/runner_checks.py) on the llama.cpp runtime: LlamaRunner
and LlamaBatcher on the bundled GGUF. Native code runs in a child process; one child loads the
model once and runs every check (each on a fresh prefix cache), and each check's outcome is
its own test here. The same checks run on torch in tests/runtimes/test_runner_contract.py."""

from __future__ import annotations

import pytest

from tests.support.child import CHILD_TIMEOUT_S, needs_llama_cpp, run_in_child
from tests.support.runner_checks import CHECKS, llama_kit, run_checks

pytestmark = [needs_llama_cpp, pytest.mark.timeout(CHILD_TIMEOUT_S + 60)]


def _every_check() -> dict[str, str | None]:
    """In the child: the bundled GGUF, then every check; None where one passed, else its
    traceback."""
    from tests.support.llamacpp import load_default

    runtime = load_default()

    loaded = runtime.model
    return run_checks(lambda: llama_kit(loaded), list(CHECKS))


@pytest.fixture(scope="module")
def outcome() -> dict[str, str | None]:
    result: dict[str, str | None] = run_in_child(_every_check)
    return result


@pytest.mark.parametrize("name", list(CHECKS))
def test_llama_cpp_runner_keeps_the_contract(name: str, outcome: dict[str, str | None]) -> None:
    if outcome[name] is not None:
        pytest.fail(f"{name} failed on llama.cpp:\n{outcome[name]}")
