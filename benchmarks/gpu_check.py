"""The torch engine proven on one device: correctness, speed against the copy bandwidth, and
the HUD's own numbers against external timing. One JSON report plus a Markdown table.

    python benchmarks/gpu_check.py --out DIR                  # a CUDA GPU: bf16, ~1B and ~8B
    .venv/bin/python benchmarks/gpu_check.py --device cpu     # tiny shapes, well under a minute

Sections (each step reports pass / fail / measured / skipped / error on one line; a step that
fails, or needs a package that is missing, is reported and the rest still runs):
  setup        versions, carried wheels, whether transformers takes the engine's `cache=`
  correctness  on the correctness model (the bundled SmolLM2 in bf16 on CUDA when it is here,
               else a tiny random Llama in fp32), through the Engine thread: greedy equals
               transformers generate() on the same device; a cached turn equals the same turn
               cold; N alternatives and a batch equal the same requests one by one; cancel
               stops within a step; an injected out-of-memory error ends one reply and the next
               works; the static-cache decoder equals the engine. A greedy mismatch whose
               reference choice was a near tie (top-2 logit gap within the dtype's rounding)
               passes and says so: batched bf16 matmuls round differently.
  speed        device copy bandwidth (the peak); on ~8B and ~1B Llama-shaped models with random
               bf16 weights (no download; tiny shapes on CPU): batch-1 decode through the
               engine's eager loop, the static cache, static + CUDA graphs (torch.compile
               reduce-overhead), each as tok/s and weight GB/s; cached vs cold TTFT of a 4k
               prompt; batch sweep 1-64 through the engine's batcher; the cost of verifying 7
               tokens in one pass; prompt-lookup speculation on the correctness model.
  hud          the HUD's numbers (engine events folded by ui.hud.model) equal the events'
               stamps and lie inside the interval a clock in the calling thread saw (a check);
               their distance from that clock: TTFT, decode tok/s, end-to-end (measured, with
               whether it is within 5%).
Targets (issue 19) close the table: 8B static+graphs >= 70% of the copy bandwidth, cached 4k
TTFT <= 0.1x cold, batch 64 >= 20x batch 1.

On a lent GPU machine (torch and transformers preinstalled, nothing fetchable): `make gpu-wheels`
here puts what it lacks under .gpu/ (ignored): the project's transformers and gguf wheels, which
this script unpacks and puts first on sys.path where the installed version differs, and the
bundled GGUF in two parts (.gpu/model-1, .gpu/model-2), joined when both are there. A call
carries at most 64 MiB, so the bundled model needs two calls on one warm machine:
    run  carry [.gpu/wheels, .gpu/model-1]  timeout_s 540
         PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT
    run  carry [.gpu/wheels, .gpu/model-2]  timeout_s 300   (at once: the machine keeps part 1)
         PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --sizes none --out $OUT
The first alone checks correctness on the tiny model and says so. The report on disk is
rewritten after every step. Never imports Qt. Exit status 1: a setup or correctness check
failed (timings and targets are reported, never asserted).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from engine import ChatMessage, GenerationRequest, GenerationResult
    from engine.runtimes.torch.loader import LoadedModel
    from engine.worker import Engine

ROOT = Path(__file__).resolve().parents[1]
CARRIED = ROOT / ".gpu"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Not on the GPU machine, or too old there: transformers < 5.24 ignores the engine's `cache=`.
CARRIED_PACKAGES = ("transformers", "gguf")
SECTIONS = ("setup", "correctness", "speed", "hud")
# Llama-3.1-8B and Llama-3.2-1B shapes; tiny ones stand in on a CPU.
SHAPES: dict[str, dict[str, Any]] = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               tie_word_embeddings=True),
    "cpu-b": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                  tie_word_embeddings=False),
    "cpu-a": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                  tie_word_embeddings=True),
}
CHAT_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
)
HUD_TOLERANCE = 0.05
QT_MODULES = {"PySide6", "PyQt6", "PyQt5", "shiboken6", "pyqtgraph", "qasync"}


# ----- the report ------------------------------------------------------------------------------
@dataclass
class Step:
    section: str
    name: str
    status: str  # pass | fail | measured | skipped | error
    line: str
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


class Outcome(Exception):
    """Raised inside a step to end it with a status and a line (skipped: a missing piece)."""

    def __init__(self, status: str, line: str, **data: Any) -> None:
        super().__init__(line)
        self.status, self.line, self.data = status, line, data


class Report:
    """Runs steps under one time budget; a step's failure never stops the next one."""

    def __init__(self, budget_s: float, sections: set[str]) -> None:
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.sections = sections
        self.steps: list[Step] = []
        self.failed_needs: dict[str, str] = {}  # a prerequisite that did not come about -> why
        # Called after each step: the report on disk stays current, so a run stopped from
        # outside (the device call's time limit) still leaves what it measured.
        self.after_step: Callable[[], object] = lambda: None

    def remaining(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def run(self, section: str, name: str, fn: Callable[[], tuple[str, str, dict[str, Any]]],
            *, needs: tuple[str, ...] = (), min_s: float = 0.0, provides: str = "") -> Step:
        """Run fn -> (status, line, data); record it. Skips when the section is off, a need
        failed, or less than min_s of the budget is left."""
        reason = self._skip_reason(section, needs, min_s)
        if reason is None:
            step = self._execute(section, name, fn)
        else:
            step = Step(section, name, "skipped", reason)
        if provides and step.status not in ("pass", "measured"):
            self.failed_needs[provides] = f"{name}: {step.status}"
        self.steps.append(step)
        print(f"[{time.perf_counter() - self.start:6.1f}s] {section:<11} {step.status:<8} "
              f"{name}: {step.line}", flush=True)
        self.after_step()
        return step

    def _skip_reason(self, section: str, needs: tuple[str, ...], min_s: float) -> str | None:
        if section not in self.sections:
            return "section not selected"
        for need in needs:
            if need in self.failed_needs:
                return f"needs {need} ({self.failed_needs[need]})"
        left = self.remaining()
        if left < min_s:
            return f"over the time budget ({max(left, 0):.0f} s left of {self.budget_s:.0f} s)"
        return None

    @staticmethod
    def _execute(section: str, name: str,
                 fn: Callable[[], tuple[str, str, dict[str, Any]]]) -> Step:
        start = time.perf_counter()
        try:
            status, line, data = fn()
        except Outcome as out:
            status, line, data = out.status, out.line, out.data
        except ModuleNotFoundError as exc:
            status, line, data = "skipped", f"missing package {exc.name}", {"missing": exc.name}
        except Exception as exc:
            text = str(exc).strip().splitlines()
            status, line = "error", f"{type(exc).__name__}: {text[0] if text else ''}"
            data = {"traceback": traceback.format_exc(limit=8)}
        return Step(section, name, status, line, time.perf_counter() - start, data)


# ----- carried wheels and files ------------------------------------------------------------------
def use_carried_wheels(folder: Path, target: Path) -> list[str]:
    """Unpack each pure-Python wheel in folder whose version differs from the installed one
    (or that is not installed) into target, and put target first on sys.path. Must run before
    torch or transformers is imported. Returns "name version (installed: x)" lines."""
    used: list[str] = []
    for wheel in sorted(folder.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        try:
            installed = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            installed = "none"
        if installed == version:
            continue
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
        used.append(f"{name} {version} (installed: {installed})")
    if used:
        sys.path.insert(0, str(target))
    return used


def split_gguf(source: Path, folder: Path, parts: int = 2) -> list[Path]:
    """Write source as `parts` folders folder/model-1 .. model-N, each one part plus the
    manifest (names and sha256), so that each fits one device call's carry limit."""
    data = source.read_bytes()
    size = -(-len(data) // parts)
    names = [f"{source.name}.part{i}" for i in range(1, parts + 1)]
    manifest = json.dumps({"name": source.name, "parts": names,
                           "sha256": hashlib.sha256(data).hexdigest()})
    folders = []
    for i, name in enumerate(names):
        sub = folder / f"model-{i + 1}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / name).write_bytes(data[i * size : (i + 1) * size])
        (sub / f"{source.name}.json").write_text(manifest, "utf-8")
        folders.append(sub)
    return folders


def prepare(folder: Path) -> None:
    """Fill folder (make gpu-wheels: .gpu/) with what the GPU machine lacks: pure-Python wheels
    of this environment's CARRIED_PACKAGES (pip download, the same versions) and the bundled
    GGUF split in two (each part plus the wheels fits one call's 64 MiB)."""
    from engine.model_files import default_gguf_path

    shutil.rmtree(folder, ignore_errors=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in CARRIED_PACKAGES]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary=:all:", "-d", str(folder / "wheels"), *pins], check=True)
    for sub in [folder / "wheels", *split_gguf(default_gguf_path(), folder)]:
        size = sum(f.stat().st_size for f in sub.iterdir())
        print(f"{sub}: {size / 2**20:.1f} MiB")


def carried_gguf(folder: Path, target: Path) -> tuple[Path | None, str]:
    """The bundled GGUF joined from the parts in folder/model-*/ (split_gguf); (None, why)
    when it is not complete here."""
    manifests = sorted(folder.glob(f"model-*/{GGUF_NAME}.json"))
    if not manifests:
        return None, "no carried parts (make gpu-wheels writes them)"
    manifest = json.loads(manifests[0].read_text("utf-8"))
    found = {p.name: p for p in folder.glob(f"model-*/{GGUF_NAME}.part*")}
    missing = [name for name in manifest["parts"] if name not in found]
    if missing:
        have = len(manifest["parts"]) - len(missing)
        return None, (f"{have} of {len(manifest['parts'])} parts here (each call carries "
                      "one; a warm machine keeps the last call's)")
    joined = target / GGUF_NAME
    digest = hashlib.sha256()
    with joined.open("wb") as out:
        for name in manifest["parts"]:
            data = found[name].read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != manifest["sha256"]:
        return None, "the carried parts do not add up to the bundled file (sha256 differs)"
    return joined, "joined from carried parts"


# ----- shared helpers ----------------------------------------------------------------------------
@dataclass
class Context:
    args: argparse.Namespace
    device: torch.device
    workdir: Path
    report: Report
    cuda: bool = False
    copy_gb_s: float = 0.0
    engine: Engine | None = None
    reference: LoadedModel | None = None  # the correctness model, for the calling thread
    model_label: str = ""
    device_name: str = ""
    baseline: dict[str, list[int]] = field(default_factory=dict)  # prompt -> engine tokens
    speed: dict[str, dict[str, Any]] = field(default_factory=dict)  # model -> decode rows
    hud: HudRun | None = None  # the reply the HUD steps watched


def sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def chat_request(text: str, max_tokens: int, *, temperature: float = 0.0,
                 seed: int | None = None, ignore_eos: bool = False,
                 messages: list[ChatMessage] | None = None,
                 **request: Any) -> GenerationRequest:
    """One user message (or the given messages) as a request; request: GenerationRequest's
    other fields (conversation_id, reuse_cache)."""
    from engine import ChatMessage, GenerationRequest, SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                            ignore_eos=ignore_eos, seed=seed)
    return GenerationRequest(messages=messages or [ChatMessage("user", text)], params=params,
                             **request)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tie_tolerance(dtype: torch.dtype) -> float:
    """Top-2 logit gap under which two kernels may legitimately disagree (rounding)."""
    import torch

    return {torch.bfloat16: 0.125, torch.float16: 0.03}.get(dtype, 1e-3)


def compare_greedy(reference: LoadedModel, prompt: list[int], expected: list[int],
                   actual: list[int]) -> tuple[bool, str, dict[str, Any]]:
    """(ok, note, data): identical, or diverged where the expected choice was a near tie."""
    import torch

    k = first_difference(expected, actual)
    if k is None:
        return True, "identical", {}
    if k >= min(len(expected), len(actual)):
        return False, f"lengths differ ({len(expected)} vs {len(actual)})", {"at": k}
    ids = torch.tensor([prompt + expected[:k]], device=reference.device)
    with torch.inference_mode():
        logits = reference.model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    gap = abs(float(logits[expected[k]] - logits[actual[k]]))
    tol = tie_tolerance(next(reference.model.parameters()).dtype)
    data = {"at": k, "gap": gap, "tolerance": tol}
    if gap <= tol:
        return True, f"near tie at token {k} (gap {gap:.3g} <= {tol:g})", data
    return False, f"differs at token {k} (top-2 gap {gap:.3g} > {tol:g})", data


def summarize(checks: list[tuple[bool, str]]) -> tuple[str, str]:
    ok = all(c[0] for c in checks)
    notes = sorted({c[1] for c in checks})
    return ("pass" if ok else "fail"), "; ".join(notes)


# ----- setup --------------------------------------------------------------------------------------
def step_environment(ctx: Context, carried: list[str]) -> tuple[str, str, dict[str, Any]]:
    import torch
    import transformers

    data: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "device": str(ctx.device),
        "carried_wheels": carried,
    }
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        data.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, sms=props.multi_processor_count)
        name = props.name
    else:
        from engine.runtimes.torch.kernels import cpu_name

        name = f"cpu: {cpu_name()}, {torch.get_num_threads()} threads"
    ctx.device_name = name
    missing = [m for m in ("gguf", "accelerate", "platformdirs")
               if importlib.util.find_spec(m) is None]
    data["missing_optional"] = missing
    line = f"{name}; torch {torch.__version__}, transformers {transformers.__version__}"
    if carried:
        line += f"; carried: {', '.join(carried)}"
    if missing:
        line += f"; missing: {', '.join(missing)} (only the bundled model's conversion needs them)"
    return "measured", line, data


