"""The KV shelf's files (engine/core/snapshots.py) at the byte level: what a damaged or foreign
snapshot does on load, what clearing the shelf frees, and that its names stay stable across
releases. The engine-level resume tests are in tests/runtimes/test_kv_snapshots.py."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from engine.core import snapshots
from engine.core.snapshots import _HEAD, FORMAT_VERSION, MAGIC, KvShelf, clear_shelf, shelf_key

IDS = [5, 6, 7]
PAYLOAD = bytes(range(40))


@pytest.fixture
def shelf(tmp_path: Path) -> Iterator[KvShelf]:
    shelf = KvShelf(tmp_path, "model")
    shelf.put("c", IDS, lambda: PAYLOAD)
    assert shelf.flush(30)
    yield shelf
    shelf.close(10)


def only_file(shelf: KvShelf) -> Path:
    (path,) = shelf.folder.glob("*.kv")
    return path


def test_a_snapshot_reads_back_what_was_put(shelf: KvShelf) -> None:
    found = shelf.find("c")
    assert found is not None and found.ids == IDS
    assert shelf.load(found) == PAYLOAD


def test_a_payload_changed_on_disk_is_dropped_on_load_and_logged(
        shelf: KvShelf, caplog: pytest.LogCaptureFixture) -> None:
    found = shelf.find("c")
    assert found is not None
    raw = bytearray(found.path.read_bytes())
    raw[-1] ^= 0xFF
    found.path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="phasewise.snapshots"):
        assert shelf.load(found) is None
    assert not found.path.exists()
    assert f"KV snapshot {found.path.name} dropped: checksum mismatch" in caplog.messages


def test_a_snapshot_gone_bad_between_find_and_load_is_dropped(
        shelf: KvShelf, caplog: pytest.LogCaptureFixture) -> None:
    found = shelf.find("c")
    assert found is not None
    found.path.write_bytes(found.path.read_bytes()[:_HEAD.size + 5])  # the header cut short
    with caplog.at_level(logging.WARNING, logger="phasewise.snapshots"):
        assert shelf.load(found) is None
    assert not found.path.exists()
    assert f"{found.path.name} dropped:" in caplog.text


def test_another_models_snapshot_under_this_name_is_refused_on_load(
        shelf: KvShelf, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    found = shelf.find("c")
    assert found is not None
    other = KvShelf(tmp_path, "other-model")
    try:
        other.put("c", IDS, lambda: PAYLOAD)
        assert other.flush(30)
        found.path.write_bytes(other._path("c").read_bytes())
    finally:
        other.close(10)
    with caplog.at_level(logging.WARNING, logger="phasewise.snapshots"):
        assert shelf.load(found) is None
    assert not found.path.exists()
    assert f"KV snapshot {found.path.name} dropped: made for another model or build" in \
        caplog.messages


@pytest.mark.parametrize("head", [(MAGIC, FORMAT_VERSION + 1), (b"XXXX", FORMAT_VERSION)],
                         ids=["another version", "not a snapshot"])
def test_a_file_of_another_format_is_not_found_and_is_dropped(
        shelf: KvShelf, head: tuple[bytes, int], caplog: pytest.LogCaptureFixture) -> None:
    path = only_file(shelf)
    raw = path.read_bytes()
    _, _, size = _HEAD.unpack(raw[: _HEAD.size])
    path.write_bytes(_HEAD.pack(*head, size) + raw[_HEAD.size :])
    with caplog.at_level(logging.WARNING, logger="phasewise.snapshots"):
        assert shelf.find("c") is None
    assert not path.exists()
    assert f"KV snapshot {path.name} dropped: not a snapshot of this format" in caplog.text


def test_drop_removes_a_snapshot_and_a_second_drop_is_harmless(
        shelf: KvShelf, caplog: pytest.LogCaptureFixture) -> None:
    found = shelf.find("c")
    assert found is not None
    with caplog.at_level(logging.WARNING, logger="phasewise.snapshots"):
        shelf.drop(found, "restored into another model")
    assert not found.path.exists()
    assert f"KV snapshot {found.path.name} dropped: restored into another model" in \
        caplog.messages
    shelf.drop(found, "again")
    assert shelf.find("c") is None


def test_clearing_the_shelf_removes_every_model_snapshot_and_counts_the_bytes(
        shelf: KvShelf, tmp_path: Path) -> None:
    other = KvShelf(tmp_path, "other-model")
    try:
        other.put("d", [1], lambda: b"x" * 100)
        assert other.flush(30)
        sizes = sum(p.stat().st_size for p in tmp_path.glob("*/*.kv"))
        assert len(list(tmp_path.glob("*/*.kv"))) == 2
        assert clear_shelf(tmp_path) == sizes
        assert list(tmp_path.glob("*/*.kv")) == []
        assert clear_shelf(tmp_path) == 0
    finally:
        other.close(10)


def test_clearing_skips_snapshots_that_vanished_and_counts_the_rest(
        shelf: KvShelf, tmp_path: Path) -> None:
    """Another instance may remove snapshots while this one lists or clears the shelf: names
    that no longer resolve (dangling links, listed in among the real files) are passed over."""
    for chat in "defg":
        shelf.put(chat, IDS, lambda: PAYLOAD)
        (shelf.folder / f"{chat}-gone.kv").symlink_to(tmp_path / "nowhere")
    assert shelf.flush(30)
    real = [p for p in shelf.folder.glob("*.kv") if not p.is_symlink()]
    sizes = sum(p.stat().st_size for p in real)
    assert len(real) == 5
    assert clear_shelf(tmp_path) == sizes
    assert not any(p.exists() for p in real)


def test_the_shelf_key_is_stable_across_releases() -> None:
    """Snapshots are found by this key: if it changed for the same model, build and settings,
    every user's saved chats would read their prompts again after an upgrade."""
    assert shelf_key("model", "fp32", "kernel") == "fd459bf10bff656b87ff2b6d"
    assert shelf_key("ab", "c") != shelf_key("a", "bc")  # the parts stay apart


