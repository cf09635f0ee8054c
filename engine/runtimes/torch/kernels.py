"""Decode paths ("kernels") and the run-time choice between them.

Decode reads every weight once per token, so on a CPU the way past fp32's bandwidth limit is
fewer bytes per weight. Which kernel wins depends on the CPU (facts.md: int8pack/int4pack and
bf16 lose on AVX2-only parts, fbgemm dynamic int8 wins), so `auto` measures: a short timed
probe of each available path, guarded by perplexity on a fixed text, cached per model and CPU.

Before that probe runs a path in this process, its native op runs once on a two-Linear model
in a child process (engine.native), cached per CPU and torch version: a path whose kernel
crashes here (SIGILL on an instruction set the CPU advertises but faults on) is skipped with
the reason logged, instead of killing the app.

A path never modifies the loaded model: it returns a new LoadedModel whose model shares the
unchanged tensors (embedding, norms) with the original, so a caller may keep the fp32
reference (benchmarks) or drop it (the engine).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import hashlib
import json
import logging
import math
import os
import platform
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

from engine.errors import ModelLoadError, one_line
from engine.events import ModelInfo
from engine.machine import cpu_name as cpu_name
from engine.machine import read_json, write_json_entry
from engine.model_files import cache_root
from engine.native import ChildError, NativeChild, NativeCrashError
from engine.runtimes.torch.file_pages import clean_file_mappings, release_file_pages
from engine.runtimes.torch.loader import LoadedModel
from engine.runtimes.torch.quality import perplexity, reference_ids, within_tolerance

log = logging.getLogger(__name__)

AUTO = "auto"
PROBE_TEXT_TOKENS = 48
PROBE_WARM_STEPS = 2
PROBE_TIMED_STEPS = 6
PROBE_FILE = "kernel-probe.json"
PROBE_FILE_MAX_ENTRIES = 64
SMOKE_FILE = "kernel-smoke.json"
SMOKE_WIDTH = 256
SMOKE_ROWS = (1, 16)  # a decode step's shape and a prefill's
SMOKE_TIMEOUT_S = 120.0  # per path, from the child's start (it imports torch)


class KernelUnavailableError(ModelLoadError):
    """A kernel was forced (--kernel NAME) that cannot run this model here."""


@dataclass(frozen=True)
class KernelPath:
    """One way to run decode. unavailable() returns a one-line reason, or None if it can run;
    build() returns the model object this path decodes with; smoke(), when given, runs the
    path's native op on a tiny model (a module-level callable: it runs in a child process)."""

    name: str
    summary: str
    unavailable: Callable[[LoadedModel], str | None]
    build: Callable[[LoadedModel], Any]
    smoke: Callable[[], None] | None = None


# ----- eager (the model as loaded) ---------------------------------------------------------
def _eager_path(tag: str, dtype: torch.dtype) -> KernelPath:
    def unavailable(loaded: LoadedModel) -> str | None:
        actual = _param_dtype(loaded.model)
        if actual != dtype:
            return (f"{tag}-eager needs {tag} weights (the model is loaded as "
                    f"{str(actual).removeprefix('torch.')}; pass --dtype {tag})")
        return None

    return KernelPath(f"{tag}-eager", f"the model as loaded, {tag}, no compilation",
                      unavailable, _as_loaded, partial(smoke_linear, _as_loaded, tag))


def _as_loaded(loaded: LoadedModel) -> Any:
    return loaded.model


# ----- fbgemm dynamic Linear (int8 or fp16 weights) ----------------------------------------------
def _fbgemm_unavailable(name: str) -> Callable[[LoadedModel], str | None]:
    def unavailable(loaded: LoadedModel) -> str | None:
        if loaded.device.type != "cpu":
            return f"{name} runs on CPU only (the model is on {loaded.device.type})"
        if _param_dtype(loaded.model) != torch.float32:
            return f"{name} needs float32 weights to convert (pass --dtype float32)"
        engines = set(torch.backends.quantized.supported_engines) - {"none"}
        if not engines & {"x86", "fbgemm", "qnnpack"}:
            return f"{name} needs torch's fbgemm/x86/qnnpack quantized engine, absent here"
        if not any(isinstance(m, nn.Linear) for m in loaded.model.modules()):
            return f"{name} found no Linear layers in this model"
        return None

    return unavailable


