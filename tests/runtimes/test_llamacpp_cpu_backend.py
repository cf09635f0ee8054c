"""llama.cpp's CPU backend chosen at run time among the variants the build carries
(engine/runtimes/llamacpp/cpu_backend.py), and flash attention chosen by a timing (attention.py).

The choice's logic runs here with a stand-in smoke child (tests/support/fake_cpu_variants.py);
the real smoke runs start their own children from this process, which loads no native code;
anything that loads llama.cpp in-process runs in a child (tests/support/child.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from engine.errors import ModelLoadError
from engine.model_files import default_gguf_path
from engine.runtimes.llamacpp import attention, cpu_backend
from engine.runtimes.llamacpp.cpu_backend import (
    BUILT_IN,
    choose,
    choose_and_cache,
    library_dir,
    variant_files,
)
from engine.tools.synthetic_gguf import write_f16
from tests.support.child import needs_llama_cpp, run_in_child
from tests.support.fake_cpu_variants import SCORES, fake_probe_child, plan

if TYPE_CHECKING:  # loading llama.cpp happens in children only
    from engine.runtimes.llamacpp.model import LlamaCppModel


def _files(tmp_path: Path, names: list[str] | None = None) -> dict[str, Path]:
    return {name: tmp_path / f"libggml-cpu-{name}.so" for name in (names or list(SCORES))}


# ----- the choice, with a stand-in smoke child ------------------------------------------------
def test_a_variant_whose_smoke_run_dies_is_skipped_for_the_next_best(tmp_path: Path) -> None:
    entry = choose(_files(tmp_path), Path(plan(crash=("sapphirerapids",), fail=("zen4",))),
                   child_main=fake_probe_child)
    assert entry["choice"] == "icelake"
    assert entry["skipped"] == {"sapphirerapids": "crashed: SIGILL (illegal instruction)",
                                "zen4": "failed: llama_decode failed"}
    # best first, those the CPU lacks an instruction set for (score 0) left out
    assert entry["order"] == ["sapphirerapids", "zen4", "icelake", "haswell", "x64"]


def test_the_best_scoring_variant_is_chosen_when_it_runs(tmp_path: Path) -> None:
    entry = choose(_files(tmp_path, ["haswell", "zen4", "x64", "alderlake"]), Path(plan()),
                   child_main=fake_probe_child)
    assert (entry["choice"], entry["skipped"]) == ("zen4", {})


def test_no_variant_that_runs_is_one_line_naming_each(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as caught:
        choose(_files(tmp_path, ["zen4", "haswell"]), Path(plan(crash=("zen4", "haswell"))),
               child_main=fake_probe_child)
    message = str(caught.value)
    assert "\n" not in message
    assert "zen4 crashed: SIGILL" in message and "haswell crashed: SIGILL" in message
    assert message.endswith("use --engine torch")


def test_a_smoke_model_that_does_not_load_skips_nothing_and_is_not_cached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken file is the file's fault: the best variant stays, unverified, and the next
    load smoke-runs again (a corrupt GGUF once made every variant "fail")."""
    monkeypatch.setattr(cpu_backend, "known_good_model", lambda: None)
    files = _files(tmp_path, ["zen4", "haswell"])
    for path in files.values():
        path.write_bytes(b"")
    entry = cpu_backend.choose_and_cache(files, Path(plan(unreadable=True)),
                                         child_main=fake_probe_child)
    assert (entry["choice"], entry["skipped"]) == ("zen4", {})
    assert entry["unverified"] == "llama.cpp could not load broken.gguf"
    assert cpu_backend.read_cache(cpu_backend.cache_key(files)) is None
    entry = cpu_backend.choose_and_cache(files, Path(plan()), child_main=fake_probe_child)
    assert cpu_backend.read_cache(cpu_backend.cache_key(files)) == entry


def test_variant_files_are_the_cpu_backend_libraries_only(tmp_path: Path) -> None:
    for name in ("libggml-cpu-zen4.so", "libggml-cpu-haswell.so", "libggml-cpu.so",
                 "libggml-base.so", "libggml-cpu-zen4.so.0", "libllama.so"):
        (tmp_path / name).write_bytes(b"")
    assert variant_files(tmp_path) == {"haswell": tmp_path / "libggml-cpu-haswell.so",
                                       "zen4": tmp_path / "libggml-cpu-zen4.so"}