def test_a_chats_snapshot_file_name_is_stable_across_releases(shelf: KvShelf) -> None:
    """The file is found by the chat's id alone: the same name after an upgrade."""
    assert only_file(shelf).name == "2e7d2c03a9507ae265ecf5b5356885a5.kv"


def test_the_writer_is_a_named_daemon_thread_that_close_ends(tmp_path: Path) -> None:
    """A daemon, so a writer stuck on a slow disk never holds the app's exit; named, for a
    thread dump; ended by close once what was put is written."""
    before = set(threading.enumerate())
    shelf = KvShelf(tmp_path, "model")
    (writer,) = set(threading.enumerate()) - before
    assert writer.name == "phasewise-kv-shelf" and writer.daemon
    shelf.put("c", IDS, lambda: PAYLOAD)
    shelf.close(30)
    writer.join(30)
    assert not writer.is_alive()
    assert shelf.find("c") is not None


def test_close_waits_for_the_writer_no_longer_than_its_timeout(tmp_path: Path) -> None:
    """Quitting while a snapshot is still being serialised: close gives up after its timeout
    (the snapshot is left unwritten, the chat's next start reads its prompt again)."""
    release = threading.Event()
    shelf = KvShelf(tmp_path, "model")
    shelf.put("c", IDS, lambda: (release.wait(60), PAYLOAD)[1])
    closing = threading.Thread(target=shelf.close, args=(0.05,))
    closing.start()
    closing.join(30)
    try:
        assert not closing.is_alive()
        assert shelf.flush(0.05) is False  # still writing: flush says so after its timeout
        assert shelf.find("c") is None
    finally:
        release.set()
        closing.join(30)


# ----- the disk budget: least recently used first, never over a share of the free space -----
def put_all(shelf: KvShelf, chats: str) -> dict[str, Path]:
    """Write a snapshot for each chat (same-length names: same-size files), each one's last use
    a second after the one before; their paths."""
    paths = {}
    for chat in chats:
        shelf.put(chat, IDS, lambda: PAYLOAD)
        assert shelf.flush(30)
        paths[chat] = shelf._path(chat)
    for age, chat in enumerate(reversed(chats)):
        if paths[chat].exists():
            os.utime(paths[chat], (1_000_000 - age, 1_000_000 - age))
    return paths