class PackedLinear(DynamicLinear):
    """torch.ao's dynamic quantized Linear (int8 or fp16 weights packed for fbgemm) that knows
    its bias's bytes: asking the fp16 packed weight for its bias unpacks the whole weight."""

    bias_bytes: int = 0


def _int8_dynamic_model(loaded: LoadedModel) -> Any:
    """A copy whose nn.Linear layers (the tied lm_head included) hold int8 weights with
    per-output-channel scales; activations are quantized per step. The input embedding
    stays fp32 (a lookup reads one row, and it keeps the tied head's fp32 tensor intact)."""
    from torch.ao.quantization import per_channel_dynamic_qconfig

    # torch.ao.quantization is deprecated in favour of torchao, which on AVX2-only CPUs
    # dispatches to the slower int8pack kernel; fbgemm's dynamic Linear is the one that wins.
    return _with_dynamic_linears(loaded.model, per_channel_dynamic_qconfig)


def _fp16_dynamic_model(loaded: LoadedModel) -> Any:
    """A copy whose nn.Linear layers hold fp16 weights in fbgemm's packed layout, computing
    in fp32: half fp32's bytes, and unlike int8-dynamic each row's result is independent of
    the other rows in the batch (no per-batch activation scale)."""
    from torch.ao.quantization import float16_dynamic_qconfig

    return _with_dynamic_linears(loaded.model, float16_dynamic_qconfig)


