"""Moving a loaded model's memory to 2 MiB pages (engine/core/huge_pages.py)."""

from __future__ import annotations

import ctypes
import mmap
import platform
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.core import huge_pages
from engine.core.huge_pages import HUGE_PAGE, HugePages, anonymous_ranges, huge_pieces, new_ranges

MAPS = """\
55d0c0a00000-55d0c0c00000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
7f0000400000-7f0000600000 rw-s 00000000 00:01 1234                       /dev/zero (deleted)
7f0000600000-7f0000800000 r--p 00000000 08:01 42                         /models/m.gguf
7f0000800000-7f0000a00000 rw-p 00000000 00:00 0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
"""


def test_only_private_anonymous_mappings_are_candidates() -> None:
    assert anonymous_ranges(MAPS) == [(0x7F0000000000, 0x7F0000400000),
                                      (0x7F0000800000, 0x7F0000A00000)]


@pytest.mark.parametrize(("before", "after", "fresh"), [
    ([], [(0, 10)], [(0, 10)]),
    ([(0, 10)], [(0, 10)], []),
    ([(0, 10)], [(0, 30)], [(10, 30)]),  # a new mapping merged with an older neighbour
    ([(10, 20)], [(0, 30)], [(0, 10), (20, 30)]),
    ([(0, 5), (8, 12)], [(0, 20), (30, 40)], [(5, 8), (12, 20), (30, 40)]),
    ([(0, 10)], [(20, 30)], [(20, 30)]),
])
def test_new_ranges_are_what_no_older_mapping_covers(before, after, fresh) -> None:
    assert new_ranges(before, after) == fresh


def test_pieces_are_whole_aligned_huge_pages() -> None:
    start = 3 * HUGE_PAGE + 4096
    assert huge_pieces([(start, start + 3 * HUGE_PAGE)]) == [4 * HUGE_PAGE, 5 * HUGE_PAGE]
    assert huge_pieces([(0, HUGE_PAGE - 1)]) == []


@pytest.mark.parametrize(("text", "setting"), [
    ("always [madvise] never\n", "madvise"),
    ("[always] madvise never\n", "always"),
    ("always madvise [never]\n", "never"),
])
def test_the_system_setting_is_the_bracketed_word(tmp_path: Path, text: str,
                                                  setting: str) -> None:
    path = tmp_path / "enabled"
    path.write_text(text)
    assert huge_pages.thp_setting(path) == setting
    assert huge_pages.thp_setting(tmp_path / "absent") == ""


def _kernel_collapses() -> bool:
    return huge_pages.supported()


@pytest.mark.parametrize(("release", "new_enough"), [
    ("6.18.44-fc-v1252", True), ("6.1.0-28-amd64", True), ("5.15.0-91-generic", False),
    ("6.0.12", False), ("unknown", False),
])
def test_only_a_kernel_with_madv_collapse_is_used(release: str, new_enough: bool) -> None:
    on = huge_pages.thp_setting() in ("always", "madvise") and platform.system() == "Linux"
    assert huge_pages.supported(release) == (new_enough and on)


def _huge_kib(start: int, end: int) -> int:
    """AnonHugePages of the mapping that holds [start, end), from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= start and end <= high
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.fixture
def private_memory() -> tuple[mmap.mmap, int]:
    """8 MiB of private anonymous memory and its address, unmapped afterwards."""
    memory = mmap.mmap(-1, 4 * HUGE_PAGE + HUGE_PAGE,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = (ctypes.c_char * len(memory)).from_buffer(memory)
    yield memory, ctypes.addressof(buffer)
    del buffer
    memory.close()


@pytest.mark.skipif(not _kernel_collapses(), reason="needs Linux 6.1+ with THP not 'never'")
def test_resident_memory_moves_to_huge_pages_unchanged(private_memory) -> None:
    memory, address = private_memory
    pattern = bytes(range(256)) * (len(memory) // 256)
    memory[:] = pattern
    pieces = len(huge_pieces([(address, address + len(memory))]))  # 4, or 5 where aligned
    pages = HugePages([(address, address + len(memory))])
    assert pages.describe() == "0 of 0 MiB in 2 MiB pages, still moving"
    steps = 1
    while pages.step():
        steps += 1
    assert pieces >= 4 and steps == pieces  # one collapse a step
    assert pages.backed_bytes == pages.tried_bytes == pieces * HUGE_PAGE, pages.refusals
    assert memory[:] == pattern
    assert _huge_kib(address, address + len(memory)) == pieces * HUGE_PAGE // 1024
    assert pages.describe() == f"{2 * pieces} of {2 * pieces} MiB in 2 MiB pages"


@pytest.mark.skipif(not _kernel_collapses(), reason="needs Linux 6.1+ with THP not 'never'")
def test_memory_not_wholly_resident_is_left_alone(private_memory) -> None:
    memory, address = private_memory
    first = -(-address // HUGE_PAGE) * HUGE_PAGE - address  # offset of the first whole piece
    memory[first:first + HUGE_PAGE // 2] = b"x" * (HUGE_PAGE // 2)  # half a piece touched
    pages = HugePages([(address, address + len(memory))])
    while pages.step():
        pass
    assert pages.tried_bytes == pages.backed_bytes == 0
    assert _huge_kib(address, address + len(memory)) == 0
    assert memory[first:first + 4] == b"xxxx"


def test_a_new_mapping_is_found_by_the_difference() -> None:
    before = anonymous_ranges()
    memory = mmap.mmap(-1, 4 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = (ctypes.c_char * len(memory)).from_buffer(memory)
    address = ctypes.addressof(buffer)
    try:
        fresh = new_ranges(before, anonymous_ranges())
        assert any(low <= address and address + len(memory) <= high for low, high in fresh)
    finally:
        del buffer
        memory.close()


def test_unmapped_memory_is_skipped() -> None:
    memory = mmap.mmap(-1, 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = (ctypes.c_char * len(memory)).from_buffer(memory)
    address = ctypes.addressof(buffer)
    del buffer
    memory.close()
    pages = HugePages([(address, address + 2 * HUGE_PAGE)])
    while pages.step():
        pass
    assert pages.tried_bytes == 0
    assert HugePages([]).describe() == ""


def _disjoint(cuts: list[int]) -> list[tuple[int, int]]:
    """Non-empty disjoint ranges from sorted distinct cut points, every other gap kept."""
    points = sorted(set(cuts))
    return [(a, b) for a, b in zip(points[::2], points[1::2], strict=False)]


@given(st.lists(st.integers(0, 200), max_size=16), st.lists(st.integers(0, 200), max_size=16))
def test_new_ranges_cover_exactly_what_is_new(before_cuts: list[int],
                                               after_cuts: list[int]) -> None:
    before, after = _disjoint(before_cuts), _disjoint(after_cuts)
    fresh = new_ranges(before, after)
    covered = {x for a, b in fresh for x in range(a, b)}
    assert covered == ({x for a, b in after for x in range(a, b)}
                       - {x for a, b in before for x in range(a, b)})
    assert all(a < b for a, b in fresh) and sum(b - a for a, b in fresh) == len(covered)
