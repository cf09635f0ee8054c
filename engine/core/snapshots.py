"""KV snapshots on disk: a chat's cached prefix survives a restart or an eviction.

When a reply ends, the ledger hands its chat's KV to the shelf; a writer thread turns it into
bytes (torch: the cache's tensors; llama.cpp: the state API's copy, taken on the engine thread)
and writes one file per chat: written to a temporary name and renamed, so a reader (this app,
or another instance) sees the old file or the new one, never half of one. A chat's next turn
that finds nothing in memory reads the file back instead of reading the prompt again.

A file holds a header (magic, format version, the shelf key, the token ids it covers) and the
runtime's bytes, and a CRC-32 of both. The shelf key names the model's content fingerprint, the
runtime and its build, and the dtype/kernel: a snapshot from another model or build is never
looked at (it lives under another key). A file that fails any check is dropped with one log
line and the turn runs cold. The shelf keeps to a byte budget, never more than a share of the
disk's free space, evicting the least recently used files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import threading
import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from engine.errors import one_line

log = logging.getLogger("phasewise.snapshots")

MAGIC = b"PWKV"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<4sII")  # magic, format version, header length
SUFFIX = ".kv"
DEFAULT_BUDGET_BYTES = 4 << 30
FREE_SPACE_SHARE = 0.25  # never hold more than this share of the disk's free space
WRITE_CHUNK = 8 << 20  # the writer looks whether the engine got busy after each of these


@dataclass(frozen=True)
class Restored:
    """A lease's prefix that came from disk: what the HUD and the ledger report."""

    tokens: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class Shelved:
    """A snapshot found on disk: the ids it covers, and its file."""

    ids: list[int]
    path: Path


Payload = Callable[[], "bytes | bytearray"]  # on the writer thread: the runtime's KV bytes


def shelf_usage(root: Path) -> tuple[int, int]:
    """(snapshots, bytes) kept under a snapshot root, every model's."""
    sizes = [size for _, size, _ in _snapshot_files(root)]
    return len(sizes), sum(sizes)


def clear_shelf(root: Path) -> int:
    """Remove every snapshot under root; the bytes freed. A chat's next turn reads its prompt
    again (and writes a new snapshot)."""
    freed = 0
    for path, size, _ in _snapshot_files(root):
        path.unlink(missing_ok=True)
        freed += size
    return freed


def _snapshot_files(root: Path) -> list[tuple[Path, int, float]]:
    """Every snapshot of every model under the root: (path, bytes, last used)."""
    found = []
    for path in root.glob(f"*/*{SUFFIX}"):
        try:
            stat = path.stat()
        except OSError:
            continue
        found.append((path, stat.st_size, stat.st_mtime))
    return found


