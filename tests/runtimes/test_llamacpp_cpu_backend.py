"""llama.cpp's CPU backend chosen at run time among the variants the build carries
(engine/runtimes/llamacpp/cpu_backend.py), and flash attention chosen by a timing (attention.py).

The choice's logic runs here with a stand-in smoke child (tests/support/fake_cpu_variants.py);
the real smoke runs start their own children from this process, which loads no native code;
anything that loads llama.cpp in-process runs in a child (tests/support/child.py)."""

from __future__ import annotations

from pathlib import Path

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
from tests.support.child import needs_llama_cpp, run_in_child
from tests.support.fake_cpu_variants import SCORES, fake_probe_child, plan


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