def step_cache_keyword(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    """The engine passes its KV cache as `cache=`; older transformers take past_key_values=
    and silently ignore the keyword, which would make every cached step wrong."""
    import torch
    import transformers
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    model = LlamaForCausalLM(config).to(ctx.device).eval()
    cache = DynamicCache(config=config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3]], device=ctx.device), cache=cache,
              use_cache=True, logits_to_keep=1)
    if cache.get_seq_length() == 3:
        return "pass", f"transformers {transformers.__version__} fills the engine's cache", {}
    raise Outcome("fail", f"transformers {transformers.__version__} ignores the engine's "
                          "`cache=` keyword (it takes past_key_values=): carry the project's "
                          "transformers (make gpu-wheels)")


# ----- correctness --------------------------------------------------------------------------------
def resolve_model(ctx: Context) -> tuple[str, str, str, str]:
    """(spec, dtype, label, why not the bundled one) of the correctness model."""
    from engine.errors import ModelLoadError
    from engine.model_files import bundled_model_dir, default_gguf_path

    wanted = ctx.args.model
    half = ctx.args.dtype
    if wanted not in ("auto", "tiny"):
        return wanted, half, Path(wanted).name, ""
    why = "asked for the tiny model"
    if wanted == "auto":
        try:
            if bundled_model_dir() is None:
                default_gguf_path()
            return "default", half, "bundled SmolLM2-135M-Instruct", ""
        except ModelLoadError:
            pass
        joined, why = carried_gguf(CARRIED, ctx.workdir)
        if joined is not None:
            return str(joined), half, f"bundled SmolLM2-135M-Instruct ({why})", ""
        why = f"bundled model not here: {why}"
    from tests.support.tiny_model import build_tiny_model

    folder = build_tiny_model(ctx.workdir / "tiny-llama")
    # Random tiny weights give near-uniform logits: fp32 keeps greedy ties meaningful.
    return str(folder), "float32", "tiny random Llama (fp32)", why