def shelf_key(*parts: str) -> str:
    """A short, stable name for what a snapshot must match to be restored."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


class KvShelf:
    def __init__(self, root: Path, key: str, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.root = root
        self.key = key
        self.folder = root / key
        self.budget_bytes = budget_bytes
        self._pending: dict[str, tuple[list[int], Payload]] = {}
        self._lock = threading.Lock()
        self._wake: queue.Queue[bool] = queue.Queue()
        self._idle = threading.Event()
        # Set while the engine has nothing to run: the writer works only then, a chunk at a
        # time (on two cores, a write beside a streaming reply slowed its steps ~x5 at p99).
        self.engine_idle = threading.Event()
        self.engine_idle.set()
        self._idle.set()
        self._writer = threading.Thread(target=self._write_loop, name="phasewise-kv-shelf",
                                        daemon=True)
        self._writer.start()

    # ----- the engine thread -----------------------------------------------------------
    def put(self, conversation_id: str, ids: list[int], payload: Payload) -> None:
        """Write this chat's KV (the newest put of a chat replaces one not yet written)."""
        with self._lock:
            self._pending[conversation_id] = (list(ids), payload)
            self._idle.clear()
        self._wake.put(True)

    def find(self, conversation_id: str) -> Shelved | None:
        """The chat's snapshot, if a readable one is on disk (its header only)."""
        path = self._path(conversation_id)
        try:
            with path.open("rb") as f:
                ids, _ = self._read_header(f, conversation_id)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self._drop(path, exc)
            return None
        return Shelved(ids, path)

    def load(self, shelved: Shelved) -> bytes | None:
        """The runtime's bytes of a snapshot, checked; None (and the file dropped) if bad."""
        try:
            with shelved.path.open("rb") as f:
                ids, meta = self._read_header(f, None)
                data = f.read()
        except (OSError, ValueError) as exc:
            self._drop(shelved.path, exc)
            return None
        crc = zlib.crc32(data, zlib.crc32(array("i", ids).tobytes()))
        if len(data) != meta["payload_bytes"] or crc != meta["crc32"]:
            self._drop(shelved.path, ValueError("checksum mismatch"))
            return None
        os.utime(shelved.path)  # recently used: evicted last
        return data

    def drop(self, shelved: Shelved, why: str) -> None:
        self._drop(shelved.path, ValueError(why))

    # ----- any thread ------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot put so far is written; False on timeout."""
        return self._idle.wait(timeout)

    def close(self, timeout: float) -> None:
        """Write what was put (for at most `timeout` seconds), then stop the writer."""
        self.engine_idle.set()  # nothing runs any more
        self.flush(timeout)
        self._wake.put(False)

    # ----- inside ----------------------------------------------------------------------
    def _path(self, conversation_id: str) -> Path:
        name = hashlib.sha256(conversation_id.encode()).hexdigest()[:32]
        return self.folder / f"{name}{SUFFIX}"

    def _read_header(self, f: BinaryIO,
                     conversation_id: str | None) -> tuple[list[int], dict[str, Any]]:
        read = f.read
        magic, version, size = _HEAD.unpack(read(_HEAD.size))
        if magic != MAGIC or version != FORMAT_VERSION:
            raise ValueError(f"not a snapshot of this format ({magic!r}, v{version})")
        meta = json.loads(read(size))
        if meta["key"] != self.key:
            raise ValueError("made for another model or build")
        if conversation_id is not None and meta["conversation"] != conversation_id:
            raise ValueError("made for another chat")
        raw = read(4 * meta["tokens"])
        if len(raw) != 4 * meta["tokens"]:
            raise ValueError("truncated")
        return array("i", raw).tolist(), meta

    def _drop(self, path: Path, why: Exception) -> None:
        log.warning("KV snapshot %s dropped: %s", path.name, why)
        path.unlink(missing_ok=True)

    def _write_loop(self) -> None:
        while self._wake.get():
            while True:
                with self._lock:
                    if not self._pending:
                        self._idle.set()
                        break
                    conv = next(iter(self._pending))
                    ids, payload = self._pending.pop(conv)
                self._write(conv, ids, payload)

    def _write(self, conversation_id: str, ids: list[int], payload: Payload) -> None:
        path = self._path(conversation_id)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self.engine_idle.wait()
            data = memoryview(payload())
            token_bytes = array("i", ids).tobytes()
            crc = zlib.crc32(token_bytes)
            for start in range(0, len(data), WRITE_CHUNK):
                self.engine_idle.wait()
                crc = zlib.crc32(data[start : start + WRITE_CHUNK], crc)
            meta = {"key": self.key, "conversation": conversation_id, "tokens": len(ids),
                    "payload_bytes": len(data), "crc32": crc}
            header = json.dumps(meta).encode()
            self._make_room(len(header) + len(token_bytes) + len(data), keep=path)
            self.folder.mkdir(parents=True, exist_ok=True)
            with tmp.open("wb") as f:
                f.write(_HEAD.pack(MAGIC, FORMAT_VERSION, len(header)))
                f.write(header)
                f.write(token_bytes)
                for start in range(0, len(data), WRITE_CHUNK):
                    self.engine_idle.wait()
                    f.write(data[start : start + WRITE_CHUNK])
                f.flush()
                self.engine_idle.wait()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except Exception as exc:  # a full disk, a runtime that cannot copy: the chat runs cold
            log.warning("KV snapshot of a chat not written: %s", one_line(exc))
            tmp.unlink(missing_ok=True)

    def _make_room(self, nbytes: int, keep: Path) -> None:
        """Evict least recently used snapshots until `nbytes` more fit the budget, which is
        never more than a share of the free space; OSError if they cannot."""
        existing = next(p for p in (self.root, *self.root.parents) if p.exists())
        try:
            free = shutil.disk_usage(existing).free
        except OSError:
            free = 0
        files = sorted((f for f in _snapshot_files(self.root) if f[0] != keep), key=lambda f: f[2])
        used = sum(size for _, size, _ in files)
        limit = min(self.budget_bytes, int((free + used) * FREE_SPACE_SHARE))
        while files and used + nbytes > limit:
            path, size, _ = files.pop(0)
            path.unlink(missing_ok=True)
            used -= size
        if used + nbytes > limit:
            raise OSError(f"no room for a {nbytes / 1e6:.0f} MB snapshot within the disk budget")
