"""Which runtime runs a model: torch or llama.cpp, chosen from the spec, the device and what is
installed. Light (no runtime is imported) so that the runtimes and the fit check both build on
it: engine/runtimes/__init__.py loads what this chooses, engine/tools/fit.py estimates it before
loading.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.errors import ModelLoadError
from engine.model_files import DEFAULT_MODEL_NAME, classify, default_gguf_path

AUTO = "auto"
TORCH = "torch"
LLAMA_CPP = "llama.cpp"
ENGINES = (AUTO, TORCH, LLAMA_CPP)


def llama_cpp_installed() -> bool:
    """llama-cpp-python is importable (found without loading its native library)."""
    return importlib.util.find_spec("llama_cpp") is not None


def cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_engine(spec: str, engine: str = AUTO, device: str = AUTO) -> str:
    """TORCH or LLAMA_CPP for this model spec; ModelLoadError for an impossible choice."""
    if engine not in ENGINES:
        raise ModelLoadError(f"unknown engine {engine!r} (choose from {', '.join(ENGINES)})")
    kind = classify(spec)
    if engine == TORCH:
        return TORCH
    if engine == LLAMA_CPP:
        if kind not in ("default", "gguf"):
            raise ModelLoadError(f"the llama.cpp engine runs .gguf files; {spec} is not one "
                                 "(use --engine torch)")
        if device not in (AUTO, "cpu"):
            raise ModelLoadError(f"the llama.cpp engine runs on the CPU here (got --device "
                                 f"{device}; use --engine torch)")
        return LLAMA_CPP
    if kind in ("gguf", "default"):  # the default model is a GGUF, bundled or not
        return gguf_engine(device)
    return TORCH


def gguf_engine(device: str = AUTO) -> str:
    """What `auto` runs a GGUF file on (one on this disk, or one on the hub not downloaded
    yet): llama.cpp when it is installed and no CUDA GPU is present, torch otherwise."""
    if device in (AUTO, "cpu") and llama_cpp_installed() and not cuda_present():
        return LLAMA_CPP
    return TORCH


def engine_reason(spec: str, device: str = AUTO) -> tuple[str, str]:
    """What `auto` runs this model on, and why, in a few words (the model picker shows it)."""
    kind = classify(spec)
    if kind == "missing":
        return TORCH, "no such file or folder"
    try:
        chosen = resolve_engine(spec, AUTO, device)
    except ModelLoadError as exc:
        return TORCH, str(exc)
    if chosen == LLAMA_CPP:
        return LLAMA_CPP, "a GGUF file and no CUDA GPU: llama.cpp runs it quantized"
    if kind in ("folder", "hub"):
        return TORCH, "a Hugging Face model: only torch runs it"
    if not llama_cpp_installed():
        return TORCH, "llama-cpp-python is not installed"
    if device not in (AUTO, "cpu"):
        return TORCH, f"--device {device}: llama.cpp runs on the CPU here"
    return TORCH, "a CUDA GPU is present: torch runs it there"


def gguf_path(spec: str) -> tuple[Path, str, str]:
    """(file, display name, source) for a spec the llama.cpp engine can run."""
    if classify(spec) == "default":
        return default_gguf_path(), DEFAULT_MODEL_NAME, "default"
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"model not found: {spec} (no such file)")
    return path, path.stem, "gguf"
