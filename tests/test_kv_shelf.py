"""The KV shelf's files (engine/core/snapshots.py) at the byte level: what a damaged or foreign
snapshot does on load, what clearing the shelf frees, and that its names stay stable across
releases. The engine-level resume tests are in tests/test_kv_snapshots.py."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

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
        assert shelf.find("c") is None
    finally:
        release.set()
        closing.join(30)
