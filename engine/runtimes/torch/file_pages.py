"""Give back the memory of float weights a quantized copy no longer reads.

A model loaded from safetensors holds its weights in a private mapping of the file: the pages
it has read stay resident (and count as the process's memory) for as long as anything of the
file is in use, which after an int8 or fp16 copy is built is the shared fp32 embedding. The
Linear weights the copy packed are then dead weight, and so is most of a tied head's
embedding, whose lookups read a few rows: on the Gemma-3-270M shape, about 1 GB.

madvise(MADV_DONTNEED) drops such pages; touched again, they are read back from the file, so
the original model stays correct for a caller that keeps it. Only ranges inside a file
mapping none of whose pages was ever written are dropped (smaps' `Anonymous: 0 kB`): in a
private mapping a written page is a private copy, and dropping it would bring back the file's
bytes. Anywhere else (anonymous memory, another OS, a GPU) nothing happens.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Iterable
from functools import cache

import torch

MADV_DONTNEED = 4  # Linux


def release_file_pages(tensors: Iterable[torch.Tensor],
                       mappings: list[tuple[int, int]] | None = None) -> int:
    """Drop the resident pages wholly inside each tensor's storage where that storage lies in
    a never-written file mapping (`mappings`: clean_file_mappings(), read once by a caller
    releasing tensor after tensor: reading smaps takes ~8 ms); the bytes released."""
    if sys.platform != "linux":
        return 0
    if mappings is None:
        mappings = clean_file_mappings()
    released = 0
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        low, high = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        if not any(start <= low and high <= end for start, end in mappings):
            continue
        # Whole pages only: the pages at either end may hold a neighbour's bytes.
        start = -(-low // mmap.PAGESIZE) * mmap.PAGESIZE
        end = high // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start and _madvise(start, end - start) == 0:
            released += end - start
    return released


def clean_file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of a file none of whose pages was written
    (empty off Linux)."""
    mappings: list[tuple[int, int]] = []
    if sys.platform != "linux":
        return mappings
    current: tuple[int, int] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                start, end = (int(x, 16) for x in fields[0].split("-"))
                is_file = len(fields) >= 6 and fields[4] != "0" and fields[5].startswith("/")
                current = (start, end) if is_file else None
            elif fields[0] == "Anonymous:" and current is not None and fields[1] == "0":
                mappings.append(current)
    return mappings


def _madvise(address: int, length: int) -> int:
    return int(_libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(length),
                               MADV_DONTNEED))


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