# ----- flash attention's choice ---------------------------------------------------------------
def _steps(off: tuple[float, float, float], on: tuple[float, float, float]) -> dict:
    return {"off": dict(zip(attention.STATES, off, strict=True)),
            "on": dict(zip(attention.STATES, on, strict=True))}


def test_attention_is_chosen_by_its_worst_state_not_by_a_lone_chat() -> None:
    # facts.md: flash attention costs ~15% alone, gains x3.58 beside other chats' cells
    assert attention.choose(_steps((8.7, 36.0, 20.0), (10.0, 10.1, 12.0))) == "on"
    # off faster everywhere, or not much slower anywhere: off
    assert attention.choose(_steps((8.0, 9.0, 10.0), (10.0, 10.0, 12.0))) == "off"
    assert attention.choose(_steps((8.0, 10.4, 12.0), (10.0, 10.0, 12.0))) == "off"
    assert attention.choose(_steps((10.0, 10.0, 12.0), (10.0, 10.0, 12.0))) == "on"  # a tie


def test_a_rebuilt_variant_library_measures_attention_again(tmp_path: Path) -> None:
    # packaging/llama-cpp's patches change a variant's kernels without changing llama-cpp-python's
    # version: the choice made on the old kernels must not stand
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    library = tmp_path / "libggml-cpu-haswell.so"
    library.write_bytes(b"one build")
    backend = cpu_backend.CpuBackend("haswell", str(library))
    key = attention.cache_key(model, backend, 2, "0.3.36", 8192)
    assert attention.cache_key(model, backend, 2, "0.3.36", 8192) == key
    library.write_bytes(b"another build")
    assert attention.cache_key(model, backend, 2, "0.3.36", 8192) != key
    assert attention.cache_key(model, cpu_backend.CpuBackend(BUILT_IN), 2, "0.3.36", 8192) != key


# ----- the real build -------------------------------------------------------------------------
def _real_variants() -> dict[str, Path]:
    files = variant_files(library_dir())
    if not files:
        pytest.skip("this llama-cpp-python has its CPU backend built in (no variants)")
    return files


def _loaded_body() -> dict:
    from engine.runtimes.llamacpp.cpu_backend import loaded_backend, system_info
    from engine.runtimes.llamacpp.model import load_gguf

    loaded = load_gguf(default_gguf_path(), name="default", source="bundled", n_threads=2,
                       flash_attn=False)
    backend = loaded_backend()
    assert backend is not None
    return {"kernel": loaded.info.kernel, "variant": backend.variant,
            "system_info": system_info(loaded.llama_cpp)}


@needs_llama_cpp
def test_the_variant_smoke_tested_here_is_loaded_and_named() -> None:
    files = _real_variants()
    entry = choose_and_cache(files, default_gguf_path())  # children only: no native code here
    assert entry["choice"] == next(n for n in entry["order"] if n not in entry["skipped"])
    out = run_in_child(_loaded_body)
    assert out["variant"] == entry["choice"] != BUILT_IN
    assert out["kernel"] == f"llama.cpp-{entry['choice']}-2t"
    if entry["choice"] not in ("x64", "sse42"):  # every variant from sandybridge up has AVX
        assert "AVX = 1" in out["system_info"]
    assert ("AVX512 = 1" in out["system_info"]) == (entry["choice"] in (
        "skylakex", "cannonlake", "cascadelake", "icelake", "cooperlake", "zen4",
        "sapphirerapids"))


def _logits_after(loaded: LlamaCppModel, ids: list[int], steps: int) -> np.ndarray:
    """The logits of `steps` single-token decode steps after a chat of ids, in a fresh KV."""
    from engine.runtimes.llamacpp.decode import BatchWriter

    lib, ctx = loaded.llama_cpp, loaded.ctx
    lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
    batch = lib.llama_batch_init(loaded.n_batch, 0, 1)
    writer = BatchWriter(batch, loaded.n_batch)

    def decode(tokens: list[int], start: int) -> np.ndarray:
        n = len(tokens)
        writer.fill(tokens, range(start, start + n), [0] * n, [i == n - 1 for i in range(n)])
        assert lib.llama_decode(ctx, batch) == 0
        return np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, -1),
                                     shape=(loaded.n_vocab,)).copy()

    try:
        for start in range(0, len(ids), loaded.n_batch):
            decode(ids[start:start + loaded.n_batch], start)
        return np.stack([decode([ids[k]], len(ids) + k) for k in range(steps)])
    finally:
        lib.llama_batch_free(batch)