def step_load(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    from engine.runtimes.torch.kernels import eager_name
    from engine.runtimes.torch.loader import load_model
    from engine.worker import Engine

    spec, dtype, label, why = resolve_model(ctx)
    note = f" ({why})" if why else ""
    ctx.model_label = label
    start = time.perf_counter()
    ctx.reference = load_model(spec, device=str(ctx.device), dtype=dtype)
    load_s = time.perf_counter() - start
    engine = Engine().start()
    ctx.engine = engine
    # The torch engine is what this checks (auto would run a GGUF on llama.cpp on a CPU).
    info = engine.load_model_sync(spec, timeout=600, engine="torch", device=str(ctx.device),
                                  dtype=dtype, kernel=eager_name(ctx.reference))
    return "pass", f"{label}{note}: {info.parameters / 1e6:,.1f} M parameters, {info.dtype} " \
                   f"on {info.device}, loaded in {load_s:.1f} s", {
        "model": label, "spec_kind": info.source, "dtype": info.dtype, "device": info.device,
        "parameters": info.parameters, "load_s": load_s, "why_not_bundled": why}


def engine_run(ctx: Context, request: GenerationRequest, timeout: float = 300
               ) -> GenerationResult:
    assert ctx.engine is not None
    return ctx.engine.submit(request).wait(timeout)


def hf_greedy(loaded: LoadedModel, prompt: list[int], n: int) -> list[int]:
    """transformers generate(), greedy, up to n new tokens (EOS included, as the engine
    reports it), on the same model and device."""
    import torch
    from transformers import GenerationConfig

    from engine.runtimes.torch.generate import eos_token_ids

    eos = sorted(eos_token_ids(loaded))
    config = GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=eos[0],
                              eos_token_id=eos)
    ids = torch.tensor([prompt], device=loaded.device)
    with torch.inference_mode():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids),
                                    generation_config=config)
    return out[0, len(prompt):].tolist()