@pytest.fixture
def sized(tmp_path: Path) -> Iterator[tuple[KvShelf, int]]:
    """A shelf with no budget to speak of, and the size of one of its snapshots on disk (the
    budget counts files whole; a snapshot asks for its size less the fixed head)."""
    shelf = KvShelf(tmp_path, "model", budget_bytes=1 << 40)
    size = put_all(shelf, "z")["z"].stat().st_size
    clear_shelf(tmp_path)
    yield shelf, size
    shelf.close(10)


def on_shelf(paths: dict[str, Path]) -> str:
    return "".join(chat for chat, path in paths.items() if path.exists())


def test_a_snapshot_that_just_fits_the_budget_is_written_and_evicts_nothing(
        sized: tuple[KvShelf, int]) -> None:
    shelf, size = sized
    shelf.budget_bytes = 2 * size - _HEAD.size  # one snapshot and one asking, exactly
    paths = put_all(shelf, "ab")
    assert on_shelf(paths) == "ab"
    paths |= put_all(shelf, "c")
    assert on_shelf(paths) == "bc"  # the least recently used went, and only it


def test_the_oldest_go_until_the_new_snapshot_fits(sized: tuple[KvShelf, int]) -> None:
    shelf, size = sized
    paths = put_all(shelf, "abc")
    shelf.budget_bytes = 2 * size - _HEAD.size
    paths |= put_all(shelf, "d")
    assert on_shelf(paths) == "cd"


def test_rewriting_a_chats_snapshot_does_not_count_its_old_file(
        sized: tuple[KvShelf, int]) -> None:
    shelf, size = sized
    shelf.budget_bytes = 2 * size - _HEAD.size
    paths = put_all(shelf, "ba")  # b used longer ago than a
    paths |= put_all(shelf, "a")  # a's new snapshot replaces its old one: b stays
    assert on_shelf(paths) == "ba"


def test_a_snapshot_over_the_budget_is_not_written_and_the_shelf_goes_on(
        sized: tuple[KvShelf, int], caplog: pytest.LogCaptureFixture) -> None:
    shelf, size = sized
    shelf.budget_bytes = size - _HEAD.size - 1
    with caplog.at_level(logging.WARNING, logger="phasewise.snapshots"):
        paths = put_all(shelf, "a")
    assert on_shelf(paths) == ""
    assert ("KV snapshot of a chat not written: no room for a 0 MB snapshot within the disk "
            "budget") in caplog.messages
    assert list(shelf.folder.iterdir()) == []  # no temporary file left
    shelf.budget_bytes = size
    assert on_shelf(put_all(shelf, "b")) == "b"  # the writer is still there


class Usage(NamedTuple):
    free: int


def test_the_shelf_holds_at_most_a_quarter_of_the_free_space(
        sized: tuple[KvShelf, int], monkeypatch: pytest.MonkeyPatch) -> None:
    shelf, size = sized
    paths = put_all(shelf, "ab")
    monkeypatch.setattr(snapshots.shutil, "disk_usage", lambda _path: Usage(7 * size))
    paths |= put_all(shelf, "c")  # a quarter of (7 free + 2 held) is 2.25 snapshots
    assert on_shelf(paths) == "bc"


def test_with_the_free_space_unknown_no_snapshot_is_written(
        sized: tuple[KvShelf, int], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    shelf, _size = sized
    paths = put_all(shelf, "ab")

    def unknown(_path: object) -> Usage:
        raise OSError("no such device")

    monkeypatch.setattr(snapshots.shutil, "disk_usage", unknown)
    with caplog.at_level(logging.WARNING, logger="phasewise.snapshots"):
        paths |= put_all(shelf, "c")
    assert on_shelf(paths) == ""
    assert any("no room for a" in m for m in caplog.messages)