def _attention_agreement_body(variant: str, cache_dir: str, gguf: str) -> dict:
    """Decode steps' logits with flash attention off and on, on `variant` (forced through this
    child's own variant cache), after a short chat and after one past 512 cells (ggml splits
    the cells among threads from there)."""
    import os

    from engine.runtimes.llamacpp.model import load_gguf
    from engine.tools.bench import PASSAGE

    os.environ["PHASEWISE_CACHE_DIR"] = cache_dir
    files = variant_files(library_dir())
    cpu_backend.write_cache(cpu_backend.cache_key(files), {
        "order": [variant], "skipped": {}, "choice": variant, "unverified": None})
    logits, kernels = {}, []
    for flash in (False, True):
        loaded = load_gguf(Path(gguf), name=Path(gguf).stem, source="gguf", n_threads=2,
                           context_length=1024, flash_attn=flash)
        ids = loaded.tokenizer(PASSAGE * 8, add_special_tokens=False)["input_ids"]
        assert len(ids) >= 608
        logits[flash] = [_logits_after(loaded, ids[:n], 4) for n in (100, 600)]
        kernels.append(loaded.info.kernel)
        loaded.close()
    steps = [(off, on) for chat_off, chat_on in zip(logits[False], logits[True], strict=True)
             for off, on in zip(chat_off, chat_on, strict=True)]
    return {"kernels": kernels,
            "correlations": [float(np.corrcoef(off, on)[0, 1]) for off, on in steps],
            "same_top": [int(off.argmax()) == int(on.argmax()) for off, on in steps]}


@needs_llama_cpp
def test_flash_attention_agrees_with_attention_without_it_on_every_kernel_here(
        tmp_path: Path) -> None:
    """packaging/llama-cpp/flash-attention-f16-kv.patch rewrites flash attention over an F16 KV
    cache for head sizes 64 (the bundled model), 128 and 256 (random two-layer models): checked
    on the variant this CPU loads and on haswell (AVX2)."""
    # How far the two may part by rounding alone (1 - correlation of a step's logits): measured
    # <= 2e-3 on the bundled model, <= 2e-6 on the random ones, whose attention barely moves
    # their logits (a kernel that forgets to rescale its sum at a new maximum: 1e-3 there).
    models = {default_gguf_path(): 0.99} | {
        write_f16(tmp_path / f"head{size}.gguf", "llama", hidden=2 * size, ffn=256, layers=2,
                  vocab=0, head_dim=size): 0.9999 for size in (128, 256)}
    entry = choose_and_cache(_real_variants(), default_gguf_path())
    runs = [name for name in entry["order"] if name not in entry["skipped"]]
    for variant in dict.fromkeys([entry["choice"]] + [v for v in ("haswell",) if v in runs]):
        for model, least in models.items():
            out = run_in_child(_attention_agreement_body, variant, str(tmp_path / variant),
                               str(model))
            assert out["kernels"] == [f"llama.cpp-{variant}-2t", f"llama.cpp-{variant}-2t-fa"]
            where = (variant, model.name)
            assert min(out["correlations"]) > least, (where, out["correlations"])
            assert sum(out["same_top"]) >= len(out["same_top"]) - 1, (where, out["same_top"])


def _attention_body() -> dict:
    from engine.runtimes.llamacpp import attention as probe
    from engine.runtimes.llamacpp.model import load_gguf

    def load(threads: int) -> str:
        loaded = load_gguf(default_gguf_path(), name="default", source="bundled",
                           n_threads=threads, context_length=1024)
        kernel = loaded.info.kernel
        loaded.close()
        return kernel

    measured = []
    real_measure = probe.measure

    def counting(*args: object) -> dict:
        report = real_measure(*args)  # type: ignore[arg-type]
        measured.append(report["choice"])
        return report

    probe.measure = counting  # type: ignore[assignment]
    # the run's shared cache may hold an earlier test's choice for these settings
    probe.cache_path().unlink(missing_ok=True)
    first = load(2)
    second = load(2)  # cached: no second measurement
    other = load(1)  # another thread count: measured again
    return {"first": first, "second": second, "other": other, "measured": measured}


@needs_llama_cpp
def test_attention_is_measured_once_per_model_and_setting_and_labelled() -> None:
    out = run_in_child(_attention_body)
    assert len(out["measured"]) == 2
    assert out["first"] == out["second"]
    assert out["first"].endswith("-fa") == (out["measured"][0] == "on")
    assert out["other"].endswith("-fa") == (out["measured"][1] == "on")
    assert "-1t" in out["other"]
