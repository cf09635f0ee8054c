"""The loader's hook for a pre-converted default model shipped inside an installer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import ModelLoadError
from engine.loader import (
    BUNDLED_MARKER,
    BUNDLED_MODEL_ENV,
    DEFAULT_MODEL_NAME,
    bundled_model_dir,
    load_model,
)


def _bundle(tiny_model_dir: Path, target: Path) -> Path:
    """A bundled-model folder as packaging/prepare_model.py writes it, from the tiny model."""
    shutil.copytree(tiny_model_dir, target)
    files = {p.name: p.stat().st_size for p in sorted(target.iterdir())}
    (target / BUNDLED_MARKER).write_text(json.dumps({"files": files}))
    return target


def test_source_tree_has_no_bundled_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BUNDLED_MODEL_ENV, raising=False)
    assert bundled_model_dir() is None


def test_default_prefers_the_bundled_model(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _bundle(tiny_model_dir, tmp_path / "bundled")
    monkeypatch.setenv(BUNDLED_MODEL_ENV, str(folder))
    loaded = load_model("default")
    assert loaded.info.name == DEFAULT_MODEL_NAME
    assert loaded.info.path == str(folder)
    assert loaded.info.source == "default"


def test_missing_bundled_model_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BUNDLED_MODEL_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match=r"bundled default model is missing.*reinstall"):
        load_model("default")


def test_truncated_bundled_model_is_reported_as_damaged(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _bundle(tiny_model_dir, tmp_path / "bundled")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    monkeypatch.setenv(BUNDLED_MODEL_ENV, str(folder))
    with pytest.raises(ModelLoadError, match=r"damaged \(model.safetensors has 1000 bytes"):
        load_model("default")


def test_unreadable_marker_is_reported_as_damaged(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _bundle(tiny_model_dir, tmp_path / "bundled")
    (folder / BUNDLED_MARKER).write_text("{not json")
    monkeypatch.setenv(BUNDLED_MODEL_ENV, str(folder))
    with pytest.raises(ModelLoadError, match="bundled default model is damaged"):
        load_model("default")


def test_other_models_ignore_the_bundled_model(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BUNDLED_MODEL_ENV, str(tmp_path / "nowhere"))
    assert load_model(str(tiny_model_dir)).info.path == str(tiny_model_dir)
