"""Find, convert and load a model: the bundled default, a local folder, a .gguf file, a hub id.

Offline by default: nothing is downloaded unless allow_download is set. No trust_remote_code,
and no pickle checkpoints unless allow_pickle is set. A GGUF is dequantized once and kept as
safetensors plus tokenizer in the user cache directory, keyed by a fingerprint of its content.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.core.chat_template import has_chat_template
from engine.errors import DownloadNotAllowedError, ModelLoadError, one_line
from engine.events import ModelInfo, SamplingDefaults
from engine.gguf_header import split_parts
from engine.model_files import (
    DEFAULT_MODEL,
    DEFAULT_MODEL_NAME,
    classify,
    default_gguf_path,
    file_sha256,
    models_dir,
    quick_fingerprint,
)

CONVERTED_MARKER = "phasewise-converted.json"
DEQUANTIZE_CHUNK_BYTES = 64 << 20  # of float32 a GGUF tensor is dequantized in at a time
Progress = Callable[[str], None]
Counted = Callable[[int, int], None]  # (done, total): how far a conversion got
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




def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    device: str = "auto",
    dtype: str = "auto",
    allow_download: bool = False,
    allow_pickle: bool = False,
    progress: Progress | None = None,
    conversion_progress: Counted | None = None,
) -> LoadedModel:
    """Load a model from a spec; raise ModelLoadError with a one-line reason on failure.
    conversion_progress(done, total) counts the tensors of a GGUF being converted."""
    notify = progress or (lambda _msg: None)
    _quiet_transformers()
    kind = classify(spec)
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(torch_device, dtype)
    if kind == "missing":
        raise ModelLoadError(f"model not found: {spec} (no such file or folder)")
    if kind == "default":
        folder = converted_gguf(default_gguf_path(), notify, torch_dtype, conversion_progress)
        name, path = DEFAULT_MODEL_NAME, str(folder)
    elif kind == "gguf":
        gguf = Path(spec).expanduser()
        if not gguf.is_file():
            raise ModelLoadError(f"model not found: {spec} (no such file)")
        if split_parts(gguf) is not None:
            raise ModelLoadError(f"{gguf.name} is one part of a model split over several "
                                 "files: the llama.cpp engine runs it (--engine llama.cpp); "
                                 "the torch engine does not convert split GGUFs yet")
        folder = converted_gguf(gguf, notify, torch_dtype, conversion_progress)
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
        sampling_defaults=sampling_defaults(model.generation_config),
    )


def sampling_defaults(generation_config: Any) -> SamplingDefaults:
    """The model's own sampling settings from its generation_config (values out of range are
    left out). do_sample=False means its authors decode greedily: temperature 0."""

    def number(value: Any, low: float, high: float, kind: type = float) -> Any:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return kind(value) if ok and low <= value <= high else None

    temperature = number(generation_config.temperature, 0.0, 100.0)
    if generation_config.do_sample is False:
        temperature = 0.0
    top_p = number(generation_config.top_p, 1e-9, 1.0)
    top_k = number(generation_config.top_k, 0, 1 << 30, int)
    penalty = number(generation_config.repetition_penalty, 1e-9, 100.0)
    return SamplingDefaults(temperature, top_p, top_k, penalty)


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
        raise ModelLoadError(f"cannot load the tokenizer from {folder}: {one_line(exc)}") from exc
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
        raise ModelLoadError(f"cannot load the model from {folder}: {one_line(exc)}") from exc
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
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {one_line(exc)}") from exc
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(_not_causal(folder.name, config.model_type))


def _not_causal(name: str, model_type: str) -> str:
    return (f"{name} is a {model_type} model, not a text-generation (causal LM) architecture: "
            "Phasewise runs decoder-only chat models")


def config_refusal(config: dict[str, Any], name: str) -> str | None:
    """Why the torch engine cannot run a model with this config.json, in one line (None: it
    can): an architecture this transformers does not know (Phasewise never runs a model's
    own code), or one that does not generate text. For a hub folder not downloaded yet."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        return (f"{name}: transformers {transformers.__version__} does not know the "
                f"{model_type!r} architecture (Phasewise never runs a model's own code)")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return _not_causal(name, model_type)
    return None


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
        message = f"cannot read {repo_id} from the local cache: {one_line(exc)}"
        raise ModelLoadError(message) from exc
    notify(f"downloading {repo_id}")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:
        raise ModelLoadError(f"download of {repo_id} failed: {one_line(exc)}") from exc


