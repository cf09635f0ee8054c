"""A loaded model's memory moved to 2 MiB pages (Linux transparent huge pages) while idle.

A decode step reads every weight once. In 4 KiB pages a 100 MB model is 25,000 pages, many
times what the TLB holds, so each step walks page tables and the prefetchers stop at every
page's end. Linux's usual setting (THP "madvise") gives 2 MiB pages only to memory that asks
for them, and llama.cpp's buffers do not ask. So a runtime notes the anonymous memory its load
mapped (`anonymous_ranges` before and after, `new_ranges`), and `HugePages.step` asks the kernel
to collapse it into huge pages one 2 MiB piece at a time (MADV_COLLAPSE, Linux 6.1: the piece
is copied into a free huge page when one can be made; its contents do not change). The engine
thread calls it only while nothing waits (engine/worker.py), so no request pays for it.

Only pieces whose every page is resident are collapsed: memory reserved but not yet used (the
end of a long context's KV) stays unallocated. Nothing asks for 2 MiB pages on later faults
(MADV_HUGEPAGE would let khugepaged fill such reservations in the background).

Measured (docs/benchmarks.md): llama.cpp decode 1-3% faster, K-quant models the most.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import errno
import logging
import mmap
import platform
import re
import sys
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

THP_DIR = Path("/sys/kernel/mm/transparent_hugepage")
MADV_COLLAPSE = 25  # linux/mman.h (6.1+)
SMALL_PAGE = mmap.PAGESIZE


def _pmd_size() -> int:
    """The huge page THP makes: 2 MiB on x86-64 and on arm64 with 4 KiB pages."""
    try:
        return int((THP_DIR / "hpage_pmd_size").read_text(encoding="ascii"))
    except (OSError, ValueError):
        return 2 << 20


HUGE_PAGE = _pmd_size()

Range = tuple[int, int]  # [start, end) addresses


def thp_setting(path: Path = THP_DIR / "enabled") -> str:
    """The system's transparent huge page setting ("always", "madvise", "never"), or "" where
    there is none (not Linux, a kernel without THP)."""
    try:
        text = path.read_text(encoding="ascii")
    except OSError:
        return ""
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else ""


def supported(release: str | None = None) -> bool:
    """Whether this process can move memory to huge pages: Linux 6.1 or later (MADV_COLLAPSE)
    with THP not turned off. `release`: a kernel release string (platform.release())."""
    if not sys.platform.startswith("linux"):
        return False
    version = re.match(r"(\d+)\.(\d+)", release or platform.release())
    if version is None or (int(version[1]), int(version[2])) < (6, 1):
        return False
    return thp_setting() in ("always", "madvise")


def anonymous_ranges(maps: str | None = None) -> list[Range]:
    """The process's private anonymous mappings (no file, no [heap] or [stack] name), from
    /proc/self/maps or its text."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text(encoding="ascii")
        except OSError:
            return []
    ranges = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 5 and fields[1].endswith("p"):
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def new_ranges(before: Iterable[Range], after: Iterable[Range]) -> list[Range]:
    """The parts of `after` that no range of `before` covers (a mapping made since may have
    merged with an older neighbour)."""
    old = sorted(before)
    ends = [old_end for _, old_end in old]
    fresh = []
    for start, end in sorted(after):
        i = bisect.bisect_right(ends, start)  # the first older mapping that ends past start
        while i < len(old) and old[i][0] < end:
            if old[i][0] > start:
                fresh.append((start, old[i][0]))
            start = max(start, old[i][1])
            i += 1
        if start < end:
            fresh.append((start, end))
    return fresh


def huge_pieces(ranges: Iterable[Range]) -> list[int]:
    """The start of every whole 2 MiB-aligned piece inside the ranges."""
    pieces: list[int] = []
    for start, end in ranges:
        first = -(-start // HUGE_PAGE) * HUGE_PAGE
        pieces.extend(range(first, end - HUGE_PAGE + 1, HUGE_PAGE))
    return pieces


class _Kernel:
    """The two system calls, through libc."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.madvise = libc.madvise
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.mincore = libc.mincore
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        self._vector = ctypes.create_string_buffer(HUGE_PAGE // SMALL_PAGE)

    def resident(self, address: int) -> bool:
        """Whether every small page of the piece is in memory (False where it is unmapped)."""
        if self.mincore(address, HUGE_PAGE, self._vector) != 0:
            return False
        return all(byte & 1 for byte in self._vector.raw)

    def collapse(self, address: int) -> int:
        """0, or the errno of MADV_COLLAPSE (EINVAL: a kernel before 6.1 or memory that cannot
        be collapsed; EAGAIN / ENOMEM: no huge page free now)."""
        if self.madvise(address, HUGE_PAGE, MADV_COLLAPSE) == 0:
            return 0
        return ctypes.get_errno()


class HugePages:
    """Moves the resident 2 MiB pieces of some memory to huge pages, one piece a step."""

    def __init__(self, ranges: Sequence[Range]) -> None:
        self._pending = deque(huge_pieces(ranges))
        self._kernel = _Kernel() if self._pending else None
        self.backed_bytes = 0  # collapsed by this object
        self.tried_bytes = 0  # resident pieces it asked the kernel about
        self.refusals: dict[str, int] = {}  # errno name -> pieces the kernel refused

    def add(self, ranges: Sequence[Range]) -> None:
        """More memory to move (a draft model's, loaded later)."""
        self._pending.extend(huge_pieces(ranges))
        if self._pending and self._kernel is None:
            self._kernel = _Kernel()

    def step(self) -> bool:
        """Collapse the next resident piece (skipping pieces not wholly resident); True while
        pieces are left. One collapse costs ~0.1-5 ms (more when the kernel must compact
        memory to free a huge page)."""
        kernel = self._kernel
        while self._pending and kernel is not None:
            address = self._pending.popleft()
            if not kernel.resident(address):
                continue
            self.tried_bytes += HUGE_PAGE
            error = kernel.collapse(address)
            if error == 0:
                self.backed_bytes += HUGE_PAGE
            else:
                name = errno.errorcode.get(error, str(error))
                self.refusals[name] = self.refusals.get(name, 0) + 1
                if error == errno.EINVAL and not self.backed_bytes and self.refusals[name] >= 8:
                    log.info("huge pages: the kernel refuses MADV_COLLAPSE; memory stays in "
                             "small pages")
                    self._pending.clear()
            break
        return bool(self._pending)

    def describe(self) -> str:
        """"160 of 162 MiB in 2 MiB pages" (of the resident memory asked about so far; "still
        moving" while pieces are left), or "" where no memory was given."""
        if self._kernel is None:
            return ""
        said = (f"{self.backed_bytes >> 20} of {self.tried_bytes >> 20} MiB in "
                f"{HUGE_PAGE >> 20} MiB pages")
        return f"{said}, still moving" if self._pending else said
