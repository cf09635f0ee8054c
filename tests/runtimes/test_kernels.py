"""Decode kernel paths on the tiny model: building, sizes, the auto choice, errors."""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import logging
import math
import os
import signal
import warnings
import weakref
from functools import partial
from pathlib import Path

import pytest
import torch

from engine import ModelLoadError
from engine.events import ModelInfo
from engine.runtimes.torch import kernels as kernels_mod
from engine.runtimes.torch.kernels import (
    KERNELS,
    KernelPath,
    KernelUnavailableError,
    apply_kernel,
    decode_weight_bytes,
    probe_cache_path,
    select_kernel,
)
from engine.runtimes.torch.loader import LoadedModel, load_model, weight_bytes_per_step
from engine.runtimes.torch.quality import perplexity, reference_ids, within_tolerance
from engine.runtimes.torch.runtime import TorchRuntime
from engine.tools.bench import fixed_prompt_ids, run_ours
from engine.worker import Engine


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir))


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_int8_copy_leaves_the_fp32_model_intact(tiny: LoadedModel) -> None:
    fast = apply_kernel(tiny, "int8-dynamic")
    assert fast.info.kernel == "int8-dynamic" and tiny.info.kernel == "fp32-eager"
    assert isinstance(tiny.model.lm_head, torch.nn.Linear)
    assert tiny.model.lm_head.weight is tiny.model.get_input_embeddings().weight
    assert not isinstance(fast.model.lm_head, torch.nn.Linear)  # the head is quantized too
    # the embedding is shared with the original, not copied
    assert fast.model.get_input_embeddings().weight is tiny.model.get_input_embeddings().weight


def test_weight_bytes_follow_the_kernel(tiny: LoadedModel) -> None:
    assert decode_weight_bytes(tiny.model) == weight_bytes_per_step(tiny.model)
    fast = apply_kernel(tiny, "int8-dynamic")
    cfg = tiny.model.config
    linear_params = sum(m.weight.numel() for m in tiny.model.modules()
                        if isinstance(m, torch.nn.Linear))
    embed_row = cfg.hidden_size * 4
    norms = sum(p.numel() * 4 for n, p in tiny.model.named_parameters() if "norm" in n)
    # int8 weights: one byte per Linear weight, plus a float32 scale per output channel
    assert linear_params + embed_row + norms < fast.info.weight_bytes_per_step
    assert fast.info.weight_bytes_per_step < linear_params * 1.2 + embed_row + norms
    half = apply_kernel(tiny, "fp16-dynamic")
    assert half.info.weight_bytes_per_step == linear_params * 2 + embed_row + norms


