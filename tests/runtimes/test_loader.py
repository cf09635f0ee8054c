"""Loading models from every kind of source, and every way that can go wrong."""

import json
import shutil
from pathlib import Path

import pytest

from engine.errors import DownloadNotAllowedError, ModelLoadError
from engine.model_files import classify
from engine.runtimes.torch.loader import load_model


def test_loads_folder_with_config_context_length(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir))
    info = loaded.info
    assert (info.source, info.device, info.dtype) == ("folder", "cpu", "float32")
    assert info.context_length == 256  # from config, not the tokenizer placeholder
    assert info.parameters == sum(p.numel() for p in loaded.model.parameters())
    assert info.weight_bytes_per_step == info.parameters * 4  # tied embeddings counted once
    assert not info.template_fallback


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model not found"):
        load_model(str(tmp_path / "nope"))


def test_folder_without_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "no-tok"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, folder / name)
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        load_model(str(folder))


def test_pickle_only_folder_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "pickle"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="--allow-pickle"):
        load_model(str(folder))


def test_weights_with_wrong_shape(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "wrong-shape"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = 128
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="cannot load the model"):
        load_model(str(folder))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(bogus))


def test_truncated_gguf(tmp_path: Path) -> None:
    from engine.model_files import default_gguf_path

    cut = tmp_path / "cut.gguf"
    with default_gguf_path().open("rb") as src:
        cut.write_bytes(src.read(4_000_000))
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(str(cut))


def test_hub_id_needs_consent() -> None:
    assert classify("HuggingFaceTB/SmolLM2-135M-Instruct") == "hub"
    with pytest.raises(DownloadNotAllowedError, match="--allow-download"):
        load_model("some-org/some-model-that-is-not-cached")


def test_model_without_chat_template_uses_fallback(tiny_model_no_template_dir: Path) -> None:
    assert load_model(str(tiny_model_no_template_dir)).info.template_fallback
