"""Shared fixtures: a tiny random model (most tests) and the real default model (a few)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine import Engine
from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama model folder (tokenizer + ChatML template included)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_model_no_template_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-no-template"), chat_template=False)


@pytest.fixture
def tiny_engine(tiny_model_dir: Path) -> Iterator[Engine]:
    """A started engine with the tiny model loaded."""
    with Engine(cache_budget_bytes=64 << 20) as engine:
        engine.load_model_sync(str(tiny_model_dir))
        yield engine


@pytest.fixture(scope="session")
def real_engine() -> Iterator[Engine]:
    """The bundled default model (converted once per cache dir), shared by the session."""
    with Engine() as engine:
        engine.load_model_sync("default")
        yield engine
