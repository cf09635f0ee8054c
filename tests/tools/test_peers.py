"""`phasewise bench --vs llama.cpp`: the bundled GGUF through llama-cpp-python, same prompt.

llama.cpp runs in a child process (LlamaCppPeer): if it crashes, the test fails with one line
naming the signal and llama.cpp's compiled CPU features, and the rest of the suite runs.
"""

from __future__ import annotations

import importlib.util
import platform
import sys

import pytest
import torch

from app.cli import build_parser, main, print_decode_table
from engine.errors import ModelLoadError
from engine.events import ModelInfo
from engine.model_files import DEFAULT_GGUF
from engine.runtimes.torch.loader import LoadedModel, load_model
from engine.runtimes.torch.runtime import TorchRuntime
from engine.tools.bench import bench_decode, fixed_prompt_ids, peer_summary, run_ours
from engine.tools.peers import (
    LLAMA_CPP_MISSING,
    LlamaCppPeer,
    PeerResult,
    gguf_for,
    import_llama_cpp,
    result_from_stamps,
)

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed: `make peers` builds it (a C++ compiler and "
           "CMake are needed; CI runs it before the tests)")
MS = 1_000_000


def info(source: str, path: str = "") -> ModelInfo:
    return ModelInfo(name="m", source=source, path=path, device="cpu", dtype="float32",
                     context_length=64, parameters=1, weight_bytes_per_step=1, kernel="fp32")


def test_peer_timing_follows_the_engine_definitions() -> None:
    result = result_from_stamps(0, [100 * MS, 110 * MS, 130 * MS, 160 * MS])
    assert result.ttft_s == pytest.approx(0.1)
    assert result.itl_s == pytest.approx([0.01, 0.02, 0.03])
    assert result.decode_tok_s == pytest.approx(3 / 0.06)
    assert result_from_stamps(0, [5 * MS]).decode_tok_s == 0.0
    assert result_from_stamps(0, []).ttft_s == 0.0


def test_peer_summary_keys_and_ratio_directions() -> None:
    runs = [PeerResult(0.2, 50.0, [0.01, 0.03]), PeerResult(0.4, 100.0, [0.02])]
    summary = peer_summary("llama.cpp", runs, {"decode_tok_s": 150.0, "ttft_s": 0.1})
    assert summary["llama_cpp_decode_tok_s"] == pytest.approx(75.0)  # medians over runs
    assert summary["llama_cpp_ttft_s"] == pytest.approx(0.3)
    assert summary["llama_cpp_itl_p50_s"] == pytest.approx(0.02)  # over every gap
    assert summary["llama_cpp_itl_p99_s"] == pytest.approx(0.0298)
    # Above 1 means ours is better: twice their decode rate, a third of their TTFT.
    assert summary["decode_ratio_vs_llama_cpp"] == pytest.approx(2.0)
    assert summary["ttft_ratio_vs_llama_cpp"] == pytest.approx(3.0)


def test_vs_takes_several_peers_in_one_flag_or_repeated() -> None:
    parse = build_parser().parse_args
    assert parse(["bench", "--vs", "hf", "llama.cpp"]).vs == ["hf", "llama.cpp"]
    assert parse(["bench", "--vs", "llama.cpp", "--vs", "hf"]).vs == ["llama.cpp", "hf"]
    assert parse(["bench"]).vs == []


