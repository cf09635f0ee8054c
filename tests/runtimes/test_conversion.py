"""GGUF conversion: streamed tensor by tensor, keyed without re-hashing the file every start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.runtimes.torch import loader
from engine.runtimes.torch.loader import CONVERTED_MARKER, SafetensorsStream, converted_gguf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_streamed_safetensors_read_back_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import load_file

    tensors = {"embed.weight": torch.randn(7, 5), "norm.weight": torch.randn(5),
               "scalar": torch.tensor(1.5), "wide.weight": torch.randn(3, 9).t()}
    out = SafetensorsStream(tmp_path / "model.safetensors")
    for name, tensor in tensors.items():
        out.add(name, tensor.to(dtype))
    out.close()
    back = load_file(tmp_path / "model.safetensors")
    assert sorted(back) == sorted(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == dtype and back[name].equal(tensor.to(dtype))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


@pytest.mark.parametrize("kind", ["Q8_0", "F16", "F32"])
def test_dequantizing_in_row_chunks_gives_the_same_tensor(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize, quantize

    rows = np.random.default_rng(0).standard_normal((37, 64)).astype(np.float32)
    kind_type = GGMLQuantizationType[kind]
    data = quantize(rows, kind_type) if kind == "Q8_0" else rows.astype(
        np.float16 if kind == "F16" else np.float32)
    monkeypatch.setattr(loader, "DEQUANTIZE_CHUNK_BYTES", 5 * 64 * 4)  # 5 rows: 8 chunks
    chunked = loader.dequantized(data, kind_type)
    whole = dequantize(data, kind_type)
    assert chunked.shape == whole.shape == (37, 64) and chunked.dtype == whole.dtype
    assert np.array_equal(chunked, whole)


@pytest.fixture
def fake_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """converted_gguf with the conversion itself replaced (writes only the marker), counting
    full-file hashes and conversions."""
    calls = {"hash": 0, "convert": 0}
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path / "cache"))
    real_hash = loader.file_sha256

    def counting_hash(path: Path, *args) -> str:
        calls["hash"] += 1
        return real_hash(path, *args)

    def fake_convert(gguf, target: Path, record, dtype, notify, counted=None) -> None:
        calls["convert"] += 1
        target.mkdir(parents=True)
        (target / CONVERTED_MARKER).write_text(json.dumps(record))

    monkeypatch.setattr(loader, "file_sha256", counting_hash)
    monkeypatch.setattr(loader, "_convert_gguf", fake_convert)
    return calls


def test_the_whole_file_is_hashed_once_not_every_start(tmp_path: Path,
                                                       fake_conversion: dict) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(3 << 20))
    first = converted_gguf(gguf, lambda _m: None)
    assert fake_conversion == {"hash": 1, "convert": 1}
    assert converted_gguf(gguf, lambda _m: None) == first
    assert fake_conversion == {"hash": 1, "convert": 1}  # an ordinary start: no full hash
    os.utime(gguf, ns=(1, 1))  # copied or touched: the content is confirmed once
    assert converted_gguf(gguf, lambda _m: None) == first
    assert converted_gguf(gguf, lambda _m: None) == first
    assert fake_conversion == {"hash": 2, "convert": 1}
    assert converted_gguf(gguf, lambda _m: None, torch.bfloat16) != first  # another dtype


def test_changed_content_converts_again(tmp_path: Path, fake_conversion: dict) -> None:
    gguf = tmp_path / "m.gguf"
    data = bytearray(b"GGUF" + os.urandom(3 << 20))
    gguf.write_bytes(data)
    first = converted_gguf(gguf, lambda _m: None)
    data[len(data) // 2 :] = os.urandom(len(data) - len(data) // 2)  # new weights, same header
    gguf.write_bytes(data)
    assert converted_gguf(gguf, lambda _m: None) != first
    assert fake_conversion["convert"] == 2


@pytest.mark.real_model
@pytest.mark.timeout(660)  # the child's own limit is 600 s
def test_bundled_gguf_converts_exactly_within_its_memory(tmp_path: Path) -> None:
    """In a child (fresh cache dir): the streamed conversion gives transformers' own GGUF
    weights, and its peak resident memory grows by about one converted model, not three."""
    script = textwrap.dedent("""
        import json, resource, sys
        from engine.runtimes.torch.loader import converted_gguf
        from engine.model_files import default_gguf_path
        import gguf, transformers  # counted in the baseline, as in the app
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        folder = converted_gguf(default_gguf_path(), lambda _m: None)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        size = (folder / "model.safetensors").stat().st_size
        print(json.dumps({"grew": peak - base, "size": size, "folder": str(folder)}))
    """)
    env = {**os.environ, "PHASEWISE_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, cwd=Path(__file__).resolve().parents[2], timeout=600, check=True)
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["grew"] < 1.3 * report["size"]

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    gguf_path = loader.default_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    converted = load_file(Path(report["folder"]) / "model.safetensors")
    expected = reference.state_dict()
    for name, tensor in converted.items():
        assert tensor.equal(expected[name]), name
    assert set(expected) - set(converted) <= {"lm_head.weight"}  # tied to the embedding