def _with_dynamic_linears(model: nn.Module, qconfig: Any) -> nn.Module:
    """A copy of model (sharing its other tensors) whose nn.Linear layers are torch.ao dynamic
    Linears under qconfig: what quantize_dynamic makes, one layer at a time."""
    copied = share_tensors_copy(model)
    linears = [(parent, name, child) for parent in copied.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    clean = clean_file_mappings()  # once: no conversion writes to the weights' file mapping
    with warnings.catch_warnings():  # the deprecated torch.ao API; see _int8_dynamic_model
        warnings.filterwarnings("ignore", message=r"(?is).*deprecat")
        for parent, name, linear in linears:
            setattr(parent, name, _dynamic_linear(linear, qconfig, clean))
    return copied


def _dynamic_linear(linear: nn.Linear, qconfig: Any, clean: list[tuple[int, int]]
                    ) -> PackedLinear:
    """torch.ao's DynamicLinear.from_float, less its first step: that builds and packs a zero
    weight of the full shape before packing the real one (for a 262k-token head, 0.7 GB more
    at load for fp16, 0.3 GB for int8). `clean`: the file mappings whose pages may be given
    back (clean_file_mappings)."""
    from torch.ao.nn.quantized.modules.utils import _quantize_weight

    observer = qconfig.weight()
    observer(linear.weight)
    weight = linear.weight.float()
    int8 = observer.dtype == torch.qint8
    if int8:
        weight = _quantize_weight(weight, observer)
    # torch.ao is untyped (no-untyped-call)
    packed = PackedLinear(1, 1, dtype=observer.dtype)  # type: ignore[no-untyped-call]
    # The float pages are given back once read for the last time (int8: by the quantizer,
    # before packing, so one copy of a large head is held at a time; fp16: by the packing);
    # read back from the file if needed again: a tied head's are the embedding's, whose
    # lookups then read the rows they use.
    if int8:
        release_file_pages([linear.weight], clean)
    packed.set_weight_bias(weight, linear.bias)
    if not int8:
        release_file_pages([linear.weight], clean)
    packed.in_features, packed.out_features = linear.in_features, linear.out_features
    bias = linear.bias
    packed.bias_bytes = 0 if bias is None else bias.numel() * bias.element_size()
    return packed


def share_tensors_copy(model: nn.Module) -> nn.Module:
    """A structural copy of model whose parameters and buffers are the original tensors,
    so swapping modules in the copy costs no extra weight memory and leaves model intact."""
    memo: dict[int, Any] = {id(t): t for t in model.parameters()}
    memo.update({id(t): t for t in model.buffers()})
    return copy.deepcopy(model, memo)


def smoke_linear(build: Callable[[LoadedModel], Any], tag: str) -> None:
    """Build a path on a two-Linear CPU model of dtype `tag` ("fp32", "bf16", "fp16") and run
    a forward at a decode shape and a prefill shape: the path's native kernels, in ms."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[tag]
    model = nn.Sequential(nn.Linear(SMOKE_WIDTH, 2 * SMOKE_WIDTH),
                          nn.Linear(2 * SMOKE_WIDTH, SMOKE_WIDTH)).to(dtype)
    info = ModelInfo(name="smoke", source="folder", path="", device="cpu", dtype=tag,
                     context_length=max(SMOKE_ROWS), parameters=0, weight_bytes_per_step=0,
                     kernel="")
    built = build(LoadedModel(model=model, tokenizer=None, info=info))
    with torch.inference_mode():
        for rows in SMOKE_ROWS:
            built(torch.randn(rows, SMOKE_WIDTH, dtype=dtype))


KERNELS: dict[str, KernelPath] = {
    path.name: path
    for path in (
        _eager_path("fp32", torch.float32),
        _eager_path("bf16", torch.bfloat16),
        _eager_path("fp16", torch.float16),
        KernelPath("int8-dynamic",
                   "int8 weights per output channel, fbgemm dynamic Linear (CPU)",
                   _fbgemm_unavailable("int8-dynamic"), _int8_dynamic_model,
                   partial(smoke_linear, _int8_dynamic_model, "fp32")),
        KernelPath("fp16-dynamic",
                   "fp16 weights, fp32 compute, fbgemm packed Linear (CPU)",
                   _fbgemm_unavailable("fp16-dynamic"), _fp16_dynamic_model,
                   partial(smoke_linear, _fp16_dynamic_model, "fp32")),
    )
}
KERNEL_CHOICES = (AUTO, *KERNELS)


def eager_name(loaded: LoadedModel) -> str:
    return f"{_dtype_tag(_param_dtype(loaded.model))}-eager"


# ----- choosing ------------------------------------------------------------------------------
def select_kernel(loaded: LoadedModel, requested: str = AUTO, *,
                  progress: Callable[[str], None] | None = None,
                  use_probe_cache: bool = True) -> LoadedModel:
    """The model prepared for the requested kernel; `auto` picks by a cached timed probe.

    A forced kernel that cannot run raises KernelUnavailableError (one line). Under auto, a
    path that is unavailable, whose smoke run in a child process fails or crashes, or that
    fails to build is skipped, logged once, and eager remains.
    """
    configure_threads()
    if requested != AUTO:
        return apply_kernel(loaded, requested)
    candidates = [name for name in KERNELS if KERNELS[name].unavailable(loaded) is None]
    if len(candidates) <= 1 or loaded.device.type != "cpu":
        return apply_kernel(loaded, eager_name(loaded))
    key = probe_key(loaded, candidates)
    choice = read_probe_cache(key) if use_probe_cache else None
    if choice is None or choice not in candidates:
        if progress:
            progress("choosing a decode kernel (a few seconds, once per model and CPU)")
        report, last = probe(loaded, smoke_tested(loaded, candidates))
        choice = report["choice"]
        write_probe_cache(key, report)
        if last is not None and last.info.kernel == choice:
            return last
        del last  # before the choice is built again: one converted copy at a time
        gc.collect()
    try:
        return apply_kernel(loaded, choice)
    except Exception as exc:  # a cached choice that no longer builds: eager, one line
        log.warning("kernel %s failed to build (%s); using %s", choice, one_line(exc),
                    eager_name(loaded))
        return apply_kernel(loaded, eager_name(loaded))


def apply_kernel(loaded: LoadedModel, name: str) -> LoadedModel:
    """The model prepared for kernel `name`, with ModelInfo describing what actually runs."""
    path = KERNELS.get(name)
    if path is None:
        raise KernelUnavailableError(
            f"unknown kernel {name!r}; use one of {', '.join(KERNEL_CHOICES)}")
    reason = path.unavailable(loaded)
    if reason is not None:
        raise KernelUnavailableError(reason)
    model = path.build(loaded)
    info = dataclasses.replace(loaded.info, kernel=name,
                               weight_bytes_per_step=decode_weight_bytes(model))
    return LoadedModel(model=model, tokenizer=loaded.tokenizer, info=info)


def probe(loaded: LoadedModel, names: list[str]) -> tuple[dict[str, Any], LoadedModel | None]:
    """Time a few decode steps of each path against eager's, alternating the two step by
    step so machine noise hits both alike, and check each path's perplexity against eager's.
    The paths are built one at a time, each dropped before the next is built: a converted
    copy of a large-vocabulary head is hundreds of MB, and holding every path at once more
    than doubled the first load's peak memory. Returns the report (`choice` = the fastest
    path within the perplexity tolerance) and the last path built, which the caller keeps if
    it is the choice."""
    reference = eager_name(loaded)
    eager = apply_kernel(loaded, reference)  # shares the loaded weights: no copy
    text = reference_ids(loaded.tokenizer, PROBE_TEXT_TOKENS)
    ppl = {reference: perplexity(eager.model, text, loaded.device)}
    # The fastest step, not the median: other processes only ever add time, and on a
    # shared 2-core machine they add it unevenly.
    fastest_s: dict[str, float] = {}
    last: LoadedModel | None = None
    for name in (n for n in names if n != reference):
        last = None  # the previous path is freed before this one is built
        gc.collect()
        try:
            last = apply_kernel(loaded, name)
        except Exception as exc:
            log.warning("kernel %s is unavailable here (%s); skipping it", name, one_line(exc))
            continue
        ppl[name] = perplexity(last.model, text, loaded.device)
        steps = _alternating_step_times({reference: eager, name: last}, text[:8])
        for timed, times in steps.items():
            fastest_s[timed] = min(fastest_s.get(timed, math.inf), *times)
    if not fastest_s:  # eager alone: nothing to race it against, but its rate is reported
        fastest_s = {reference: min(_alternating_step_times({reference: eager}, text[:8])
                                    [reference])}
    tok_s = {n: 1.0 / fastest_s[n] for n in ppl if n in fastest_s}
    passing = [n for n in tok_s if within_tolerance(ppl[n], ppl[reference])]
    choice = max(passing, key=lambda n: tok_s[n])
    for n in tok_s:
        if n not in passing:
            log.warning("kernel %s failed the quality guard (perplexity %.3f vs %.3f); "
                        "not used", n, ppl[n], ppl[reference])
    report = {"choice": choice, "reference": reference, "decode_tok_s": tok_s,
              "perplexity": ppl, "measured_at": time.time()}
    return report, last


@torch.inference_mode()
def _alternating_step_times(built: dict[str, LoadedModel], prompt: list[int]
                            ) -> dict[str, list[float]]:
    from transformers import DynamicCache

    states = {}
    for name, lm in built.items():
        cache = DynamicCache(config=lm.model.config)
        logits = lm.model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True,
                          logits_to_keep=1).logits
        states[name] = (cache, int(logits[0, -1].argmax()))
    times: dict[str, list[float]] = {name: [] for name in built}
    for step in range(PROBE_WARM_STEPS + PROBE_TIMED_STEPS):
        for name, lm in built.items():
            cache, token = states[name]
            start = time.perf_counter()
            logits = lm.model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True,
                              logits_to_keep=1).logits
            token = int(logits[0, -1].argmax())
            elapsed = time.perf_counter() - start
            states[name] = (cache, token)
            if step >= PROBE_WARM_STEPS:
                times[name].append(elapsed)
    return times


# ----- smoke runs: each path's native op, once, in a child process -----------------------------
def smoke_tested(loaded: LoadedModel, names: list[str]) -> list[str]:
    """names less the paths whose smoke run fails or crashes here (each logged once). The
    model's own eager path is not run: it is what remains, whatever happens."""
    reference = eager_name(loaded)
    failures = smoke_failures([n for n in names
                               if n != reference and KERNELS[n].smoke is not None])
    for name, reason in failures.items():
        log.warning("kernel %s is skipped: its smoke run in a child process %s", name, reason)
    return [n for n in names if n not in failures]


