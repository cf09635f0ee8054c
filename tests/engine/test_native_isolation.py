"""Native code in a child process: a crash there is an error here, naming the signal and the
build, and this process (the test run, the app, the benchmark) carries on.

The children here are made to die with os.kill(SIGILL / SIGSEGV): no real crash is needed, and
none of these tests needs llama-cpp-python.
"""

from __future__ import annotations

import os
import signal
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from app.cli import print_decode_table
from engine.errors import ModelLoadError
from engine.native import ChildError, NativeChild, NativeCrashError, describe_exit
from engine.runtimes.torch.loader import LoadedModel, load_model
from engine.runtimes.torch.runtime import TorchRuntime
from engine.tools import bench as bench_mod
from engine.tools.bench import bench_decode
from engine.tools.peers import LlamaCppPeer, PeerResult

FAKE_BUILD = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 0 | AMX_INT8 = 0"
TIMEOUT_S = 120.0


# ----- children (module level: a spawned child imports them by name) ---------------------------
def die_on_request(conn: Connection, sig: int) -> None:
    conn.send(("ready", "hello"))
    conn.recv()
    os.kill(os.getpid(), sig)


def raise_at_once(conn: Connection) -> None:
    raise RuntimeError("no such model\nsecond line")


def fake_llama_cpp(conn: Connection, _gguf: str, _threads: int, _n_ctx: int,
                   flash_attn: bool = False, *, die_at: str, sig: int = signal.SIGILL,
                   fa_on_tok_s: float = 1000.0) -> None:
    """Speaks the llama.cpp peer's protocol; dies by `sig` while loading ("load"), on the
    first run after warm-up ("run"), or answers every run ("never"), decoding at 1000 tok/s
    with flash attention off and fa_on_tok_s with it on."""
    conn.send(("about", {"version": "0.0-test", "system_info": FAKE_BUILD}))
    if die_at == "load":
        os.kill(os.getpid(), sig)
    conn.send(("loaded", None))
    runs = 0
    while (request := conn.recv()) is not None:
        runs += 1
        if die_at == "run" and runs == 2:  # run 1 is the benchmark's warm-up
            os.kill(os.getpid(), sig)
        _prompt, max_tokens = request
        rate = fa_on_tok_s if flash_attn else 1000.0
        conn.send(("result", PeerResult(ttft_s=0.001, decode_tok_s=rate,
                                        itl_s=[0.001] * (max_tokens - 1),
                                        token_ids=list(range(max_tokens)))))


# ----- the mechanism ---------------------------------------------------------------------------
@pytest.mark.parametrize(("sig", "words"), [(signal.SIGILL, "SIGILL (illegal instruction)"),
                                            (signal.SIGSEGV, "SIGSEGV (segmentation fault)")])
def test_a_child_killed_by_a_signal_is_an_error_naming_it_and_the_build(
        sig: int, words: str) -> None:
    child = NativeChild(die_on_request, sig, what="test code", build=FAKE_BUILD)
    try:
        assert child.receive(TIMEOUT_S) == "hello"
        with pytest.raises(NativeCrashError) as info:
            child.call("go", TIMEOUT_S)
    finally:
        child.close()
    assert str(info.value) == f"test code crashed: {words}; built with {FAKE_BUILD}"
    assert info.value.signal == sig and info.value.exitcode == -sig
    child.close()  # idempotent


def test_an_exception_in_the_child_is_one_line() -> None:
    child = NativeChild(raise_at_once, what="test code")
    try:
        with pytest.raises(ChildError, match=r"^no such model$"):
            child.receive(TIMEOUT_S)
    finally:
        child.close()


def test_exit_descriptions() -> None:
    assert describe_exit(-signal.SIGILL) == "SIGILL (illegal instruction)"
    assert describe_exit(3) == "exit code 3 without an answer"
    assert NativeCrashError("x", None, timeout_s=5).reason == "did not answer in 5 s (killed)"


# ----- the llama.cpp peer ----------------------------------------------------------------------
def test_peer_crash_on_a_run_names_signal_and_llama_cpp_features(tmp_path: Path) -> None:
    child = partial(fake_llama_cpp, die_at="run")
    with LlamaCppPeer(tmp_path / "m.gguf", n_threads=1, n_ctx=64, child_main=child) as peer:
        assert peer.version == "0.0-test" and peer.system_info == FAKE_BUILD
        assert peer.run([1, 2, 3], 4).token_ids == [0, 1, 2, 3]
        with pytest.raises(NativeCrashError) as info:
            peer.run([1, 2, 3], 4)
    assert str(info.value) == ("llama.cpp peer crashed: SIGILL (illegal instruction); "
                               f"built with {FAKE_BUILD}")