def test_missing_llama_cpp_is_one_line_before_any_model_loads(
    capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now fails
    with pytest.raises(ModelLoadError, match="make peers"):
        import_llama_cpp()
    # A model path that does not exist: the peer check must come first.
    code = main(["bench", "--vs", "llama.cpp", "--model", "no-such-model.gguf"])
    err = capsys.readouterr().err
    assert code == 1
    assert err == f"phasewise: error: {LLAMA_CPP_MISSING}\n"


def test_llama_cpp_peer_runs_only_gguf_models(tmp_path) -> None:
    gguf = tmp_path / "model.gguf"
    assert gguf_for(info("gguf", str(gguf))) == gguf
    with pytest.raises(ModelLoadError, match="needs a GGUF model"):
        gguf_for(info("folder", str(tmp_path)))


@pytest.fixture(scope="module")
def bundled() -> LoadedModel:
    """The bundled model, loaded once for this module's llama.cpp comparisons."""
    return load_model("default")


@needs_llama_cpp
@pytest.mark.real_model
def test_bench_vs_llama_cpp_reports_both_sides_and_ratios(capsys, bundled: LoadedModel) -> None:
    report = bench_decode(TorchRuntime(bundled), prompt_tokens=32, max_tokens=8, repeats=1,
                          peers=["llama.cpp"])
    assert report["llama_cpp_gguf"] == DEFAULT_GGUF
    assert report["llama_cpp_threads"] == torch.get_num_threads()
    assert report["llama_cpp_decode_tok_s"] > 0 and report["llama_cpp_ttft_s"] > 0
    assert 0 < report["llama_cpp_itl_p50_s"] <= report["llama_cpp_itl_p99_s"]
    assert report["decode_ratio_vs_llama_cpp"] == pytest.approx(
        report["decode_tok_s"] / report["llama_cpp_decode_tok_s"])
    assert report["ttft_ratio_vs_llama_cpp"] == pytest.approx(
        report["llama_cpp_ttft_s"] / report["ttft_s"])
    assert "hf_decode_tok_s" not in report  # only the peers asked for run
    # flash attention off and on both ran; the ratios are against the faster
    rates = {on: report[f"llama_cpp_fa_{'on' if on else 'off'}_decode_tok_s"]
             for on in (False, True)}
    assert report["llama_cpp_decode_tok_s"] == max(rates.values()) > 0
    assert rates[report["llama_cpp_flash_attn"]] == max(rates.values())
    print_decode_table(report)
    out = capsys.readouterr().out
    assert "llama.cpp (llama-cpp-python)" in out and "decode ratio vs llama.cpp" in out
    assert "flash attention on" in out or "flash attention off" in out


@needs_llama_cpp
@pytest.mark.real_model
def test_llama_cpp_peer_decodes_the_same_prompt_ids_greedily(bundled: LoadedModel) -> None:
    """The same weights (the GGUF ours is converted from) and prompt ids: llama.cpp's greedy
    tokens start like ours, so the ratio compares equal work."""
    prompt = fixed_prompt_ids(bundled, 32)
    ours = run_ours(TorchRuntime(bundled), prompt, 4)
    with LlamaCppPeer(gguf_for(bundled.info), n_threads=1, n_ctx=64) as peer:
        first = peer.run(prompt, 4)
        again = peer.run(prompt, 4)  # each run resets the KV cache first
    assert first.token_ids == again.token_ids == ours.token_ids
    assert len(first.itl_s) == 3 and first.ttft_s > 0


@needs_llama_cpp
@pytest.mark.real_model
def test_llama_cpp_peer_decodes_a_128_token_prompt(bundled: LoadedModel) -> None:
    """The prompt length that crashed a -march=native build on a VM that advertises AMX but
    faults on it (SIGILL in ggml's AMX matmul; 1-token prompts ran): the portable build
    prefills it and decodes, greedily, what ours decodes."""
    prompt = fixed_prompt_ids(bundled, 128)
    ours = run_ours(TorchRuntime(bundled), prompt, 4)
    with LlamaCppPeer(gguf_for(bundled.info), n_threads=torch.get_num_threads(),
                      n_ctx=256) as peer:
        result = peer.run(prompt, 16)
    if platform.machine().lower() in ("x86_64", "amd64"):  # the portable x86-64 build
        assert "AVX2 = 1" in peer.system_info and "AMX_INT8 = 1" not in peer.system_info
    assert len(result.token_ids) == 16 and len(result.itl_s) == 15
    assert result.ttft_s > 0 and result.decode_tok_s > 0
    assert result.token_ids[:4] == ours.token_ids