def smoke_failures(names: list[str]) -> dict[str, str]:
    """{name: reason} for the paths among names whose smoke run failed, from the cache (per
    CPU and torch) or from a child process for the paths not in it yet."""
    if not names:
        return {}
    key = smoke_key()
    known = read_json(smoke_cache_path()).get(key)
    known = dict(known) if isinstance(known, dict) else {}
    missing = [n for n in names if n not in known]
    if missing:
        known |= run_smoke([(n, KERNELS[n].smoke) for n in missing])
        write_json_entry(smoke_cache_path(), key, known, PROBE_FILE_MAX_ENTRIES)
    return {n: known[n] for n in names if known.get(n)}


def run_smoke(jobs: list[tuple[str, Any]]) -> dict[str, str | None]:
    """{name: None if its smoke run passed, else why not} for each job, run in order in a
    child process; after a crash a fresh child takes the rest. A child that dies before it
    starts any path fails all remaining paths (uncached: that may pass another time)."""
    results: dict[str, str | None] = {}
    pending = list(jobs)
    while pending:
        child = NativeChild(_smoke_child, pending, what="kernel smoke run")
        current: str | None = None
        try:
            while pending:
                current = child.receive(SMOKE_TIMEOUT_S)
                results[current] = child.receive(SMOKE_TIMEOUT_S)
                pending.pop(0)
                current = None
        except (NativeCrashError, ChildError) as exc:
            reason = (f"{exc.reason} ({torch_build()})" if isinstance(exc, NativeCrashError)
                      else f"failed: {exc}")
            if current is None:
                log.warning("kernel smoke runs could not run (%s); skipping %s", reason,
                            ", ".join(name for name, _ in pending))
                return results | {name: reason for name, _ in pending if name not in results}
            results[current] = reason
            pending.pop(0)
        finally:
            child.close()
    return results