def step_greedy_vs_generate(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    assert ctx.reference is not None
    n = ctx.args.tokens_check
    checks, rows = [], []
    for text in CHAT_PROMPTS:
        result = engine_run(ctx, chat_request(text, n))
        ctx.baseline[text] = result.token_ids
        expected = hf_greedy(ctx.reference, result.prompt_token_ids, n)
        ok, note, data = compare_greedy(ctx.reference, result.prompt_token_ids, expected,
                                        result.token_ids)
        checks.append((ok, note))
        rows.append({"prompt": text, "ok": ok, "note": note, **data})
    status, notes = summarize(checks)
    return status, f"{len(CHAT_PROMPTS)} prompts x {n} tokens: {notes}", {"prompts": rows}


def step_prefix_cache(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    from engine import ChatMessage

    assert ctx.reference is not None
    n = ctx.args.tokens_check
    first = [ChatMessage("system", "You are a concise assistant."),
             ChatMessage("user", CHAT_PROMPTS[2])]
    turn1 = engine_run(ctx, chat_request("", n, messages=first, conversation_id="pc"))
    second = [*first, ChatMessage("assistant", turn1.text),
              ChatMessage("user", "Now name one more and say why.")]
    cached = engine_run(ctx, chat_request("", n, messages=second, conversation_id="pc"))
    cold = engine_run(ctx, chat_request("", n, messages=second, conversation_id="pc-cold",
                                        reuse_cache=False))
    ok, note, data = compare_greedy(ctx.reference, cold.prompt_token_ids, cold.token_ids,
                                    cached.token_ids)
    reused = cached.metrics.cached_tokens
    if reused == 0:
        ok, note = False, f"nothing was reused ({cached.metrics.cache_miss_reason})"
    line = (f"turn 2 reused {reused} of {cached.metrics.prompt_tokens} prompt tokens; "
            f"cached vs cold: {note}")
    return ("pass" if ok else "fail"), line, {"cached_tokens": reused, "note": note, **data}


def step_alternatives(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    assert ctx.engine is not None
    n, count = ctx.args.tokens_check, 3
    request = chat_request(CHAT_PROMPTS[1], n, temperature=0.8, seed=11)
    together = [h.wait(300).token_ids for h in ctx.engine.submit_alternatives(request, count)]
    alone = [engine_run(ctx, dataclasses.replace(r, request_id=f"{r.request_id}-alone")).token_ids
             for r in request.alternatives(count)]
    diffs = [first_difference(a, b) for a, b in zip(together, alone, strict=True)]
    distinct = len({tuple(t) for t in together})
    data = {"first_difference": diffs, "distinct_replies": distinct}
    if all(d is None for d in diffs):
        return "pass", f"{count} sampled alternatives (shared prefill, one batch) equal the " \
                       f"same seeds one by one; {distinct} distinct replies", data
    return "fail", f"alternatives differ from one-by-one at tokens {diffs}", data


def step_batching(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    assert ctx.engine is not None and ctx.reference is not None
    n = ctx.args.tokens_check
    texts = [*CHAT_PROMPTS, "Explain what a KV cache is in two sentences."]
    handles = [ctx.engine.submit(chat_request(t, n)) for t in texts]  # joins one batch
    together = [h.wait(300) for h in handles]
    checks = []
    for text, batched in zip(texts, together, strict=True):
        alone = engine_run(ctx, chat_request(text, n))
        checks.append(compare_greedy(ctx.reference, alone.prompt_token_ids, alone.token_ids,
                                     batched.token_ids)[:2])
    status, notes = summarize(checks)
    return status, f"{len(texts)} greedy requests batched vs one by one: {notes}", {
        "notes": [c[1] for c in checks]}


def step_cancel(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    from engine import RequestFinished, TokenEmitted

    assert ctx.engine is not None and ctx.reference is not None
    limit = min(4000, ctx.reference.info.context_length - 64)
    handle = ctx.engine.submit(chat_request(CHAT_PROMPTS[0], limit, ignore_eos=True))
    asked_ns, done_ns, result = 0, 0, None
    stamps: list[int] = []  # the engine's own stamps (perf_counter_ns, as ours)
    for event in handle.events(timeout=300):
        if isinstance(event, TokenEmitted):
            stamps.append(event.t_ns)
            if not asked_ns and event.index >= 3:
                asked_ns = time.perf_counter_ns()
                handle.cancel()
        elif isinstance(event, RequestFinished):
            result, done_ns = event.result, time.perf_counter_ns()
    if result is None:
        raise Outcome("fail", f"cancelled request failed: {handle.error}")
    after = sum(t > asked_ns for t in stamps)
    nxt = engine_run(ctx, chat_request(CHAT_PROMPTS[0], ctx.args.tokens_check))
    same = nxt.token_ids == ctx.baseline.get(CHAT_PROMPTS[0], nxt.token_ids)
    ok = result.finish_reason == "cancelled" and after <= 1 and same
    latency_ms = (done_ns - asked_ns) / 1e6
    line = (f"finish={result.finish_reason} after {len(result.token_ids)} of {limit} tokens, "
            f"{after} token(s) after cancel(), {latency_ms:.1f} ms to finish; next reply "
            f"{'equals' if same else 'DIFFERS from'} the earlier one")
    return ("pass" if ok else "fail"), line, {"tokens_after_cancel": after,
                                              "cancel_to_finish_ms": latency_ms}


def step_out_of_memory(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    import torch

    from engine import PhasewiseError
    from engine.worker import OUT_OF_MEMORY_MESSAGE
    from tests.support.fault_injection import ForwardFault

    assert ctx.engine is not None
    error_type = torch.cuda.OutOfMemoryError if ctx.cuda else torch.OutOfMemoryError
    n = ctx.args.tokens_check
    fault = ForwardFault(ctx.engine)
    try:
        fault.arm(error_type("CUDA out of memory (injected by gpu_check)"), at=3)
        failed = ctx.engine.submit(chat_request(CHAT_PROMPTS[0], n))
        with contextlib.suppress(PhasewiseError):
            failed.wait(300)
    finally:
        fault.remove()
    nxt = engine_run(ctx, chat_request(CHAT_PROMPTS[0], n))
    same = nxt.token_ids == ctx.baseline.get(CHAT_PROMPTS[0], nxt.token_ids)
    ok = fault.fired == 1 and failed.error == OUT_OF_MEMORY_MESSAGE and same
    line = (f"{error_type.__module__}.{error_type.__name__} at decode step 2: the reply "
            f"ended with {failed.error!r}; the next reply "
            f"{'completed identically' if same else 'DIFFERS'}")
    return ("pass" if ok else "fail"), line, {"message": failed.error, "next_same": same}


def step_static_parity(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    from engine.runtimes.torch.static_decode import StaticDecoder

    assert ctx.reference is not None and ctx.engine is not None
    n = ctx.args.tokens_check
    checks = []
    decoder: StaticDecoder | None = None
    for text in CHAT_PROMPTS:
        result = engine_run(ctx, chat_request(text, n))
        prompt = result.prompt_token_ids
        if decoder is None:
            decoder = StaticDecoder(ctx.reference.model, max_len=len(prompt) + n + 64)
        if len(prompt) + n >= decoder.max_len:
            decoder = StaticDecoder(ctx.reference.model, max_len=len(prompt) + n + 64)
        static = decoder.generate(prompt, n).tokens
        checks.append(compare_greedy(ctx.reference, prompt, result.token_ids, static)[:2])
    status, notes = summarize(checks)
    return status, f"static-cache decoder vs the engine, {len(checks)} prompts: {notes}", {}


# ----- speed --------------------------------------------------------------------------------------
def step_copy_bandwidth(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    from engine.tools.calibrate import device_name, table_peaks

    nbytes = (2 << 30) if ctx.cuda else (64 << 20)
    times, ok = copy_times(ctx.device, nbytes, 10 if ctx.cuda else 5)
    free_memory()
    seconds = statistics.median(times)
    ctx.copy_gb_s = 2 * nbytes / seconds / 1e9  # a copy reads and writes every byte
    spec = table_peaks(device_name(str(ctx.device))) if ctx.cuda else None
    line = f"{ctx.copy_gb_s:,.0f} GB/s (read + write, {nbytes >> 20} MiB, median of " \
           f"{len(times)})"
    if spec is not None:
        line += f"; spec table {spec.bandwidth_gb_s:,.0f} GB/s"
    data = {"copy_gb_s": ctx.copy_gb_s, "bytes": nbytes,
            "spec_gb_s": spec.bandwidth_gb_s if spec else None, "copy_correct": ok}
    return ("measured" if ok else "fail"), line, data


def copy_times(device: torch.device, nbytes: int, reps: int) -> tuple[list[float], bool]:
    """Seconds of each of reps device-to-device copies of nbytes (random bytes), and whether
    the copy arrived intact."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)  # warm-up
    sync(device)
    times = [timed(device, lambda: dst.copy_(src)) for _ in range(reps)]
    return times, bool(torch.equal(dst[-4096:], src[-4096:]))


def timed(device: torch.device, fn: Callable[[], object]) -> float:
    """Seconds for fn, by CUDA events on a GPU, the host clock on a CPU."""
    import torch

    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def synthetic_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer of exactly vocab_size ids: the benchmark passage's words, then
    fillers (the engine needs a tokenizer to stream text; the weights are random anyway)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from engine.tools.bench import PASSAGE

    words = list(dict.fromkeys(["<eos>", "<unk>", *PASSAGE.split()]))
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>",
                                   unk_token="<unk>", pad_token="<eos>")


def build_random(ctx: Context, shape: str) -> LoadedModel:
    """A Llama-shaped model with random weights, built on the device in the run's dtype."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.runtimes.torch.loader import LoadedModel, model_info

    dtype = getattr(torch, ctx.args.dtype)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(ctx.device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    tokenizer = synthetic_tokenizer(config.vocab_size)
    info = model_info(model, tokenizer, name=f"random Llama {shape}", source="random", path="")
    return LoadedModel(model=model, tokenizer=tokenizer, info=info)


def decode_row(ctx: Context, label: str, weight_bytes: int, tok_s: float,
               warm_s: float = 0.0) -> dict[str, Any]:
    gb_s = weight_bytes * tok_s / 1e9
    return {"path": label, "tok_s": tok_s, "gb_s": gb_s,
            "of_copy": gb_s / ctx.copy_gb_s if ctx.copy_gb_s else 0.0, "warm_up_s": warm_s}


def step_build(ctx: Context, shape: str, holder: dict[str, Any]) -> tuple[str, str, dict]:
    start = time.perf_counter()
    loaded = build_random(ctx, shape)
    sync(ctx.device)
    holder["loaded"] = loaded
    info = loaded.info
    return "measured", (f"{info.parameters / 1e6:,.1f} M parameters, {info.dtype}, "
                        f"{info.weight_bytes_per_step / 1e6:,.1f} MB read per decode step, built "
                        f"in {time.perf_counter() - start:.1f} s"), {
        "parameters": info.parameters, "weight_bytes_per_step": info.weight_bytes_per_step}


def step_eager(ctx: Context, shape: str, holder: dict[str, Any]) -> tuple[str, str, dict]:
    from engine.runtimes.torch.runtime import TorchRuntime
    from engine.tools.bench import fixed_prompt_ids, run_ours

    loaded = TorchRuntime(holder["loaded"])
    prompt = fixed_prompt_ids(loaded, 64)
    holder["prompt"] = prompt
    n = ctx.args.tokens
    run_ours(loaded, prompt[:16], 4)  # warm-up
    runs = [run_ours(loaded, prompt, n) for _ in range(2)]
    holder["eager_tokens"] = runs[0].token_ids
    rate = statistics.median(r.metrics.decode_tok_s for r in runs)
    row = decode_row(ctx, "engine eager loop", loaded.info.weight_bytes_per_step, rate)
    ctx.speed.setdefault(shape, {})["eager"] = row
    return "measured", fmt_row(row), row


def step_static(ctx: Context, shape: str, holder: dict[str, Any], mode: str
                ) -> tuple[str, str, dict]:
    import torch

    from engine.runtimes.torch.static_decode import StaticDecoder

    if mode != "none" and not ctx.cuda:
        raise Outcome("skipped", "CUDA graphs need a CUDA device")
    loaded = holder["loaded"]
    graphs = mode != "none"
    prompt = holder["prompt"]
    n = ctx.args.tokens_static if graphs else ctx.args.tokens
    decoder = StaticDecoder(loaded.model, len(prompt) + n + 8, mode)
    try:
        start = time.perf_counter()
        for _ in range(3 if graphs else 1):  # compile, record the graph, replay
            decoder.generate(prompt, 8)
        warm_s = time.perf_counter() - start
        runs = [decoder.generate(prompt, n) for _ in range(3 if graphs else 2)]
    finally:
        del decoder
        if graphs:
            torch._dynamo.reset()  # drop the compiled graphs and their memory pool
        free_memory()
    rate = statistics.median(r.decode_tok_s for r in runs)
    label = "static + CUDA graphs" if graphs else "static cache"
    row = decode_row(ctx, label, loaded.info.weight_bytes_per_step, rate, warm_s)
    eager = holder.get("eager_tokens", [])
    m = min(len(eager), n)
    row["same_tokens_as_eager"] = runs[0].tokens[:m] == eager[:m]
    ctx.speed.setdefault(shape, {})["graphs" if graphs else "static"] = row
    return "measured", fmt_row(row) + (f", warm-up {warm_s:.1f} s" if warm_s > 1 else ""), row


def fmt_row(row: dict[str, Any]) -> str:
    return f"{row['tok_s']:,.1f} tok/s, {row['gb_s']:,.1f} GB/s ({row['of_copy']:.0%} of copy)"


def step_verify_cost(ctx: Context, holder: dict[str, Any]) -> tuple[str, str, dict]:
    """Seconds of one forward over 7 new tokens / over 1, at the same cache length: what a
    speculative step (1 + 6 drafts) costs against a plain one."""
    import torch
    from transformers import DynamicCache

    from engine.runtimes.torch.prefix_cache import crop_to

    loaded = holder["loaded"]
    prompt = holder["prompt"]
    cache = DynamicCache(config=loaded.model.config)
    with torch.inference_mode():
        loaded.model(input_ids=torch.tensor([prompt], device=ctx.device), cache=cache,
                     use_cache=True, logits_to_keep=1)
        times: dict[int, list[float]] = {1: [], 7: []}
        for _ in range(12):
            for k in times:
                ids = torch.tensor([prompt[:k]], device=ctx.device)
                times[k].append(timed(ctx.device, lambda ids=ids, k=k: loaded.model(
                    input_ids=ids, cache=cache, use_cache=True, logits_to_keep=k)))
                crop_to(cache, len(prompt))
    one, seven = (statistics.median(times[k][2:]) for k in (1, 7))
    ratio = seven / one
    return "measured", (f"a 7-token verify pass costs {ratio:.2f}x a 1-token step "
                        f"({seven * 1e3:.2f} vs {one * 1e3:.2f} ms)"), {
        "one_ms": one * 1e3, "seven_ms": seven * 1e3, "ratio": ratio}


def step_ttft(ctx: Context, holder: dict[str, Any]) -> tuple[str, str, dict]:
    from engine.runtimes.torch.prefix_cache import PrefixCache
    from engine.runtimes.torch.runtime import TorchRuntime
    from engine.tools.bench import fixed_prompt_ids, run_ours
    from engine.worker import default_cache_budget

    loaded = TorchRuntime(holder["loaded"])
    length = ctx.args.ttft_tokens
    ids = fixed_prompt_ids(loaded, length + 32)
    prompt, turn2 = ids[:length], ids[: length + 32]
    pool = PrefixCache(loaded.loaded.model.config, default_cache_budget(str(ctx.device)))
    run_ours(loaded, prompt[:64], 2, cache=pool)  # warm-up
    cached, cold = [], []
    for r in range(3):
        run_ours(loaded, prompt, 1, cache=pool, conversation_id=f"ttft-{r}")  # turn 1
        hit = run_ours(loaded, turn2, 1, cache=pool, conversation_id=f"ttft-{r}")
        cached.append(hit.metrics)
        cold.append(run_ours(loaded, turn2, 1, cache=pool, conversation_id=f"cold-{r}",
                             reuse_cache=False).metrics)
        pool.drop(f"ttft-{r}")
        pool.drop(f"cold-{r}")
    med = statistics.median
    hot_s, cold_s = med(m.ttft_s for m in cached), med(m.ttft_s for m in cold)
    reused = cached[0].cached_tokens
    data = {"prompt_tokens": len(turn2), "cached_tokens": reused, "cached_ttft_s": hot_s,
            "cold_ttft_s": cold_s, "ratio": hot_s / cold_s,
            "cold_prefill_tok_s": med(m.prefilled_tokens / m.prefill_s for m in cold),
            "cold_prefill_tflop_s": med(m.prefill_tflop_s for m in cold),
            "cache_budget_bytes": pool.budget_bytes}
    ctx.speed.setdefault("ttft", {}).update(data)
    return "measured", (f"{len(turn2):,}-token turn, {reused:,} cached: TTFT "
                        f"{hot_s * 1e3:,.1f} ms vs cold {cold_s * 1e3:,.1f} ms "
                        f"({hot_s / cold_s:.3f}x); cold prefill "
                        f"{data['cold_prefill_tflop_s']:.3g} TFLOP/s"), data


def step_batch_sweep(ctx: Context, holder: dict[str, Any]) -> tuple[str, str, dict]:
    from engine.runtimes.torch.runtime import TorchRuntime
    from engine.tools.bench import bench_batch

    loaded = TorchRuntime(holder["loaded"])
    sizes = tuple(int(b) for b in ctx.args.batches.split(","))
    report = bench_batch(loaded, batch_sizes=sizes, prompt_tokens=64,
                         max_tokens=ctx.args.batch_tokens, rounds=1)
    rows = report["batches"]
    ctx.speed["batch"] = {"rows": rows, "model": loaded.info.name}
    last = rows[-1]
    return "measured", ", ".join(f"{r['batch']}: {r['total_tok_s']:,.0f}" for r in rows) + \
        f" tok/s; batch {last['batch']} = {last['throughput_vs_first']:.1f}x batch " \
        f"{rows[0]['batch']}", {"rows": rows}


def step_speculation(ctx: Context) -> tuple[str, str, dict]:
    from engine import ChatMessage
    from engine.core.chat_template import encode_chat_with_spans
    from engine.runtimes.torch.runtime import TorchRuntime
    from engine.tools.bench import PASSAGE, fixed_text, run_ours, speculative_summary

    assert ctx.reference is not None
    reference = TorchRuntime(ctx.reference)
    passage = fixed_text(ctx.reference, min(len(PASSAGE) // 4, ctx.reference.info.context_length
                                            // 3))
    text = f"Repeat the following text exactly.\n\n{passage}"
    prompt = encode_chat_with_spans(ctx.reference.tokenizer, [ChatMessage("user", text)])[0]
    n = ctx.args.tokens
    run_ours(reference, prompt, 4)
    plain = [run_ours(reference, prompt, n) for _ in range(2)]
    spec = [run_ours(reference, prompt, n, speculative="ngram") for _ in range(2)]
    summary = speculative_summary(plain, spec)
    ok, note, _ = compare_greedy(ctx.reference, prompt, plain[0].token_ids, spec[0].token_ids)
    summary["output_check"] = note
    ctx.speed["speculation"] = summary
    status = "measured" if ok else "fail"
    return status, (f"{ctx.model_label}, copy task: {summary['spec_speedup']:.2f}x decode "
                    f"tok/s, {summary['spec_accept_rate']:.0%} of drafts accepted; output "
                    f"{note}"), summary


# ----- HUD ----------------------------------------------------------------------------------------
@dataclass
class HudRun:
    """One reply watched two ways: the engine's events (folded by the HUD's model) and a clock
    in the calling thread (before submit, at each token's and the end's arrival)."""

    events: list[Any]
    reply: Any  # ui.hud.model.ReplyRecord
    submitted_ns: int
    arrivals_ns: list[int]
    finished_ns: int


def hud_run(ctx: Context) -> HudRun:
    from engine import RequestFinished, TokenEmitted
    from engine.tools.bench import fixed_text
    from ui.hud.model import SessionModel

    assert ctx.engine is not None and ctx.reference is not None
    events: list[Any] = []
    ctx.engine.add_listener(events.append)
    n = max(ctx.args.tokens, 32)
    text = fixed_text(ctx.reference, 200) + "\n\nSummarise the text above."
    try:
        arrivals: list[int] = []
        submitted = time.perf_counter_ns()
        handle = ctx.engine.submit(chat_request(text, n, ignore_eos=True))
        finished = 0
        for event in handle.events(timeout=300):
            if isinstance(event, TokenEmitted):
                arrivals.append(time.perf_counter_ns())
            elif isinstance(event, RequestFinished):
                finished = time.perf_counter_ns()
    finally:
        ctx.engine.remove_listener(events.append)
    ours = [e for e in events if getattr(e, "request_id", None) == handle.request_id]
    session = SessionModel()
    for event in ours:
        session.apply(event)
    reply = session.replies[handle.request_id]
    if reply.metrics is None or len(arrivals) < 2:
        raise Outcome("fail", f"the reply did not finish: {reply.error or handle.error}")
    return HudRun(ours, reply, submitted, arrivals, finished)


def stamped_numbers(events: list[Any]) -> dict[str, Any]:
    """TTFT, decode tok/s, end-to-end and the ITL list from the events' stamps alone (the
    definitions in design.md), not through engine.metrics or the HUD."""
    from engine import RequestFinished, RequestQueued, TokenEmitted

    queued = next(e.t_ns for e in events if isinstance(e, RequestQueued))
    tokens = [e.t_ns for e in events if isinstance(e, TokenEmitted)]
    done = next(e.t_ns for e in events if isinstance(e, RequestFinished))
    return {"ttft_s": (tokens[0] - queued) / 1e9,
            "decode_tok_s": (len(tokens) - 1) / ((tokens[-1] - tokens[0]) / 1e9),
            "e2e_s": (done - queued) / 1e9,
            "itl_s": [(b - a) / 1e9 for a, b in itertools.pairwise(tokens)]}


def step_hud_stamps(ctx: Context) -> tuple[str, str, dict]:
    """The HUD shows the engine's stamps exactly, and the engine's intervals lie inside the
    caller's (each engine stamp is taken after the caller's submit and before the event
    reaches the caller): a check, whatever the machine's load."""
    run = hud_run(ctx)
    ctx.hud = run
    m = run.reply.metrics
    stamped = stamped_numbers(run.events)
    keys = ("ttft_s", "decode_tok_s", "e2e_s")
    hud = {key: getattr(m, key) for key in keys}
    wrong = [key for key in keys if not math.isclose(hud[key], stamped[key], rel_tol=1e-9)]
    itl = run.reply.itl_s()
    if len(itl) != len(stamped["itl_s"]) or not all(
            math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
            for a, b in zip(itl, stamped["itl_s"], strict=False)):
        wrong.append("itl_s")
    caller = {"ttft_s": (run.arrivals_ns[0] - run.submitted_ns) / 1e9,
              "e2e_s": (run.finished_ns - run.submitted_ns) / 1e9}
    outside = [key for key in caller if hud[key] > caller[key]]
    data = {"hud": hud, "stamps": {key: stamped[key] for key in keys}, "caller": caller,
            "mismatched": wrong, "outside_caller": outside}
    if wrong or outside:
        return "fail", (f"HUD differs from the engine's stamps in {wrong or 'nothing'}; "
                        f"outside the caller's interval: {outside or 'nothing'}"), data
    return "pass", (f"TTFT, decode tok/s, end-to-end and {len(itl)} ITL gaps equal the "
                    "events' stamps; TTFT and end-to-end lie inside the caller's"), data


def step_hud_clock(ctx: Context) -> tuple[str, str, dict]:
    """How far the HUD's numbers are from a clock in the calling thread: measured (the queue
    hop to the caller is part of it), with whether it is within HUD_TOLERANCE."""
    run = ctx.hud
    if run is None:
        raise Outcome("skipped", "no reply was watched")
    arrivals = run.arrivals_ns
    external = {"ttft_s": (arrivals[0] - run.submitted_ns) / 1e9,
                "decode_tok_s": (len(arrivals) - 1) / ((arrivals[-1] - arrivals[0]) / 1e9),
                "e2e_s": (run.finished_ns - run.submitted_ns) / 1e9}
    hud = {key: getattr(run.reply.metrics, key) for key in external}
    diffs = {key: abs(hud[key] - external[key]) / external[key] for key in external}
    within = all(d <= HUD_TOLERANCE for d in diffs.values())
    line = ", ".join(f"{key} HUD {fmt_value(key, hud[key])} vs caller "
                     f"{fmt_value(key, external[key])} ({diffs[key]:.1%})" for key in external)
    line += f"; {'within' if within else 'beyond'} {HUD_TOLERANCE:.0%}"
    return "measured", line, {"hud": hud, "external": external, "relative_difference": diffs,
                              "tolerance": HUD_TOLERANCE, "within_tolerance": within}


def fmt_value(key: str, value: float) -> str:
    return f"{value:,.1f} tok/s" if key.endswith("tok_s") else f"{value * 1e3:,.1f} ms"


# ----- targets and output ----------------------------------------------------------------------
def targets(ctx: Context, big: str) -> list[dict[str, Any]]:
    """Issue 19's targets as pass / fail / missing rows (on a CPU they are informative)."""
    graphs = ctx.speed.get(big, {}).get("graphs")
    ttft = ctx.speed.get("ttft")
    batch = ctx.speed.get("batch", {}).get("rows")
    rows = []
    if graphs:
        rows.append(target_row(f"{big} static+graphs decode >= 70% of copy bandwidth",
                               graphs["of_copy"], ">=", 0.70, f"{graphs['of_copy']:.0%}"))
    else:
        rows.append(target_row(f"{big} static+graphs decode >= 70% of copy bandwidth"))
    if ttft:
        rows.append(target_row(f"cached {ttft['prompt_tokens']:,}-token TTFT <= 0.1x cold",
                               ttft["ratio"], "<=", 0.10, f"{ttft['ratio']:.3f}x"))
    else:
        rows.append(target_row("cached 4k-token TTFT <= 0.1x cold"))
    if batch and batch[-1]["batch"] >= 64 and batch[0]["batch"] == 1:
        value = batch[-1]["throughput_vs_first"]
        rows.append(target_row("batch 64 >= 20x batch-1 throughput", value, ">=", 20.0,
                               f"{value:.1f}x"))
    else:
        rows.append(target_row("batch 64 >= 20x batch-1 throughput"))
    return rows


def target_row(name: str, value: float | None = None, op: str = "", bound: float = 0.0,
               shown: str = "") -> dict[str, Any]:
    if value is None:
        return {"target": name, "status": "missing", "value": None, "shown": "not measured"}
    ok = value >= bound if op == ">=" else value <= bound
    return {"target": name, "status": "pass" if ok else "fail", "value": value, "shown": shown}


def markdown(meta: dict[str, Any], steps: list[Step], goal_rows: list[dict[str, Any]],
             speed: dict[str, dict[str, Any]]) -> str:
    partial = "" if meta["complete"] else " (partial: the run was stopped before its end)"
    lines = [f"# Phasewise device check: {meta['device_name']}{partial}", "",
             f"{meta['command']}  ", f"{meta['when']}; {meta['wall_s']:.0f} s of a "
             f"{meta['budget_s']:.0f} s budget; torch {meta['torch']}, transformers "
             f"{meta['transformers']}; correctness model: "
             f"{meta.get('correctness_model') or 'none'}", "",
             "| section | check | result | detail |", "| --- | --- | --- | --- |"]
    for s in steps:
        lines.append(f"| {s.section} | {s.name} | {s.status} | {s.line.replace('|', '/')} |")
    decode = [(m, row) for m, paths in speed.items() if m in SHAPES for row in paths.values()]
    if decode:
        lines += ["", "| model | path | tok/s | GB/s | of copy bandwidth | warm-up s |",
                  "| --- | --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {m} | {r['path']} | {r['tok_s']:,.1f} | {r['gb_s']:,.1f} | "
                  f"{r['of_copy']:.0%} | {r['warm_up_s']:.1f} |" for m, r in decode]
    if "batch" in speed:
        lines += ["", f"| batch ({speed['batch']['model']}) | tok/s | ms per step | vs batch 1 |",
                  "| ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['batch']} | {r['total_tok_s']:,.0f} | {r['per_token_latency_ms']:.2f} "
                  f"| {r['throughput_vs_first']:.1f}x |" for r in speed["batch"]["rows"]]
    lines += ["", "| target | result | measured |", "| --- | --- | ---: |"]
    lines += [f"| {g['target']} | {g['status']} | {g['shown']} |" for g in goal_rows]
    return "\n".join(lines) + "\n"


# ----- main ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cuda, cpu")
    parser.add_argument("--out", type=Path, help="write report.json and report.md here")
    parser.add_argument("--budget", type=float, help="seconds for the whole run "
                        "(default 330 on CUDA, 150 on CPU); steps past it are skipped")
    parser.add_argument("--model", default="auto",
                        help="correctness model: auto (bundled if here, else tiny), tiny, or a "
                             "model spec (folder, .gguf)")
    parser.add_argument("--sizes", help="random models for speed, largest first "
                        "(default 8b,1b on CUDA, cpu-b,cpu-a on CPU; 'none' for none)")
    parser.add_argument("--dtype", help="of the bundled and the random models "
                        "(default bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: the "
                        "CPUs this process may use; 1 is steadier on a busy machine)")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--wheels", type=Path, default=CARRIED / "wheels",
                        help="carried wheels to use where the installed version differs")
    parser.add_argument("--no-wheels", action="store_true", help="ignore carried wheels")
    parser.add_argument("--prepare", type=Path, metavar="DIR",
                        help="only fill DIR (.gpu) with what a GPU machine lacks: wheels of "
                        "this environment's transformers and gguf, the bundled GGUF in parts")
    return parser.parse_args(argv)


def configure(args: argparse.Namespace, cuda: bool) -> None:
    """Sizes that fit the device: a GPU gets the issue's, a CPU small ones."""
    args.budget = args.budget or (330.0 if cuda else 150.0)
    args.sizes = args.sizes or ("8b,1b" if cuda else "cpu-b,cpu-a")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.tokens = 128 if cuda else 8  # eager decode and speculation
    args.tokens_static = 256 if cuda else 8
    args.tokens_check = 32 if cuda else 8
    args.ttft_tokens = 4096 if cuda else 256
    args.batches = "1,2,4,8,16,32,64" if cuda else "1,8,64"
    args.batch_tokens = 32 if cuda else 4


def run_all(ctx: Context, carried: list[str]) -> None:
    report, args = ctx.report, ctx.args
    report.run("setup", "environment", lambda: step_environment(ctx, carried))
    report.run("setup", "transformers takes cache=", lambda: step_cache_keyword(ctx),
               provides="api")
    report.run("speed", "copy bandwidth", lambda: step_copy_bandwidth(ctx))
    report.run("correctness", "load", lambda: step_load(ctx), needs=("api",), provides="model")
    checks = [("greedy = generate()", step_greedy_vs_generate),
              ("cached turn = cold", step_prefix_cache),
              ("alternatives = one by one", step_alternatives),
              ("batch = one by one", step_batching),
              ("cancel", step_cancel),
              ("out of memory", step_out_of_memory),
              ("static cache = engine", step_static_parity)]
    for name, fn in checks:
        report.run("correctness", name, lambda fn=fn: fn(ctx), needs=("model",))
    report.run("hud", "HUD = engine stamps", lambda: step_hud_stamps(ctx), needs=("model",))
    report.run("hud", "HUD vs caller's clock", lambda: step_hud_clock(ctx), needs=("model",))
    report.run("speed", "prompt-lookup speculation", lambda: step_speculation(ctx),
               needs=("model",), min_s=10)
    if ctx.engine is not None:
        ctx.engine.shutdown()
        ctx.engine = None
        free_memory()
    sizes = [s for s in args.sizes.split(",") if s and s != "none"]
    for i, shape in enumerate(sizes):
        speed_model(ctx, shape, largest=i == 0)


def speed_model(ctx: Context, shape: str, *, largest: bool) -> None:
    """Build one random model and measure it; the largest also gets TTFT, the batch sweep and
    the verify cost before the compiled path, whose compile time is the least predictable."""
    report = ctx.report
    holder: dict[str, Any] = {}
    need, eager = f"model {shape}", f"model {shape} eager"
    scale = 1.0 if largest else 0.5
    report.run("speed", f"{shape}: build", lambda: step_build(ctx, shape, holder),
               needs=("api",), provides=need, min_s=20 * scale)
    report.run("speed", f"{shape}: eager decode", lambda: step_eager(ctx, shape, holder),
               needs=(need,), provides=eager, min_s=15 * scale)
    report.run("speed", f"{shape}: static cache",
               lambda: step_static(ctx, shape, holder, "none"), needs=(eager,), min_s=15 * scale)
    if largest:
        report.run("speed", f"{shape}: cached vs cold TTFT", lambda: step_ttft(ctx, holder),
                   needs=(eager,), min_s=15)
        report.run("speed", f"{shape}: batch sweep", lambda: step_batch_sweep(ctx, holder),
                   needs=(eager,), min_s=20)
        report.run("speed", f"{shape}: verify cost", lambda: step_verify_cost(ctx, holder),
                   needs=(eager,), min_s=5)
    report.run("speed", f"{shape}: static + CUDA graphs",
               lambda: step_static(ctx, shape, holder, "reduce-overhead"), needs=(eager,),
               min_s=120 * scale)
    holder.clear()
    free_memory()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))  # engine/ and tests/ without an installed package
    if args.prepare:
        prepare(args.prepare)
        return 0
    with tempfile.TemporaryDirectory(prefix="phasewise-gpu-check-") as tmp:
        workdir = Path(tmp)
        carried = [] if args.no_wheels else use_carried_wheels(args.wheels, workdir / "site")
        if importlib.util.find_spec("platformdirs") is None:
            os.environ.setdefault("PHASEWISE_CACHE_DIR", str(workdir / "cache"))
        report = Report(args.budget or 3600.0, set(args.sections.split(",")))
        imports = report.run("setup", "imports", import_stack)
        if imports.status != "pass":
            return write_report(args, argv, report, {"device_name": "unknown"}, [], {}, False)
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        want = args.device if args.device != "auto" else (
            "cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(want)
        cuda = device.type == "cuda"
        configure(args, cuda)
        report.budget_s = args.budget
        ctx = Context(args, device, workdir, report, cuda=cuda)
        report.after_step = lambda: finish(ctx, argv, final=False)
        try:
            run_all(ctx, carried)
        finally:
            if ctx.engine is not None:
                ctx.engine.shutdown()
        return finish(ctx, argv)


def import_stack() -> tuple[str, str, dict[str, Any]]:
    """torch, transformers and the engine, or the one line that says why not."""
    import torch
    import transformers

    from engine.runtimes.torch.kernels import configure_threads
    from engine.worker import Engine  # noqa: F401  (the whole engine imports)

    configure_threads()
    return "pass", (f"torch {torch.__version__}, transformers {transformers.__version__}, "
                    "the engine"), {}


def version(name: str) -> str:
    """The distribution's version as sys.path resolves it (carried wheels come first)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def finish(ctx: Context, argv: list[str] | None, *, final: bool = True) -> int:
    largest = ctx.args.sizes.split(",")[0]
    goal_rows = targets(ctx, largest if largest in SHAPES else "8b")
    meta = {"device_name": ctx.device_name or str(ctx.device), "device": str(ctx.device),
            "correctness_model": ctx.model_label}
    ok = not any(s.section in ("setup", "correctness") and s.status in ("fail", "error")
                 for s in ctx.report.steps)
    return write_report(ctx.args, argv, ctx.report, meta, goal_rows, ctx.speed, ok, final)


def write_report(args: argparse.Namespace, argv: list[str] | None, report: Report,
                 meta: dict[str, Any], goal_rows: list[dict[str, Any]],
                 speed: dict[str, dict[str, Any]], ok: bool, final: bool = True) -> int:
    """Write report.json and report.md under --out (final: also print the table). Exit
    status: 1 when a setup or correctness check failed."""
    meta = {**meta,
            "command": "python benchmarks/gpu_check.py " + " ".join(
                argv if argv is not None else sys.argv[1:]),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "wall_s": time.perf_counter() - report.start, "budget_s": report.budget_s,
            "torch": version("torch"), "transformers": version("transformers"),
            "qt_imported": any(m.split(".")[0] in QT_MODULES for m in sys.modules),
            "complete": final}
    document = {"meta": meta, "ok": ok, "steps": [dataclasses.asdict(s) for s in report.steps],
                "targets": goal_rows, "speed": speed}
    table = markdown(meta, report.steps, goal_rows, speed)
    if final:
        print("\n" + table, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(document, indent=1, default=str),
                                              "utf-8")
        (args.out / "report.md").write_text(table, "utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
