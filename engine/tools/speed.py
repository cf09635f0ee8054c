"""How fast a model will run on this computer, before it is downloaded: predicted decode tok/s
and the time to read a 4,000-token prompt, on the engine the file would run on.

One measurement of this machine per engine, taken at most once and cached in the user cache
dir (SPEED_FILE, keyed by CPU, threads, engine build and the bundled model): the memory
bandwidth (calibrate.device_peaks, measured afresh and cached: the figure the HUD's roofline
draws its ceiling at) and the engine itself on the bundled model, in a child process (native
code, at a moment of our choosing: engine/native.py): a short decode, and cold prompts of
four lengths.
A model is then priced by what its header says (ModelCost):

- decode: a step reads the model's weights once (as stored on llama.cpp, at the kernel's bytes
  per weight on torch). The engine's efficiency on the bundled model, the share of the
  measured bandwidth its decode reached, is assumed for the model:
  tok/s = efficiency x bandwidth / bytes per step.
- prompt: seconds = d + a x n + b x n^2 / 2 for n tokens read cold, the bundled model's line
  fitted by engine/forecast.py's PrefillCost (the fit the wait forecast uses), with `a` scaled
  by the model's matmul FLOPs per token (2 x the weights every prompt token multiplies) and
  `b` by its attention FLOPs per pair of positions (query heads x (key + value dims), summed
  over its attention layers). On llama.cpp the matrices' part of `a` is priced by weight type
  instead (Q8_0 and the K-quants read a prompt ~2x faster per FLOP than Q4_1 on Zen 5): each
  type's seconds per FLOP timed once on a synthetic model (engine/tools/synthetic_gguf.py)
  whose matrices all take that type; the bundled model's matrices at its types' rates are
  taken out of its `a`, the rest scaled by FLOPs, and the model's matrices added at theirs.

After a model's first replies the figures they measured are kept per model file
(MeasuredSpeeds, from RequestMetrics), so the picker sets them beside the prediction; the
HUD's roofline sets each reply beside it (ModelSpeed).
"""

from __future__ import annotations

import json
import os
import statistics
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.errors import PhasewiseError
from engine.gguf_header import GGUFHeader, read_gguf_model
from engine.machine import read_json, write_json_entry
from engine.metrics import RequestMetrics
from engine.model_files import cache_root

PROMPT_TOKENS = 4000  # the prompt the browser prices: a long document, or a long chat
SPEED_FILE = "speed-profiles.json"
MEASURED_FILE = "measured-speeds.json"
# How the engine is measured. A change here (or in METHOD) measures again.
# The longest is the prompt the browser prices: measured from 128/512/1,536 alone, the fitted
# n^2 term overshot a 4,000-token prompt by x1.33 on llama.cpp (Zen 5; the cost per token grew
# less from 1,536 to 4,000 than from 512 to 1,536), so it is measured, not extrapolated.
PREFILL_LENGTHS = (128, 512, 1536, PROMPT_TOKENS)
DECODE_PROMPT, DECODE_TOKENS = 64, 65
WARM_UP_TOKENS = 384  # one prompt read first, not timed
# llama.cpp's prompt per weight type: a synthetic Llama (every matrix a K-quant: rows of 768,
# a multiple of 256) quantized purely to each type, a cold prompt read twice, the faster kept.
PROMPT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K", "IQ4_XS", "F16", "BF16")
# The llama.cpp file type whose pure quantization stores every matrix in that type.
TYPE_FTYPES = {"Q3_K": "Q3_K_S", "Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S"}
SYNTHETIC_SHAPE = (768, 2048, 4)  # hidden, FFN, layers
TYPE_PROMPT = 512  # tokens
METHOD = (f"bundled model: decode {DECODE_TOKENS - 1} tokens after {DECODE_PROMPT}, best of 2;"
          f" cold prompts of {'/'.join(str(n) for n in PREFILL_LENGTHS)} tokens after one of "
          f"{WARM_UP_TOKENS}; llama.cpp: {TYPE_PROMPT} tokens per weight type on a synthetic "
          f"{'x'.join(str(n) for n in SYNTHETIC_SHAPE)}")
MEASURE_TIMEOUT_S = 600.0  # a child that says nothing for this long is killed
MIN_DECODE_TOKENS = 8  # a reply with fewer says little about the decode rate
MIN_PREFILL_TOKENS = 32  # a prefill of fewer says little about the prompt rate
KEEP_REPLIES = 32  # per model file, the newest
MAX_PROFILES = 32  # machines x engines x builds in SPEED_FILE, the newest
MAX_MODELS = 256  # model files in MEASURED_FILE, the most recently measured