def _smoke_child(conn: Connection, jobs: list[tuple[str, Callable[[], None]]]) -> None:
    """In the child: for each path, say its name, run its smoke, answer None or a reason."""
    for name, smoke in jobs:
        conn.send(("start", name))
        try:
            smoke()
            conn.send(("done", None))
        except Exception as exc:
            conn.send(("done", f"failed: {one_line(exc)}"))


def torch_build() -> str:
    """torch's version and the CPU capability its kernels dispatch to ('AVX512')."""
    return f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}"


def smoke_key() -> str:
    """Identifies (CPU, architecture, torch build): smoke results hold for any model."""
    parts = [cpu_name(), platform.machine(), torch_build()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def smoke_cache_path() -> Path:
    return cache_root() / SMOKE_FILE


# ----- probe cache -----------------------------------------------------------------------------
def probe_key(loaded: LoadedModel, candidates: list[str]) -> str:
    """Identifies (model, CPU, threads, torch, candidate set): a new one re-probes."""
    info = loaded.info
    parts = [info.name, info.path, str(info.parameters), info.dtype, cpu_name(),
             str(torch.get_num_threads()), torch.__version__, ",".join(candidates)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def probe_cache_path() -> Path:
    return cache_root() / PROBE_FILE


def read_probe_cache(key: str) -> str | None:
    try:
        entry = json.loads(probe_cache_path().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return entry.get("choice") if isinstance(entry, dict) else None


def write_probe_cache(key: str, report: dict[str, Any]) -> None:
    """Best effort: an unwritable cache dir only means the next start probes again."""
    write_json_entry(probe_cache_path(), key, report, PROBE_FILE_MAX_ENTRIES)


# ----- sizes, threads, helpers ------------------------------------------------------------------
def decode_weight_bytes(model: nn.Module) -> int:
    """Weight bytes one decode step reads: every distinct fp parameter once, each int8 Linear's
    bytes plus its scales, and one row of an input embedding that no output head shares."""
    params = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    for module in model.modules():
        total += _packed_linear_bytes(module)
    embed = model.get_input_embeddings().weight  # type: ignore[operator]  # a PreTrainedModel
    head = model.get_output_embeddings()  # type: ignore[operator]  # the same: nn.Module
    head_weight = getattr(head, "weight", None)
    tied = isinstance(head_weight, torch.Tensor) and head_weight.data_ptr() == embed.data_ptr()
    if not tied:
        total -= (embed.shape[0] - 1) * embed.shape[1] * embed.element_size()
    return int(total)


def _packed_linear_bytes(module: nn.Module) -> int:
    """Bytes of a packed Linear (its weights are not parameters), from its shape: unpacking
    the weight to count it would copy it to fp32 (671 MB for a 262k-token head, at load).
    int8 weights carry one fp32 scale per output channel."""
    if not isinstance(module, PackedLinear):
        return 0
    rows, columns = int(module.out_features), int(module.in_features)
    if module._packed_params.dtype == torch.float16:
        return rows * columns * 2 + module.bias_bytes
    return rows * columns + rows * 4 + module.bias_bytes


def allowed_cpus() -> int:
    """The CPUs this process may run on (torch counts the host's cores, which oversubscribes
    a container or a taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def configure_threads() -> int:
    """Intra-op threads at most the CPUs this process may run on; returns the count in use."""
    allowed = allowed_cpus()
    if torch.get_num_threads() > allowed:
        torch.set_num_threads(allowed)
    return torch.get_num_threads()


def _param_dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _dtype_tag(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype).removeprefix("torch."))

