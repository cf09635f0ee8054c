"""Float weights a quantized copy no longer reads give their memory back, and nothing else
does: their bytes stay what the file holds, anonymous memory and written pages are left."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.runtimes.torch.file_pages import clean_file_mappings, release_file_pages
from engine.runtimes.torch.kernels import apply_kernel
from engine.runtimes.torch.loader import load_model

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="madvise and smaps: Linux")


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the mapping holding tensor that are in memory (smaps' Rss)."""
    address = tensor.untyped_storage().data_ptr()
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "Rss:":
                return int(fields[1]) * 1024
    raise AssertionError("tensor not in any mapping")


def largest_linear_weight(model: torch.nn.Module) -> torch.Tensor:
    return max((m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)),
               key=lambda w: w.numel())


def test_a_loaded_weight_is_released_and_reads_back_the_same(tiny_model_dir: Path) -> None:
    model = load_model(str(tiny_model_dir)).model
    weight = largest_linear_weight(model)
    before = weight.clone()
    assert weight.untyped_storage().nbytes() >= 3 * 4096  # whole pages to give back
    resident = resident_bytes(weight)
    released = release_file_pages([weight])
    assert released > 0
    assert resident_bytes(weight) <= resident - released
    assert torch.equal(weight, before)  # read back from the file


def test_anonymous_memory_and_written_mappings_are_left_alone(tiny_model_dir: Path) -> None:
    anonymous = torch.randn(64, 1024)
    copy = anonymous.clone()
    assert release_file_pages([anonymous]) == 0
    assert torch.equal(anonymous, copy)

    model = load_model(str(tiny_model_dir)).model
    weight = largest_linear_weight(model)
    with torch.no_grad():
        weight[0, 0] += 1.0  # a private copy of that page: dropping it would undo this
    written = weight.clone()
    assert release_file_pages([weight]) == 0
    assert torch.equal(weight, written)
    address = weight.untyped_storage().data_ptr()
    assert not any(start <= address < end for start, end in clean_file_mappings())


def test_a_quantized_copy_leaves_the_float_model_exact(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir))
    ids = torch.tensor([[5, 9, 2, 7, 3, 11]])
    with torch.inference_mode():
        before = loaded.model(input_ids=ids).logits
        for name in ("int8-dynamic", "fp16-dynamic"):
            apply_kernel(loaded, name)  # releases the pages of the weights it packed
            assert torch.equal(loaded.model(input_ids=ids).logits, before)
