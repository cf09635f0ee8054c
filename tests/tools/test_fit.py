"""Will it fit? engine/tools/fit.py's estimate against real allocations (bytes), and the refusal of
a model that cannot fit: one line, through the CLI, before anything loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.cli import main
from engine import runtimes
from engine.errors import ModelLoadError
from engine.runtimes.torch.loader import load_model
from engine.runtimes.torch.prefix_cache import cache_nbytes, new_cache
from engine.tools import fit
from tests.support.child import needs_llama_cpp, run_in_child
from tests.support.gguf import write_gguf, write_out
from tests.support.tiny_model import TINY_WINDOW, build_tiny_architecture

MIB = 1 << 20


# ----- the estimate against what the engines really allocate --------------------------------
def _llama_cpp_buffers(context: int) -> dict[str, Any]:
    """In the child: load the bundled GGUF, and read the buffers llama.cpp says it made."""
    import logging

    from engine import runtimes
    from engine.model_files import default_gguf_path
    from engine.tools import fit

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("engine.runtimes.llamacpp.model")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Keep())
    loaded = runtimes.load("default", runtimes.LLAMA_CPP, context_length=context)
    loaded.close()
    mib = {}
    for key, marker in (("weights", "model buffer size"), ("kv", "KV buffer size"),
                        ("output", "output buffer size"), ("compute", "compute buffer size =")):
        # the last context made is the one that stays (attention's timing makes its own first)
        line = [x for x in lines if marker in x][-1]
        mib[key] = float(line.split("=")[-1].split()[0])
    est = fit.llama_cpp_estimate(default_gguf_path(), context)
    return {"mib": mib, "estimate": est.__dict__}


@needs_llama_cpp
@pytest.mark.parametrize("context", [8192, 1024])
def test_llama_cpp_estimate_matches_what_it_allocates(context: int) -> None:
    out = run_in_child(_llama_cpp_buffers, context)
    mib, est = out["mib"], out["estimate"]
    assert est["context"] == context
    assert est["weight_bytes"] / MIB == pytest.approx(mib["weights"], rel=0.01)
    assert est["kv_bytes"] / MIB == pytest.approx(mib["kv"], rel=0.01)
    buffers = mib["output"] + mib["compute"]
    assert est["buffer_bytes"] / MIB == pytest.approx(buffers, rel=0.15)
    total = sum(mib.values())
    needed = est["weight_bytes"] + est["kv_bytes"] + est["buffer_bytes"]
    assert needed / MIB == pytest.approx(total, rel=0.05)


@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text", "lfm2"])
def test_torch_estimate_matches_the_weights_and_a_filled_cache(tmp_path: Path,
                                                               model_type: str) -> None:
    """Weights as loaded (fp32 on the CPU) and the KV cache the engine keeps after a prompt
    longer than the sliding window: sliding layers at full size, conv layers without KV."""
    folder = build_tiny_architecture(tmp_path / model_type, model_type)
    tokens = 4 * TINY_WINDOW
    est = fit.torch_estimate(str(folder), device="cpu", context_length=tokens)
    assert est is not None and est.context == tokens
    model = load_model(str(folder), device="cpu").model  # as loaded, before a kernel choice
    weights = sum(p.numel() * p.element_size()
                  for p in {p.data_ptr(): p for p in model.parameters()}.values())
    assert est.weight_bytes == weights
    cache = new_cache(model.config)
    with torch.no_grad():
        model(input_ids=torch.arange(tokens).unsqueeze(0) % 100, cache=cache, use_cache=True)
    kv = cache_nbytes(cache)
    if model_type == "lfm2":  # its conv layers' recorded input is not KV: count attention only
        kv = sum(layer.keys.numel() * layer.keys.element_size() * 2
                 for layer in cache.layers if getattr(layer, "keys", None) is not None
                 and layer.keys.dim() == 4)
    assert est.kv_bytes == kv


# ----- refusing what cannot fit --------------------------------------------------------------
def test_a_smaller_context_is_offered_when_one_fits(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "wide.gguf", layers=32, kv_heads=32)  # 512 KiB KV per token
    est = fit.llama_cpp_estimate(path, None, free=2 * 10**9)
    assert est.context == 8192 and not est.fits
    assert est.fitting_context is not None and 512 <= est.fitting_context < 8192
    assert est.fitting_context % 256 == 0
    smaller = fit.llama_cpp_estimate(path, est.fitting_context, free=2 * 10**9)
    assert smaller.fits
    larger = fit.llama_cpp_estimate(path, est.fitting_context + 256, free=2 * 10**9)
    assert not larger.fits
    line = est.refusal("wide")
    assert "\n" not in line and f"fits with a context of {est.fitting_context:,}" in line
    assert "GB is free" in line and "8,192 tokens" in line


def test_nothing_offered_when_no_context_fits(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "wide.gguf", layers=32, kv_heads=32)
    est = fit.llama_cpp_estimate(path, None, free=10**8)
    assert not est.fits and est.fitting_context is None
    assert "choose a smaller model" in est.refusal("wide")


def test_summary_names_the_need_and_the_free_memory(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "small.gguf", layers=2, kv_heads=2)
    est = fit.llama_cpp_estimate(path, 1024, free=11_200_000_000)
    assert est.fits
    assert est.summary().startswith("needs ~")
    assert est.summary().endswith("11.2 GB free")
    assert "at 1,024 tokens" in est.summary()


def test_cli_refuses_a_model_that_cannot_fit_in_one_line(capsys, tmp_path: Path) -> None:
    """Too big for any context: refused before llama.cpp (or anything else) loads it."""
    free = fit.free_memory()
    assert free is not None
    per_token = free // 256  # even 512 tokens need twice what is free
    path = write_gguf(tmp_path / "huge.gguf", layers=1, kv_heads=per_token // 256)
    code = main(["ask", "--engine", "llama.cpp", "--model", str(path), "hello"])
    _out, err = capsys.readouterr()
    assert code == 1
    assert err.count("\n") == 1 and "huge.gguf does not fit in memory" in err
    assert "choose a smaller model" in err


def test_cli_offers_the_context_that_fits(capsys, tmp_path: Path) -> None:
    free = fit.free_memory()
    assert free is not None
    per_token = free // 2048  # the 8,192-token default needs ~4x what is free, 1,024 half
    path = write_gguf(tmp_path / "wide.gguf", layers=1, kv_heads=per_token // 256)
    code = main(["ask", "--engine", "llama.cpp", "--model", str(path), "hello"])
    _out, err = capsys.readouterr()
    assert code == 1 and err.count("\n") == 1
    assert "does not fit in memory" in err and "it fits with a context of" in err


def test_a_folder_too_big_for_torch_is_refused_before_loading(tmp_path: Path) -> None:
    """Sizes come from the safetensors header: a 4 TB tensor is refused without reading it."""
    import json
    import struct

    folder = tmp_path / "giant"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
         "hidden_size": 64, "vocab_size": 100, "max_position_embeddings": 256}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 20, 1 << 20],
                               "data_offsets": [0, 1 << 42]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ModelLoadError, match="giant does not fit in memory") as info:
        runtimes.load(str(folder), runtimes.TORCH, device="cpu")
    assert "\n" not in str(info.value)


def test_a_gguf_s_own_sampling_settings_are_read(tmp_path: Path) -> None:
    """llama.cpp's general.sampling.* keys become the model's sampling defaults (the window
    starts its sliders there); a file without them suggests nothing."""
    from gguf import GGUFWriter

    from engine.events import SamplingDefaults
    from engine.gguf_header import read_gguf

    plain = write_gguf(tmp_path / "plain.gguf", layers=1, kv_heads=1)
    assert read_gguf(plain).sampling_defaults() == SamplingDefaults()
    writer = GGUFWriter(str(tmp_path / "suggests.gguf"), "llama")
    writer.add_float32("general.sampling.temp", 0.25)
    writer.add_float32("general.sampling.top_p", 0.5)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.penalty_repeat", 1.5)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    write_out(writer)
    assert read_gguf(tmp_path / "suggests.gguf").sampling_defaults() == SamplingDefaults(
        0.25, 0.5, 40, 1.5)


def test_the_summary_names_every_term_it_adds() -> None:
    """Issue 31 item 6: "weights 247 MB + KV cache 151 MB" read as "needs ~978 MB" with the
    third term (llama.cpp's compute and output buffers) unnamed."""
    est = fit.Estimate("llama.cpp", "cpu", 8192, 247_000_000, 151_000_000, 580_000_000,
                       11_200_000_000)
    assert est.summary() == ("needs ~978 MB (weights 247 MB + KV cache 151 MB at 8,192 tokens "
                             "+ working buffers 580 MB), 11.2 GB free")
    converting = fit.Estimate("torch", "cpu", 8192, 1_000_000_000, 100_000_000, 50_000_000,
                              None, peak_bytes=1_300_000_000)
    assert converting.summary() == (
        "needs ~1.3 GB (converting the GGUF for torch peaks at 1.3 GB; then weights 1.0 GB + "
        "KV cache 100 MB at 8,192 tokens + working buffers 50 MB = 1.1 GB), free unknown")


def test_the_estimate_knows_the_model_s_context_limit(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "short.gguf", layers=2, kv_heads=2, context=4096)
    est = fit.llama_cpp_estimate(path, 999_999, free=None)
    assert (est.context, est.model_context) == (4096, 4096)


def test_a_gguf_names_its_quantization(tmp_path: Path) -> None:
    """The status bar called a Q4_K_M file "Medium" (the last word of llama.cpp's "Q4_K -
    Medium")."""
    from gguf import GGUFWriter

    from engine.gguf_header import read_gguf

    writer = GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M in llama.h
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float16))
    write_out(writer)
    assert read_gguf(tmp_path / "k.gguf").file_type() == "Q4_K_M"
    assert read_gguf(write_gguf(tmp_path / "none.gguf", layers=1, kv_heads=1)).file_type() is None