# ----- what a model costs per token ----------------------------------------------------------
@dataclass(frozen=True)
class ModelCost:
    """What one token costs a model, from its files alone."""

    parameters: int  # every weight
    body_parameters: int  # the weights every prompt token multiplies (all but embedding, head)
    head_parameters: int  # the output head (the embedding table when tied): once per prompt
    step_bytes: int  # weights one decode step reads, as stored (what llama.cpp reads)
    attention: int  # sum over attention layers of query heads x (key + value dims)
    context_length: int  # the longest prompt the model takes
    # A GGUF's body matrices by ggml type, (type, weights): llama.cpp reads a prompt at each
    # type's own matmul speed (Q8_0 and the K-quants 1.6-1.8x faster than Q4_1 on Zen 5).
    body_types: tuple[tuple[str, int], ...] = ()

    @property
    def step_parameters(self) -> int:
        """Weights one decode step multiplies: the body and the output head."""
        return self.body_parameters + self.head_parameters

    @classmethod
    def from_gguf(cls, header: GGUFHeader, file_size: int) -> ModelCost:
        dims = header.tensor_dims
        embed = _elements(dims.get("token_embd.weight", ()))
        output = _elements(dims.get("output.weight", ()))
        total = header.elements()
        shape = header.shape()
        return cls(parameters=total, body_parameters=max(0, total - embed - output),
                   head_parameters=output or embed, step_bytes=header.step_bytes(file_size),
                   attention=shape.attention_width, context_length=shape.context_length,
                   body_types=_body_types(header))

    @classmethod
    def from_gguf_file(cls, path: Path) -> ModelCost:
        """A local GGUF's cost (a shard of a split model: the whole model's)."""
        return cls.from_gguf(*read_gguf_model(path))

    @classmethod
    def from_folder(cls, folder: Path) -> ModelCost | None:
        """A Hugging Face folder's cost from config.json and the safetensors headers; None
        where they do not tell."""
        from engine.tools.fit import safetensors_tensors

        try:
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            tensors: dict[str, tuple[list[int], str]] = {}
            for file in sorted(folder.glob("*.safetensors")):
                tensors.update(safetensors_tensors(file))
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            return None
        return cls.from_config(config, tensors)

    @classmethod
    def from_config(cls, config: Any, tensors: dict[str, tuple[list[int], str]],
                    ) -> ModelCost | None:
        """A Hugging Face model's cost from its config.json and its tensors' (shape, dtype):
        a local folder's or a hub folder's, read by range (engine/tools/hub.py). step_bytes at the
        stored dtypes."""
        from engine.tools.fit import config_shape, dtype_bytes

        if not tensors or not isinstance(config, dict):
            return None
        shape = config_shape(config)
        sizes = {name: (_elements(dims), dtype_bytes(dtype))
                 for name, (dims, dtype) in tensors.items()}
        embeds = [(n, b) for name, (n, b) in sizes.items() if name.endswith("embed_tokens.weight")]
        embed = sum(n for n, _b in embeds)
        head = sum(n for name, (n, _b) in sizes.items() if name.endswith("lm_head.weight"))
        total = sum(n for n, _b in sizes.values())
        step = sum(n * b for n, b in sizes.values())
        if head:  # an untied input table: a step reads one row of it
            step -= sum((n - n // max(1, shape.vocab)) * b for n, b in embeds)
        return cls(parameters=total, body_parameters=max(0, total - embed - head),
                   head_parameters=head or embed, step_bytes=int(step),
                   attention=shape.attention_width, context_length=shape.context_length)

    def for_file_size(self, header: GGUFHeader, header_file_size: int,
                      file_size: int, quant: str = "") -> ModelCost:
        """The same model in another quantization of `file_size` bytes (another file of the
        repository whose header was read): the same shape, its step's bytes in proportion to
        its weights, its body matrices of the type its name says (`quant`: "Q4_K_M" ->
        Q4_K; unknown when it says none)."""
        weights = max(1, header_file_size - header.data_start)
        share = max(0, file_size - header.data_start) / weights
        matrices = sum(n for _t, n in self.body_types)
        types = ((main_type(quant), matrices),) if quant and matrices else ()
        return replace(self, step_bytes=int(self.step_bytes * share), body_types=types)


def main_type(quant: str) -> str:
    """The ggml type most of a file of quantization `quant` is stored in: "Q4_K_M" -> "Q4_K",
    "Q8_0" -> "Q8_0", "IQ4_XS" -> "IQ4_XS"."""
    quant = quant.upper()
    for suffix in ("_S", "_M", "_L"):
        if "_K" in quant and quant.endswith(suffix):
            return quant[: -len(suffix)]
    return quant


def _body_types(header: GGUFHeader) -> tuple[tuple[str, int], ...]:
    """The body's matrices (not the embedding table or the output head) by ggml type."""
    counts: dict[str, int] = {}
    for name, dims in header.tensor_dims.items():
        if len(dims) >= 2 and name not in ("token_embd.weight", "output.weight"):
            kind = header.type_name(name)
            counts[kind] = counts.get(kind, 0) + _elements(dims)
    return tuple(sorted(counts.items()))


def _elements(dims: Iterable[int]) -> int:
    n = 1
    seen = False
    for d in dims:
        n *= d
        seen = True
    return n if seen else 0


# ----- one engine, measured on this machine --------------------------------------------------
@dataclass(frozen=True)
class EngineSpeed:
    """One engine measured once on this machine (CPU, threads, engine build)."""

    engine: str  # "llama.cpp" | "torch"
    device: str  # "cpu: AMD EPYC 9B45", "NVIDIA H200"
    build: str  # the engine's build ("llama-cpp-python 0.3.36", "torch 2.13.0 ...")
    threads: int
    bandwidth_gb_s: float  # the machine's, as the HUD's roofline has it
    bandwidth_method: str  # how that was measured, in words
    model: str  # the model measured on ("SmolLM2-135M-Instruct (Q4_1)")
    kernel: str  # the decode path the engine chose for it
    decode_tok_s: float  # the bundled model's decode at a short context
    decode_bytes: int  # what one of its decode steps reads on this engine
    decode_parameters: int  # the weights one of its steps multiplies
    prefill_points: tuple[tuple[int, float], ...]  # (tokens read cold, seconds)
    prefill_line: tuple[float, float, float]  # (a, b, d): s = d + a n + b n^2 / 2
    prompt_flops_per_token: float  # its matmul FLOPs per prompt token (a's unit)
    attention: int  # its attention dims (b's unit, as ModelCost.attention)
    # llama.cpp: seconds per body matmul FLOP of a prompt in each weight type, timed on a
    # synthetic model whose every matrix takes every type (PROMPT_TYPES), and the measured
    # model's own body types: a model is priced by its types against the measured one's
    prompt_type_s: tuple[tuple[str, float], ...] = ()
    model_types: tuple[tuple[str, int], ...] = ()
    measured_s: float = 0.0  # how long measuring took
    # the 1-minute load average as measuring started (at the end it counts our own threads)
    loadavg: float = 0.0
    when: str = ""  # local date and time

    @property
    def efficiency(self) -> float:
        """The share of the measured bandwidth the engine's decode reached."""
        return self.decode_tok_s * self.decode_bytes / (self.bandwidth_gb_s * 1e9)

    @property
    def busy(self) -> bool:
        """Measured while another program was running: its figures may be low."""
        return self.loadavg > BUSY_LOAD

    def worth_measuring_again(self) -> bool:
        """Taken while the machine was busy, and it is idle now: measure once more (a
        measurement taken idle is kept for good)."""
        return self.busy and _loadavg() <= BUSY_LOAD

    def matmul_s(self, body_types: tuple[tuple[str, int], ...]) -> float | None:
        """Seconds a prompt token spends in matrices of `body_types` (2 FLOPs a weight, at
        each type's timed rate); None where one was not timed (or none was: torch)."""
        timed = dict(self.prompt_type_s)
        if not body_types or any(t not in timed for t, _n in body_types):
            return None
        return sum(2.0 * n * timed[t] for t, n in body_types)

    @property
    def bytes_per_parameter(self) -> float:
        """Bytes a decode step reads per weight it multiplies on this engine (torch: its
        kernel's dtype; llama.cpp: the bundled file's quantization, not used)."""
        return self.decode_bytes / max(1, self.decode_parameters)

    def describe(self) -> str:
        """What was measured, in one or two sentences (the browser and the CLI show it)."""
        rates = ", ".join(f"{n:,} in {s:.2f} s" for n, s in self.prefill_points)
        busy = (f" The machine was busy then (load {self.loadavg:.1f}): figures may be low."
                if self.busy else "")
        return (f"Speed predicted from one measurement of this computer ({self.device}, "
                f"{self.threads} threads{', ' + self.when if self.when else ''}): memory "
                f"{self.bandwidth_gb_s:,.1f} GB/s ({self.bandwidth_method}); {self.engine} on "
                f"{self.model}: decode {self.decode_tok_s:,.0f} tok/s "
                f"({self.efficiency:.0%} of that bandwidth), cold prompts of {rates}.{busy}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineSpeed:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["prefill_points"] = tuple((int(n), float(s)) for n, s in values["prefill_points"])
        a, b, d = values["prefill_line"]
        values["prefill_line"] = (float(a), float(b), float(d))
        values["prompt_type_s"] = tuple((str(t), float(x))
                                        for t, x in values.get("prompt_type_s", ()))
        values["model_types"] = tuple((str(t), int(n)) for t, n in values.get("model_types", ()))
        return cls(**values)


BUSY_LOAD = 1.5  # a 1-minute load average above this: another program was running


@dataclass(frozen=True)
class Prediction:
    """A model's predicted speed on one engine here."""

    engine: str
    decode_tok_s: float
    prompt_tokens: int
    prompt_s: float | None  # None: the prompt is longer than the model's context

    def text(self) -> str:
        """'~35 tok/s, 4,000-token prompt ~12 s'."""
        prompt = (f"{self.prompt_tokens:,}-token prompt ~{_seconds(self.prompt_s)}"
                  if self.prompt_s is not None else
                  f"a {self.prompt_tokens:,}-token prompt is over its context")
        return f"~{_rate(self.decode_tok_s)} tok/s, {prompt}"


def predict(cost: ModelCost, speed: EngineSpeed, prompt_tokens: int = PROMPT_TOKENS,
            ) -> Prediction:
    """`cost`'s decode rate and prompt time on `speed`'s engine (the module says how)."""
    if speed.engine == "llama.cpp":
        step_bytes = float(cost.step_bytes)
    else:
        step_bytes = cost.step_parameters * speed.bytes_per_parameter
    decode = speed.efficiency * speed.bandwidth_gb_s * 1e9 / max(step_bytes, 1.0)
    prompt = (prompt_seconds(cost, speed, prompt_tokens)
              if prompt_tokens <= cost.context_length else None)
    return Prediction(speed.engine, decode, prompt_tokens, prompt)


def prompt_seconds(cost: ModelCost, speed: EngineSpeed, tokens: int, cached: int = 0,
                   ) -> float:
    """Seconds to read a prompt's tokens after the first `cached` ones up to `tokens`: the
    bundled model's fitted line, each term scaled by this model's FLOPs against the bundled
    model's (a token at depth x attends over x positions: the n^2 term runs from cached)."""
    a, b, d = speed.prefill_line
    flops = 2.0 * cost.body_parameters / max(speed.prompt_flops_per_token, 1.0)
    per_token = a * flops
    theirs, mine = speed.matmul_s(cost.body_types), speed.matmul_s(speed.model_types)
    if theirs is not None and mine is not None:
        # The bundled model's matrices at their type's rate, the rest of its token (norms,
        # attention at short range, activations) scaled by FLOPs; the model's matrices at theirs.
        per_token = max(0.0, a - mine) * flops + theirs
    pairs = cost.attention / max(speed.attention, 1)
    return (d + per_token * (tokens - cached)
            + b * (tokens * tokens - cached * cached) / 2 * pairs)


@dataclass(frozen=True)
class ModelSpeed:
    """One model priced on one engine's measurement: what the picker and the HUD set the
    model's replies against."""

    cost: ModelCost
    speed: EngineSpeed

    def prediction(self, prompt_tokens: int = PROMPT_TOKENS) -> Prediction:
        return predict(self.cost, self.speed, prompt_tokens)

    def prompt_s(self, tokens: int, cached: int = 0) -> float:
        """Predicted seconds to read tokens cached..tokens of a prompt."""
        return prompt_seconds(self.cost, self.speed, tokens, cached)

    def versus(self, measured: Measured) -> str:
        """The prediction beside what replies measured, each as a rate and the ratio
        measured / predicted: 'decode predicted ~118 tok/s, measured 121 (x1.03); prompts
        (~200 tokens) predicted ~380 tok/s, measured 395 (x1.04)'. The prompts' prediction
        is for the very prompts measured (their lengths and cached prefixes)."""
        parts = []
        predicted = self.prediction().decode_tok_s
        if measured.decode_tok_s is not None:
            ratio = measured.decode_tok_s / predicted
            parts.append(f"decode predicted ~{_rate(predicted)} tok/s, measured "
                         f"{_rate(measured.decode_tok_s)} (x{ratio:.2f})")
        if measured.reads:
            tokens = sum(p - c for c, p, _s in measured.reads)
            rate = tokens / max(sum(self.prompt_s(p, c) for c, p, _s in measured.reads), 1e-9)
            got = tokens / sum(s for _c, _p, s in measured.reads)
            parts.append(f"prompts (~{measured.prefill_tokens:,} tokens) predicted "
                         f"~{_rate(rate)} tok/s, measured {_rate(got)} (x{got / rate:.2f})")
        return "; ".join(parts)


def model_file(spec: str) -> Path | None:
    """The file (or folder) on this disk a model spec names; None for a hub id, a remote
    server or what is not there (measured figures are kept per file)."""
    from engine.model_files import classify, default_gguf_path

    kind = classify(spec)
    try:
        if kind == "default":
            return default_gguf_path()
    except PhasewiseError:
        return None
    return Path(spec).expanduser() if kind in ("gguf", "folder") else None


def info_file(source: str, path: str) -> Path | None:
    """model_file of a loaded model (ModelInfo's source and path: the bundled model's path
    on torch is its converted folder, so its GGUF is found again)."""
    if source == "default":
        return model_file("default")
    return Path(path) if source in ("gguf", "folder") else None


def speed_device(engine: str, device: str = "auto") -> str:
    """Where `engine` runs a model asked for on `device`: the CPU for llama.cpp; torch's pick."""
    if engine == "llama.cpp":
        return "cpu"
    from engine.runtimes.torch.loader import pick_device

    return str(pick_device(device))


def local_model_speed(spec: str, engine: str, device: str = "auto",
                      profiles: SpeedProfiles | None = None) -> ModelSpeed | None:
    """A local GGUF, the bundled model or a Hugging Face folder priced on `engine` from this
    machine's cached measurement; None when the machine has none yet or the files do not
    tell (nothing is measured here: that runs off the GUI thread, in the browser or the
    CLI)."""
    path = model_file(spec)
    if path is None:
        return None
    return file_speed(path, engine, speed_device(engine, device), profiles)


def file_speed(path: Path, engine: str, device: str,
               profiles: SpeedProfiles | None = None) -> ModelSpeed | None:
    """local_model_speed for a model file or folder on `device` (where `engine` runs it)."""
    cost = cost_of(path)
    speed = (profiles or SpeedProfiles()).cached(engine, device) if cost is not None else None
    return ModelSpeed(cost, speed) if cost is not None and speed is not None else None


def _rate(tok_s: float) -> str:
    return f"{tok_s:,.0f}" if tok_s >= 10 else f"{tok_s:.1f}"


def _seconds(s: float | None) -> str:
    s = s or 0.0
    if s < 10:
        return f"{s:.1f} s"
    if s < 120:
        return f"{s:.0f} s"
    return f"{s / 60:.0f} min"


# ----- the cache: one entry per machine and engine build --------------------------------------
def machine_key(engine: str, device: str = "cpu") -> str:
    """What a measurement holds for: the CPU (or GPU), the threads, the engine's build and the
    bundled model it ran, and the way it was measured."""
    from engine.model_files import default_gguf_path
    from engine.runtimes.torch.kernels import allowed_cpus
    from engine.tools.calibrate import device_name

    try:
        bundled = str(default_gguf_path().stat().st_size)
    except (OSError, PhasewiseError):
        bundled = "none"
    return " | ".join([device_name(device), f"{allowed_cpus()} cpus", engine_build(engine),
                       f"bundled {bundled}", METHOD])


def engine_build(engine: str) -> str:
    """The engine's build, without loading its native code."""
    from importlib import metadata

    if engine == "llama.cpp":
        from engine.native import recorded_llama_cpp_build

        try:
            version = metadata.version("llama_cpp_python")
        except metadata.PackageNotFoundError:
            version = "not installed"
        flags = recorded_llama_cpp_build()
        return f"llama-cpp-python {version}" + (f" ({flags})" if flags else "")
    from engine.runtimes.torch.kernels import torch_build

    try:
        transformers = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers = "none"
    return f"{torch_build()}, transformers {transformers}"


class SpeedProfiles:
    """The measurements in the user cache dir (PHASEWISE_CACHE_DIR honoured): read at once,
    measured (seconds, in a child process) only when this machine and build have none."""

    def __init__(self, directory: Path | None = None,
                 measure: Callable[[str, str, threading.Event | None], EngineSpeed]
                 | None = None) -> None:
        self.path = (directory or cache_root()) / SPEED_FILE
        self.measure = measure or measure_engine
        self._lock = threading.Lock()

    def cached(self, engine: str, device: str = "cpu") -> EngineSpeed | None:
        entry = read_json(self.path).get(machine_key(engine, device))
        if not isinstance(entry, dict):
            return None
        try:
            return EngineSpeed.from_dict(entry)
        except (KeyError, TypeError, ValueError):
            return None  # an older layout: measured again

    def get(self, engine: str, device: str = "cpu", stop: threading.Event | None = None,
            *, again: bool = False) -> EngineSpeed:
        """The cached measurement, or a new one (cached; `again`: a new one in any case).
        PhasewiseError (one line) when the engine cannot run here; MeasureCancelled when
        `stop` was set."""
        with self._lock:  # two callers at once measure once
            known = None if again else self.cached(engine, device)
            if known is not None:
                return known
            speed = self.measure(engine, device, stop)
            self.put(engine, device, speed)
            return speed

    def put(self, engine: str, device: str, speed: EngineSpeed) -> None:
        """Cache `speed` as this machine's measurement of `engine` on `device`."""
        write_json_entry(self.path, machine_key(engine, device), speed.to_dict(),
                         MAX_PROFILES)


# ----- measuring ---------------------------------------------------------------------------
class MeasureCancelled(PhasewiseError):
    """The caller stopped the measurement (the window closed): nothing was cached."""


def measure_engine(engine: str, device: str = "cpu", stop: threading.Event | None = None,
                   *, spec: str = "default", lengths: tuple[int, ...] = PREFILL_LENGTHS,
                   decode: tuple[int, int] = (DECODE_PROMPT, DECODE_TOKENS)) -> EngineSpeed:
    """Measure `engine` on this machine: the memory bandwidth (calibrate.device_peaks, cached
    with the HUD's), then the engine on `spec` (the bundled model) in a child process."""
    from engine.tools.calibrate import CalibrationCancelled, device_peaks, measure_peaks

    started = time.perf_counter()
    load = _loadavg()
    try:
        peaks = device_peaks(device, measure=lambda d: measure_peaks(d, stop=stop),
                             refresh=True)  # now, beside the engine (a cached one may be stale)
    except CalibrationCancelled:
        raise MeasureCancelled("measuring stopped") from None
    run = run_engine(spec, engine, device, lengths, decode, stop)
    path = model_file(spec)
    cost = cost_of(path) if path is not None else None
    flops_per_token = 2.0 * (cost.body_parameters if cost else run.parameters)
    return EngineSpeed(
        engine=engine, device=peaks.device, build=engine_build(engine), threads=run.threads,
        bandwidth_gb_s=peaks.bandwidth_gb_s, bandwidth_method=peaks.method or peaks.source,
        model=run.model, kernel=run.kernel, decode_tok_s=run.decode_tok_s,
        decode_bytes=run.weight_bytes_per_step,
        decode_parameters=cost.step_parameters if cost else run.parameters,
        prefill_points=run.prefill, prefill_line=fit_prefill(run.prefill),
        prompt_flops_per_token=flops_per_token, attention=cost.attention if cost else 0,
        prompt_type_s=run.prompt_type_s, model_types=cost.body_types if cost else (),
        measured_s=time.perf_counter() - started, loadavg=load,
        when=time.strftime("%Y-%m-%d %H:%M"))


@dataclass(frozen=True)
class EngineRun:
    """What one model measured on one engine (run_engine)."""

    model: str  # "SmolLM2-135M-Instruct (Q4_1)"
    kernel: str
    threads: int
    decode_tok_s: float  # the best of two decodes at a short context
    weight_bytes_per_step: int
    parameters: int
    prefill: tuple[tuple[int, float], ...]  # (tokens read cold, seconds)
    prompt_type_s: tuple[tuple[str, float], ...] = ()  # EngineSpeed's, llama.cpp only


def run_engine(spec: str, engine: str, device: str = "cpu",
               lengths: tuple[int, ...] = PREFILL_LENGTHS,
               decode: tuple[int, int] = (DECODE_PROMPT, DECODE_TOKENS),
               stop: threading.Event | None = None) -> EngineRun:
    """Load `spec` on `engine` in a child process, as the app loads it; decode (a prompt of
    decode[0] tokens, decode[1] tokens: best of two) and read cold prompts of `lengths`.
    MeasureCancelled when `stop` is set (the child is killed)."""
    from engine.native import NativeChild

    child = NativeChild(_measure_child, spec, engine, device, lengths, decode,
                        what=f"measuring {engine}", daemon=False)  # it loads as the app does
    try:
        raw: dict[str, Any] = _receive(child, stop)
    finally:
        child.close()
    return EngineRun(model=raw["model"], kernel=raw["kernel"], threads=int(raw["threads"]),
                     decode_tok_s=float(raw["decode_tok_s"]),
                     weight_bytes_per_step=int(raw["weight_bytes_per_step"]),
                     parameters=int(raw["parameters"]),
                     prefill=tuple((int(n), float(s)) for n, s in raw["prefill"]),
                     prompt_type_s=tuple((str(t), float(x)) for t, x in raw["prompt_type_s"]))


def fit_prefill(points: Iterable[tuple[int, float]]) -> tuple[float, float, float]:
    """(a, b, d) of s = d + a n + b n^2 / 2 through cold prefills (engine/forecast.py's fit;
    its plain rate, b = d = 0, where noise fits no line with non-negative weights)."""
    from engine.forecast import PrefillCost

    cost = PrefillCost()
    for n, s in points:
        cost.add(0, n, s)
    line = cost.weights()
    if line is None:
        raise PhasewiseError("the prompt timings could not be fitted")
    return line


def _receive(child: Any, stop: threading.Event | None) -> Any:
    """The child's result, polling `stop` every 0.1 s (set: the child is killed)."""
    deadline = time.monotonic() + MEASURE_TIMEOUT_S
    while True:
        if stop is not None and stop.is_set():
            child.kill()
            raise MeasureCancelled("measuring stopped")
        if child.ready(0.1) or time.monotonic() > deadline:
            return child.receive(0)


def _loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):  # Windows
        return 0.0


def _measure_child(conn: Connection, spec: str, engine: str, device: str,
                   lengths: tuple[int, ...], decode: tuple[int, int]) -> None:
    """In the child: load `spec` on `engine`, decode once for the rate (best of two), read
    cold prompts of each length, and on llama.cpp a prompt in each weight type; send the
    figures back."""
    figures = _measure_model(spec, engine, device, lengths, decode)
    figures["prompt_type_s"] = time_prompt_types() if engine == "llama.cpp" else []
    conn.send(("result", figures))


def _measure_model(spec: str, engine: str, device: str, lengths: tuple[int, ...],
                   decode: tuple[int, int]) -> dict[str, Any]:
    from engine import runtimes
    from engine.tools.bench import fixed_prompt_ids, run_ours

    loaded = runtimes.load(spec, engine, device=device)
    try:
        info = loaded.info
        prompt, tokens = decode
        ids = fixed_prompt_ids(loaded, max((prompt, WARM_UP_TOKENS, *lengths)))
        rates = [run_ours(loaded, ids[:prompt], tokens, reuse_cache=False).metrics.decode_tok_s
                 for _ in range(2)]
        # One prompt first, not timed: a chunk (torch: 256 tokens) and a shorter tail, so no
        # timed prompt pays a shape's first-use cost (kernel selection, buffers).
        run_ours(loaded, ids[:min(WARM_UP_TOKENS, max(lengths))], 1, reuse_cache=False)
        prefill = []
        for n in lengths:
            metrics = run_ours(loaded, ids[:n], 1, reuse_cache=False).metrics
            prefill.append((metrics.prefilled_tokens, metrics.prefill_s))
        return {"model": f"{info.name} ({info.dtype})", "kernel": info.kernel,
                "threads": loaded.cpu_threads, "decode_tok_s": max(rates),
                "weight_bytes_per_step": info.weight_bytes_per_step,
                "parameters": info.parameters, "prefill": prefill}
    finally:
        loaded.close()


def time_prompt_types(types: tuple[str, ...] = PROMPT_TYPES,
                      shape: tuple[int, int, int] = SYNTHETIC_SHAPE,
                      tokens: int = TYPE_PROMPT) -> list[tuple[str, float]]:
    """In a child (native code): seconds per body matmul FLOP of a cold `tokens`-token prompt
    on llama.cpp in each weight type, on a synthetic model of `shape` quantized purely to the
    type (the faster of two reads). A type whose file comes out in another type is left out."""
    import tempfile

    from engine.gguf_header import read_gguf
    from engine.tools.synthetic_gguf import quantize, write_f16

    timed = []
    with tempfile.TemporaryDirectory(prefix="phasewise-types-") as folder:
        source = write_f16(Path(folder) / "source.gguf", "llama", *shape, vocab=0)
        for kind in types:
            path = quantize(source, Path(folder) / f"{kind}.gguf", TYPE_FTYPES.get(kind, kind),
                            pure=True)
            stored = dict(_body_types(read_gguf(path)))
            if set(stored) == {kind}:
                seconds = _cold_prompt_s(path, tokens)
                timed.append((kind, seconds / (2.0 * stored[kind] * tokens)))
            path.unlink()
    return timed


def _cold_prompt_s(path: Path, tokens: int) -> float:
    """The faster of two cold reads of a `tokens`-token prompt of `path` on llama.cpp, after
    one untimed read of half as many. Flash attention on for every type alike (no probe per
    file: a 512-token prompt's time is the matmuls')."""
    from engine.runtimes.llamacpp.runtime import load_llama
    from engine.tools.bench import fixed_prompt_ids, run_ours

    loaded = load_llama(path, name=path.stem, source="gguf", progress=None,
                        context_length=2 * tokens, flash_attn=True)
    try:
        ids = fixed_prompt_ids(loaded, tokens)
        run_ours(loaded, ids[: tokens // 2], 1, reuse_cache=False)
        return min(run_ours(loaded, ids, 1, reuse_cache=False).metrics.prefill_s
                   for _ in range(2))
    finally:
        loaded.close()


# ----- what replies measured, per model file ---------------------------------------------------
@dataclass(frozen=True)
class Measured:
    """What a model file's replies measured here (the newest KEEP_REPLIES)."""

    replies: int
    decode_tok_s: float | None  # the median over replies that decoded MIN_DECODE_TOKENS+
    # (cached, prompt, seconds) of the prompts read, MIN_PREFILL_TOKENS+ tokens each
    reads: tuple[tuple[int, int, float], ...] = ()

    @property
    def prefill_tokens(self) -> int:
        """The median count of prompt tokens read (0: none)."""
        return int(statistics.median(p - c for c, p, _s in self.reads)) if self.reads else 0

    @property
    def prefill_tok_s(self) -> float | None:
        """Prompt tokens read per second, over all the reads."""
        if not self.reads:
            return None
        return sum(p - c for c, p, _s in self.reads) / sum(s for _c, _p, s in self.reads)

    def text(self) -> str:
        """'measured over 3 replies: 121 tok/s, prompts read at 395 tok/s (~200 tokens)'."""
        parts = []
        if self.decode_tok_s is not None:
            parts.append(f"{_rate(self.decode_tok_s)} tok/s")
        if self.prefill_tok_s is not None:
            parts.append(f"prompts read at {_rate(self.prefill_tok_s)} tok/s "
                         f"(~{self.prefill_tokens:,} tokens)")
        said = ", ".join(parts) or "too short to say"
        return f"measured over {self.replies} repl{'y' if self.replies == 1 else 'ies'}: {said}"


@dataclass
class MeasuredSpeeds:
    """Replies' decode and prefill figures per model file and engine, in the user cache dir
    (MEASURED_FILE): the picker sets them beside the prediction."""

    directory: Path | None = None
    path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.path = (self.directory or cache_root()) / MEASURED_FILE

    @staticmethod
    def key(path: str | Path, engine: str) -> str | None:
        """A model file on this disk and the engine it ran on (None: not a file here)."""
        try:
            size = Path(path).stat().st_size
        except OSError:
            return None
        return f"{engine} | {Path(path).resolve()} | {size}"

    def add(self, path: str | Path, engine: str, metrics: RequestMetrics) -> None:
        """One reply's figures (a prefill Stop cut short says nothing about the rate)."""
        key = self.key(path, engine)
        if key is None:
            return
        data = read_json(self.path)
        replies = data.get(key)
        replies = replies if isinstance(replies, list) else []
        read = metrics.prefilled_tokens if metrics.prefill_complete else 0
        replies.append({"decode_tok_s": metrics.decode_tok_s,
                        "output_tokens": metrics.output_tokens,
                        "cached_tokens": metrics.cached_tokens, "prefilled_tokens": read,
                        "prefill_s": metrics.prefill_s - metrics.restore_s})
        write_json_entry(self.path, key, replies[-KEEP_REPLIES:], MAX_MODELS)

    def get(self, path: str | Path, engine: str) -> Measured | None:
        key = self.key(path, engine)
        replies = read_json(self.path).get(key) if key is not None else None
        if not isinstance(replies, list) or not replies:
            return None
        try:
            decodes = [float(r["decode_tok_s"]) for r in replies
                       if int(r["output_tokens"]) >= MIN_DECODE_TOKENS]
            reads = tuple((int(r["cached_tokens"]),
                           int(r["cached_tokens"]) + int(r["prefilled_tokens"]),
                           float(r["prefill_s"])) for r in replies
                          if int(r["prefilled_tokens"]) >= MIN_PREFILL_TOKENS
                          and float(r["prefill_s"]) > 0)
        except (KeyError, TypeError, ValueError):
            return None
        return Measured(len(replies), statistics.median(decodes) if decodes else None, reads)


def cost_of(path: Path) -> ModelCost | None:
    """A local GGUF's or Hugging Face folder's cost; None where its headers cannot be read."""
    if path.is_dir():
        return ModelCost.from_folder(path)
    try:
        return ModelCost.from_gguf_file(path)
    except (OSError, ValueError, struct.error):
        return None