@pytest.mark.parametrize("name", ["int8-dynamic", "fp16-dynamic"])
def test_dynamic_paths_are_torchs_quantize_dynamic(tiny: LoadedModel, name: str) -> None:
    """Packing each Linear ourselves (without torch.ao's full-size zero weight first) gives
    the modules and logits quantize_dynamic gives."""
    from torch.ao.quantization import (
        float16_dynamic_qconfig,
        per_channel_dynamic_qconfig,
        quantize_dynamic,
    )

    qconfig, dtype = {"int8-dynamic": (per_channel_dynamic_qconfig, torch.qint8),
                      "fp16-dynamic": (float16_dynamic_qconfig, torch.float16)}[name]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"(?is).*deprecat")
        reference = quantize_dynamic(copy.deepcopy(tiny.model), {torch.nn.Linear: qconfig},
                                     dtype=dtype)
    ours = apply_kernel(tiny, name).model
    assert str(ours) == str(reference)
    ids = torch.tensor([[5, 9, 2, 7, 3, 11]])
    with torch.inference_mode():
        assert torch.equal(ours(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.parametrize(("name", "weight_bytes"), [("int8-dynamic", 1), ("fp16-dynamic", 2)])
def test_packed_bytes_are_counted_from_the_shape_exactly(name: str, weight_bytes: int) -> None:
    """The packed Linears' bytes without unpacking them (unpacking copies the weight to fp32):
    weights at their width, int8's fp32 scale per output channel, the fp32 bias if any."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16, bias=False))
    build = {"int8-dynamic": kernels_mod._int8_dynamic_model,
             "fp16-dynamic": kernels_mod._fp16_dynamic_model}[name]
    info = ModelInfo(name="t", source="folder", path="", device="cpu", dtype="fp32",
                     context_length=8, parameters=0, weight_bytes_per_step=0, kernel="")
    packed = build(LoadedModel(model=model, tokenizer=None, info=info))
    scales = 4 * (32 + 16) if name == "int8-dynamic" else 0
    expected = (64 * 32 + 32 * 16) * weight_bytes + scales + 32 * 4
    assert sum(kernels_mod._packed_linear_bytes(m) for m in packed.modules()) == expected
    assert all(kernels_mod._packed_linear_bytes(m) == 0 for m in model.modules())


def test_the_probe_holds_one_converted_copy_at_a_time(
        tiny: LoadedModel, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each path is built after the one before it is freed; the last one built is kept if it
    is the choice, else the choice is built again (once)."""
    alive: list[weakref.ref[object]] = []
    most_alive = 0

    def tracked(path: KernelPath) -> KernelPath:
        def build(loaded: LoadedModel) -> object:
            nonlocal most_alive
            gc.collect()
            live = sum(ref() is not None for ref in alive)
            most_alive = max(most_alive, live + 1)
            model = path.build(loaded)
            alive.append(weakref.ref(model))
            return model
        return dataclasses.replace(path, build=build)

    paths = {name: tracked(path) if name != "fp32-eager" else path
             for name, path in KERNELS.items()}
    monkeypatch.setattr(kernels_mod, "KERNELS", paths)
    chosen = select_kernel(tiny)
    assert most_alive == 1
    report = next(iter(json.loads(probe_cache_path().read_text()).values()))
    built_again = int(chosen.info.kernel not in ("fp32-eager", "fp16-dynamic"))
    assert len(alive) == 2 + built_again  # int8 then fp16 raced eager; the choice kept
    assert report["choice"] == chosen.info.kernel


@pytest.mark.parametrize("name", ["int8-dynamic", "fp16-dynamic"])
def test_fast_paths_decode_and_pass_the_perplexity_guard(tiny: LoadedModel, name: str) -> None:
    fast = apply_kernel(tiny, name)
    prompt = fixed_prompt_ids(tiny, 24)
    first = run_ours(TorchRuntime(fast), prompt, 8)
    assert len(first.token_ids) == 8
    assert run_ours(TorchRuntime(fast), prompt, 8).token_ids == first.token_ids
    text = reference_ids(tiny.tokenizer)
    assert within_tolerance(perplexity(fast.model, text), perplexity(tiny.model, text))


def test_perplexity_is_exp_mean_nll(tiny: LoadedModel) -> None:
    ids = reference_ids(tiny.tokenizer, 20)
    logits = tiny.model(input_ids=torch.tensor([ids])).logits[0, :-1]
    logp = torch.log_softmax(logits.double(), -1)
    nll = -sum(logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)) / (len(ids) - 1)
    assert perplexity(tiny.model, ids) == pytest.approx(math.exp(nll), rel=1e-4)
    assert within_tolerance(101.9, 100.0) and not within_tolerance(102.1, 100.0)
    assert within_tolerance(90.0, 100.0)


@pytest.mark.parametrize(
    ("name", "message"),
    [("bf16-eager", "bf16-eager needs bf16 weights"), ("no-such", "unknown kernel 'no-such'")],
)
def test_forcing_an_unavailable_kernel_is_one_line(tiny: LoadedModel, name: str,
                                                   message: str) -> None:
    with pytest.raises(KernelUnavailableError) as info:
        select_kernel(tiny, name)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_auto_probes_once_then_reads_the_cache(tiny: LoadedModel, cache_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = select_kernel(tiny)
    record = next(iter(json.loads(probe_cache_path().read_text()).values()))
    assert record["choice"] == chosen.info.kernel
    assert set(record["decode_tok_s"]) == {"fp32-eager", "int8-dynamic", "fp16-dynamic"}
    assert all(rate > 0 for rate in record["decode_tok_s"].values())

    def no_probe(_loaded: object, _names: object) -> None:
        raise AssertionError("the cached choice should have been used")

    monkeypatch.setattr(kernels_mod, "probe", no_probe)
    assert select_kernel(tiny).info.kernel == chosen.info.kernel


def test_auto_skips_a_path_that_fails_to_build(tiny: LoadedModel, cache_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    def broken(_loaded: LoadedModel) -> None:
        raise RuntimeError("no such instruction set\nsecond line")

    paths = {"fp32-eager": KERNELS["fp32-eager"],
             "broken": KernelPath("broken", "fails", lambda _l: None, broken)}
    monkeypatch.setattr(kernels_mod, "KERNELS", paths)
    with caplog.at_level(logging.WARNING, logger="engine.runtimes.torch.kernels"):
        chosen = select_kernel(tiny)
    assert chosen.info.kernel == "fp32-eager"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "broken" in lines[0] and "no such instruction set" in lines[0]


def die_by(sig: int) -> None:
    """A smoke run whose native op 'faults' (module level: it runs in a child process)."""
    os.kill(os.getpid(), sig)


def test_auto_skips_a_path_whose_smoke_run_dies_by_a_signal(
        tiny: LoadedModel, cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    built: list[str] = []

    def faulty_build(loaded: LoadedModel) -> object:
        built.append("faulty")  # in this process: what a real faulting kernel would kill
        return loaded.model

    paths = {"fp32-eager": KERNELS["fp32-eager"], "int8-dynamic": KERNELS["int8-dynamic"],
             "faulty": KernelPath("faulty", "dies", lambda _l: None, faulty_build,
                                  partial(die_by, signal.SIGILL))}
    monkeypatch.setattr(kernels_mod, "KERNELS", paths)
    with caplog.at_level(logging.WARNING, logger="engine.runtimes.torch.kernels"):
        chosen = select_kernel(tiny)
    assert chosen.info.kernel in {"fp32-eager", "int8-dynamic"} and not built
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(
        "kernel faulty is skipped: its smoke run in a child process crashed: "
        "SIGILL (illegal instruction) (torch ")
    probed = next(iter(json.loads(probe_cache_path().read_text()).values()))
    assert set(probed["decode_tok_s"]) == {"fp32-eager", "int8-dynamic"}
    # The verdicts hold per CPU and torch build: the next probe reads them from the cache.
    verdicts = next(iter(json.loads(kernels_mod.smoke_cache_path().read_text()).values()))
    assert verdicts["int8-dynamic"] is None and "SIGILL" in verdicts["faulty"]

    def no_child(_jobs: object) -> None:
        raise AssertionError("the cached smoke verdicts should have been used")

    monkeypatch.setattr(kernels_mod, "run_smoke", no_child)
    assert kernels_mod.smoke_failures(["int8-dynamic", "faulty"]) == {
        "faulty": verdicts["faulty"]}


def test_a_smoke_run_that_raises_is_a_reason_and_the_next_path_still_runs() -> None:
    results = kernels_mod.run_smoke([("bad", partial(kernels_mod.smoke_linear, _raise, "fp32")),
                                     ("segv", partial(die_by, signal.SIGSEGV)),
                                     ("int8-dynamic", KERNELS["int8-dynamic"].smoke)])
    assert results["bad"] == "failed: no kernel for this CPU"
    assert results["segv"].startswith("crashed: SIGSEGV (segmentation fault)")
    assert results["int8-dynamic"] is None  # a fresh child took over after the crash


def _raise(_loaded: LoadedModel) -> None:
    raise RuntimeError("no kernel for this CPU")


def test_auto_rejects_a_path_that_fails_the_quality_guard(
        tiny: LoadedModel, cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def noisy(loaded: LoadedModel) -> object:
        model = kernels_mod.share_tensors_copy(loaded.model)
        head = model.lm_head
        model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=False)
        with torch.no_grad():  # a head that prefers what the model thinks unlikely
            model.lm_head.weight.copy_(-20 * head.weight)
        return model

    def noisy_is_faster(built: dict[str, LoadedModel], _prompt: list[int]
                        ) -> dict[str, list[float]]:
        # the guard, not the clock, must turn it down
        return {name: [1.0 if name == "noisy" else 2.0] for name in built}

    paths = {"fp32-eager": KERNELS["fp32-eager"],
             "noisy": KernelPath("noisy", "wrong", lambda _l: None, noisy)}
    monkeypatch.setattr(kernels_mod, "KERNELS", paths)
    monkeypatch.setattr(kernels_mod, "_alternating_step_times", noisy_is_faster)
    with caplog.at_level(logging.WARNING, logger=kernels_mod.log.name):
        assert select_kernel(tiny).info.kernel == "fp32-eager"
    report = next(iter(json.loads(probe_cache_path().read_text()).values()))
    assert report["choice"] == "fp32-eager" and report["reference"] == "fp32-eager"
    assert report["decode_tok_s"] == {"fp32-eager": 0.5, "noisy": 1.0}
    ppl = report["perplexity"]
    assert ppl["fp32-eager"] == pytest.approx(perplexity(tiny.model, reference_ids(
        tiny.tokenizer, kernels_mod.PROBE_TEXT_TOKENS), tiny.device))
    assert not within_tolerance(ppl["noisy"], ppl["fp32-eager"])
    assert [r.getMessage() for r in caplog.records if r.name == kernels_mod.log.name] == [
        f"kernel noisy failed the quality guard (perplexity {ppl['noisy']:.3f} vs "
        f"{ppl['fp32-eager']:.3f}); not used"]


def test_engine_reports_the_forced_kernel(tiny_model_dir: Path) -> None:
    with Engine(cache_budget_bytes=1 << 20) as engine:
        info = engine.load_model_sync(str(tiny_model_dir), kernel="int8-dynamic")
        assert info.kernel == "int8-dynamic"
        with pytest.raises(ModelLoadError, match="bf16-eager needs bf16 weights"):
            engine.load_model_sync(str(tiny_model_dir), kernel="bf16-eager")
        assert engine.model_info is not None and engine.model_info.kernel == "int8-dynamic"
