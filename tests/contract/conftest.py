"""The backends the contract runs against: each a started Backend with the tiny model loaded.

Module-scoped and parametrized: pytest runs every contract test on one backend before it
builds the next.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.serve import ServerThread, create_app
from engine.backends import BackendRouter
from engine.protocol import Backend
from engine.remote import RemoteConfig, RemoteEngine
from engine.worker import Engine
from tests.support.backend_checks import TINY

CACHE_BYTES = 64 << 20
# The llama.cpp engine runs native code, which tests run in a child process: it keeps the same
# contract in test_llamacpp_contract.py, one spawned child per check, not through `backend`.
BACKENDS = ["engine", "router", "remote"]


@pytest.fixture(scope="module", params=BACKENDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def backend(backend_kind: str, tiny_model_dir: Path) -> Iterator[Backend]:
    """A started Backend of that kind, the tiny model loaded (on a loopback server for
    "remote")."""
    if backend_kind == "engine":
        with Engine(cache_budget_bytes=CACHE_BYTES) as engine:
            engine.load_model_sync(str(tiny_model_dir), **TINY)
            yield engine
    elif backend_kind == "router":
        with BackendRouter(Engine(cache_budget_bytes=CACHE_BYTES)) as router:
            router.load_model_sync(str(tiny_model_dir), **TINY)
            yield router
    else:
        with Engine(cache_budget_bytes=CACHE_BYTES) as served:
            served.load_model_sync(str(tiny_model_dir), **TINY)
            with ServerThread(create_app(served)) as server, \
                    RemoteEngine(RemoteConfig(server.base_url)) as remote:
                remote.load_model_sync(timeout=60)
                yield remote
