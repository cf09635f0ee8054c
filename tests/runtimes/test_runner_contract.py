"""The runner contract (tests/support/runner_checks.py) on the torch runtime: TorchRunner and
Batcher on the tiny model with sharpened weights, in-process. The same checks run on llama.cpp
in tests/runtimes/test_llamacpp_runner_contract.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.runtimes.torch.loader import LoadedModel, load_model
from tests.support.runner_checks import CHECKS, torch_kit
from tests.support.tiny_model import sharpened


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(sharpened(tiny_model_dir, tmp_path_factory.mktemp("sharp"))))


@pytest.mark.parametrize("name", list(CHECKS))
def test_torch_runner_keeps_the_contract(name: str, loaded: LoadedModel) -> None:
    with torch.inference_mode():
        CHECKS[name](torch_kit(loaded))