def converted_gguf(gguf: Path, notify: Progress, dtype: torch.dtype = torch.float32,
                   counted: Counted | None = None) -> Path:
    """A safetensors folder of this GGUF in `dtype`, converting it on first use.

    Keyed by quick_fingerprint; the whole file is hashed once, at conversion, and again only
    if its size or modification time changed since (a copy, a touch), not on every start."""
    notify("checking model file")
    try:
        stat = gguf.stat()
        quick = quick_fingerprint(gguf, stat.st_size)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {gguf}: {exc.strerror or exc}") from exc
    target = models_dir() / f"{gguf.stem}-{quick[:16]}-{_dtype_tag(dtype)}"
    record = {"source": gguf.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    marker = target / CONVERTED_MARKER
    old = _read_marker(marker)
    if old and all(old.get(k) == v for k, v in record.items()):
        return target
    digest = _full_sha256(gguf)
    if old and old.get("sha256") == digest:  # same content, new mtime: remember it
        marker.write_text(json.dumps({**old, **record}))
        return target
    notify("converting GGUF to safetensors (first start only)")
    _convert_gguf(gguf, target, {**record, "sha256": digest, "dtype": str(dtype)}, dtype,
                  notify, counted)
    return target


def _read_marker(marker: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _full_sha256(gguf: Path) -> str:
    try:
        return file_sha256(gguf)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {gguf}: {exc.strerror or exc}") from exc


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


class SafetensorsStream:
    """Writes a .safetensors file one tensor at a time, so a conversion never holds the whole
    model: the data goes to a side file as it comes, then the header and the data are joined
    (safetensors' save_file takes every tensor at once and copies each into bytes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._data_path = path.with_name(path.name + ".data")
        self._data = self._data_path.open("wb")
        self._header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        self._offset = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        self._data.write(flat.numpy().data)
        end = self._offset + flat.numel()
        self._header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype],
                              "shape": list(tensor.shape),
                              "data_offsets": [self._offset, end]}
        self._offset = end

    def close(self) -> None:
        """Write the file (header, then the data); the side file goes."""
        self._data.close()
        header = json.dumps(self._header, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the format allows space padding; keeps alignment
        with self.path.open("wb") as out, self._data_path.open("rb") as data:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            shutil.copyfileobj(data, out, 1 << 24)
        self._data_path.unlink()


def _convert_gguf(gguf: Path, target: Path, record: dict[str, Any], dtype: torch.dtype,
                  notify: Progress, counted: Counted | None = None) -> None:
    """Dequantize tensor by tensor straight into dtype and stream each one to disk: peak
    memory is about one tensor, not the model (transformers' GGUF loader holds it whole)."""
    reader = _open_gguf(gguf)
    try:
        notify("reading the GGUF tokenizer")
        tokenizer, config, count, tensors = _gguf_parts(gguf, reader)
    except Exception as exc:
        message = f"{gguf} is corrupt or not a supported GGUF: {one_line(exc)}"
        raise ModelLoadError(message) from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        out = SafetensorsStream(staging / "model.safetensors")
        step = max(1, count // 10)
        for i, (name, tensor) in enumerate(tensors):
            if i % step == 0:
                notify(f"converting GGUF: {100 * i // max(1, count)}%")
            out.add(name, tensor.to(dtype))
            if counted:
                counted(min(i + 1, count), count)
        out.close()
        config.dtype = dtype
        config.save_pretrained(staging)
        _generation_config(config).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / CONVERTED_MARKER).write_text(json.dumps(record))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot write the converted model to {target.parent}: {exc.strerror or exc}"
        ) from exc
    except Exception as exc:
        raise ModelLoadError(f"{gguf} could not be converted: {one_line(exc)}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _gguf_parts(gguf: Path, reader: Any,
                ) -> tuple[Any, Any, int, Iterator[tuple[str, torch.Tensor]]]:
    """The tokenizer, the config, the tensor count and the lazily dequantized (name, tensor)
    pairs of a GGUF, through transformers' own name map and per-architecture fixes."""
    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    folder, name = str(gguf.parent), gguf.name
    with _read_gguf_once(str(gguf), reader):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):  # parameter names only, no memory
            skeleton = AutoModelForCausalLM.from_config(config)
        config.architectures = [type(skeleton).__name__]
        architecture = hf_gguf.read_field(reader, "general.architecture")[0]
        # transformers' GGUF helpers are untyped (no-untyped-call here and below)
        processor = hf_gguf.TENSOR_PROCESSORS.get(  # type: ignore[no-untyped-call]
            architecture, hf_gguf.TensorProcessor)(config=config.to_dict())
        names = hf_gguf.get_gguf_hf_weights_map(skeleton, processor)
    parsed: dict[str, Any] = {"tensors": {}}  # where a processor merges tensors (MoE experts)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for item in reader.tensors:
            result = processor.process(weights=dequantized(item.data, item.tensor_type),
                                       name=item.name, tensor_key_mapping=names,
                                       parsed_parameters=parsed)
            if result.name in names:
                array = np.require(result.weights, requirements=["C", "W"])
                yield names[result.name], torch.from_numpy(array)
        yield from parsed.pop("tensors").items()

    return tokenizer, config, len(reader.tensors), tensors()


def dequantized(data: Any, tensor_type: Any) -> Any:
    """gguf's dequantize, a few thousand rows at a time into one float array: whole, its
    intermediates held about twice the result more (+1.5 GB for a 262k-token embedding).
    A GGUF's blocks never cross a row, so the rows come out the same either way."""
    import numpy as np
    from gguf import dequantize

    if data.ndim < 2 or data.shape[0] < 2:
        return dequantize(data, tensor_type)
    first = dequantize(data[:1], tensor_type)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=first.dtype)
    step = max(1, DEQUANTIZE_CHUNK_BYTES // max(1, first[0].nbytes))
    for start in range(0, data.shape[0], step):
        out[start:start + step] = dequantize(data[start:start + step], tensor_type)
    return out


@contextlib.contextmanager
def _read_gguf_once(path: str, reader: Any) -> Iterator[None]:
    """transformers reads a GGUF's metadata afresh for the tokenizer and again for the config,
    each time building a GGUFReader (seconds for a 49k-token vocabulary), and rebuilds gguf's
    tensor-name table once per module of the model when mapping names (hundreds of times):
    hand them this one reader, one parse and one table per architecture."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    make_reader, parse, name_map = (gguf.GGUFReader, hf_gguf.load_gguf_checkpoint,
                                    gguf.get_tensor_name_map)
    parsed: dict[str, Any] = {}

    def shared_reader(file: Any, *args: Any, **kwargs: Any) -> Any:
        return reader if str(file) == path else make_reader(file, *args, **kwargs)

    def parse_once(file: Any, return_tensors: bool = False, **kwargs: Any) -> Any:
        if str(file) != path or return_tensors or kwargs:
            return parse(file, return_tensors=return_tensors,  # type: ignore[no-untyped-call]
                         **kwargs)
        if not parsed:
            parsed.update(parse(file))  # type: ignore[no-untyped-call]
        return copy.deepcopy(parsed)

    # Patching a class and a function for the duration of one load: mypy cannot type a
    # monkeypatch (misc: assigning to a type; assignment: another signature).
    gguf.GGUFReader = shared_reader  # type: ignore[misc, assignment]
    hf_gguf.load_gguf_checkpoint = parse_once  # type: ignore[assignment]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader = make_reader  # type: ignore[misc]  # the class put back
        hf_gguf.load_gguf_checkpoint = parse
        gguf.get_tensor_name_map = name_map


def _generation_config(config: Any) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig.from_model_config(config)


def _open_gguf(gguf: Path) -> Any:
    """A GGUFReader for the file; a clear line for a file that is not GGUF, or is cut short."""
    try:
        from gguf import GGUFReader

        with gguf.open("rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{gguf} is not a GGUF file (bad magic bytes)")
        return GGUFReader(str(gguf))
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{gguf} is corrupt or truncated: {one_line(exc)}") from exc

