"""The conversion cache: GGUF files the torch engine converted to safetensors, listed and removed.

Each converted model is a folder under models_dir() (engine/runtimes/torch/loader.py) holding its
marker (phasewise-converted.json: the source file's name, size and dtype). A folder still being
written (".converting-*") is not listed. The model in use is never removed.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from engine.errors import PhasewiseError
from engine.model_files import models_dir
from engine.runtimes.torch.loader import CONVERTED_MARKER


@dataclass(frozen=True)
class ConvertedModel:
    folder: Path
    source: str  # the GGUF's file name
    source_size: int  # its size in bytes
    dtype: str  # e.g. "torch.float32"
    size_bytes: int  # what the folder takes on disk

    @property
    def label(self) -> str:
        dtype = self.dtype.removeprefix("torch.")
        return f"{self.source} ({dtype}, {self.size_bytes / 1e6:,.0f} MB)"


def converted_models(root: Path | None = None) -> list[ConvertedModel]:
    """Every complete converted model in the cache, largest first."""
    root = root or models_dir()
    found = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        try:
            marker = json.loads((folder / CONVERTED_MARKER).read_text(encoding="utf-8"))
            found.append(ConvertedModel(folder, str(marker["source"]), int(marker["size"]),
                                        str(marker.get("dtype", "")), _disk_bytes(folder)))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a converted model (or a damaged one: the loader converts again)
    return sorted(found, key=lambda m: -m.size_bytes)


def _disk_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def in_use(model: ConvertedModel, loaded_path: str | None) -> bool:
    """Whether the loaded model (ModelInfo.path: the converted folder for the default model,
    the GGUF for a .gguf file) reads this converted folder."""
    if not loaded_path:
        return False
    path = Path(loaded_path)
    if path == model.folder:
        return True
    try:
        same_file = path.name == model.source and path.stat().st_size == model.source_size
    except OSError:
        return False
    return same_file and model.folder.name.startswith(path.stem + "-")


def remove_converted(model: ConvertedModel, loaded_path: str | None) -> int:
    """Delete a converted model; the bytes freed. PhasewiseError for the one in use."""
    if in_use(model, loaded_path):
        raise PhasewiseError(f"{model.source} is the model in use: load another one first")
    freed = _disk_bytes(model.folder)
    shutil.rmtree(model.folder)
    return freed
