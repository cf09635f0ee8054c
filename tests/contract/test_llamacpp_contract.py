"""The same contract (tests/support/backend_checks.py) against the llama.cpp engine on the
bundled GGUF.

Native code in tests runs in a child process, so each check runs in its own spawned child
(tests/support/child.py's run_in_child): a crash fails that check with the signal's
name and the rest of the suite goes on. Skipped, saying why, without llama-cpp-python.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.protocol import Backend
from tests.support import backend_checks as checks
from tests.support.child import CHILD_TIMEOUT_S, needs_llama_cpp, run_in_child

pytestmark = [needs_llama_cpp, pytest.mark.timeout(CHILD_TIMEOUT_S + 60)]
CACHE_BYTES = 64 << 20


def _is_a_backend(backend: Backend) -> None:
    assert Backend in type(backend).__mro__
    assert not backend.is_remote
    info = backend.model_info
    assert info is not None and info.engine == "llama.cpp"


def _failed_load_keeps_the_model(backend: Backend) -> None:
    checks.check_failed_load_keeps_model(backend, "/no/such/model.gguf", engine="llama.cpp")


def _capabilities(backend: Backend) -> None:
    from engine.model_files import default_gguf_path

    checks.check_capabilities(backend, str(default_gguf_path()))  # the model as its own draft


CHECKS: dict[str, Callable[[Backend], object]] = {
    "is_a_backend": _is_a_backend,
    "event_order": checks.check_event_order,
    "metric_identities": checks.check_metric_identities,
    "cancel": checks.check_cancel,
    "bad_input": checks.check_bad_input,
    "alternatives": checks.check_alternatives,
    "failed_load_keeps_the_model": _failed_load_keeps_the_model,
    "capabilities": _capabilities,
}


def _run_check(name: str) -> None:
    """In the child: a started Engine with the bundled GGUF on llama.cpp, then one check."""
    from engine.model_files import default_gguf_path
    from engine.worker import Engine

    with Engine(cache_budget_bytes=CACHE_BYTES) as engine:
        engine.load_model_sync(str(default_gguf_path()), engine="llama.cpp")
        CHECKS[name](engine)


@pytest.mark.parametrize("name", list(CHECKS))
def test_llama_cpp_engine_keeps_the_contract(name: str) -> None:
    run_in_child(_run_check, name)
