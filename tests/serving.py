"""Fixtures that start real servers on 127.0.0.1: `phasewise serve` over the tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.serve import ServerThread, create_app
from engine import Engine

TOKEN = "test-token-123"


@pytest.fixture(scope="module")
def served_engine(tiny_model_dir: Path) -> Iterator[Engine]:
    with Engine(cache_budget_bytes=64 << 20) as engine:
        engine.load_model_sync(str(tiny_model_dir), kernel="fp32-eager")
        yield engine


@pytest.fixture(scope="module")
def phasewise_server(served_engine: Engine) -> Iterator[ServerThread]:
    """`phasewise serve` on a free loopback port, no token."""
    with ServerThread(create_app(served_engine)) as server:
        yield server


@pytest.fixture(scope="module")
def token_server(served_engine: Engine) -> Iterator[ServerThread]:
    """The same engine served again, this time requiring a bearer token."""
    with ServerThread(create_app(served_engine, token=TOKEN)) as server:
        yield server