def test_peer_crash_while_loading_is_the_same_error(tmp_path: Path) -> None:
    child = partial(fake_llama_cpp, die_at="load", sig=signal.SIGSEGV)
    with pytest.raises(NativeCrashError, match=r"crashed: SIGSEGV .*built with CPU : SSE3"):
        LlamaCppPeer(tmp_path / "m.gguf", n_threads=1, n_ctx=64, child_main=child)


def test_peer_load_failure_in_the_child_is_a_model_load_error(tmp_path: Path) -> None:
    missing = tmp_path / "missing.gguf"
    with pytest.raises(ModelLoadError) as info:
        LlamaCppPeer(missing, n_threads=1, n_ctx=64)
    # Without llama-cpp-python: how to get it; with it: that the file could not be loaded.
    assert "make peers" in str(info.value) or "could not load" in str(info.value)


# ----- the benchmark ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir))


@pytest.mark.parametrize("die_at", ["load", "run"])
def test_bench_reports_a_crashed_llama_cpp_peer_in_one_line_and_keeps_the_rest(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path,
        die_at: str) -> None:
    monkeypatch.setattr(bench_mod, "gguf_for", lambda _info: tmp_path / "m.gguf")
    monkeypatch.setattr(bench_mod, "LlamaCppPeer",
                        partial(LlamaCppPeer, child_main=partial(fake_llama_cpp, die_at=die_at)))
    lines: list[str] = []
    report = bench_decode(TorchRuntime(tiny), prompt_tokens=8, max_tokens=4, repeats=2,
                          peers=["hf", "llama.cpp"], hf_reference=tiny, progress=lines.append)
    error = f"llama.cpp peer crashed: SIGILL (illegal instruction); built with {FAKE_BUILD}"
    assert report["llama_cpp_error"] == error
    assert [line for line in lines if "crashed" in line] == [error]  # said once
    assert not any(key.startswith(("llama_cpp_decode", "decode_ratio_vs_llama"))
                   for key in report)  # no partial numbers from a crashed peer
    assert report["decode_tok_s"] > 0 and report["hf_decode_tok_s"] > 0  # ours and hf ran
    assert report["decode_ratio_vs_hf"] > 0
    print_decode_table(report)
    out = capsys.readouterr().out
    assert f"llama.cpp (llama-cpp-python)  {error}" in out
    assert "decode ratio vs generate()" in out


def test_bench_with_a_healthy_peer_child_reports_its_build(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(bench_mod, "gguf_for", lambda _info: tmp_path / "m.gguf")
    monkeypatch.setattr(bench_mod, "LlamaCppPeer",
                        partial(LlamaCppPeer, child_main=partial(fake_llama_cpp, die_at="never")))
    report = bench_decode(TorchRuntime(tiny), prompt_tokens=8, max_tokens=4, repeats=1,
                          peers=["llama.cpp"])
    assert "llama_cpp_error" not in report
    assert report["llama_cpp_build"] == FAKE_BUILD and report["llama_cpp_version"] == "0.0-test"
    assert report["llama_cpp_decode_tok_s"] == pytest.approx(1000.0)


@pytest.mark.parametrize(("fa_on_tok_s", "faster"), [(1500.0, "on"), (600.0, "off")])
def test_bench_compares_against_the_faster_llama_cpp_configuration(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path,
        fa_on_tok_s: float, faster: str) -> None:
    """llama.cpp runs with flash attention off and on; the ratios are against the faster, and
    the report and the table say which it was."""
    monkeypatch.setattr(bench_mod, "gguf_for", lambda _info: tmp_path / "m.gguf")
    monkeypatch.setattr(bench_mod, "LlamaCppPeer", partial(
        LlamaCppPeer, child_main=partial(fake_llama_cpp, die_at="never",
                                         fa_on_tok_s=fa_on_tok_s)))
    report = bench_decode(TorchRuntime(tiny), prompt_tokens=8, max_tokens=4, repeats=1,
                          peers=["llama.cpp"])
    best = max(1000.0, fa_on_tok_s)
    assert report["llama_cpp_fa_off_decode_tok_s"] == pytest.approx(1000.0)
    assert report["llama_cpp_fa_on_decode_tok_s"] == pytest.approx(fa_on_tok_s)
    assert report["llama_cpp_flash_attn"] is (faster == "on")
    assert report["llama_cpp_decode_tok_s"] == pytest.approx(best)
    assert report["decode_ratio_vs_llama_cpp"] == pytest.approx(report["decode_tok_s"] / best)
    print_decode_table(report)
    out = capsys.readouterr().out
    assert f"(flash attention {faster}, the faster: off 1000.0 / on {fa_on_tok_s:.1f} tok/s)" \
        in out
