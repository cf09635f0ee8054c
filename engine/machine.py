"""What this machine is, for the caches of run-time choices, and those caches' JSON files.

A choice measured or smoke-tested on one CPU (torch's decode kernel, llama.cpp's CPU backend
variant, its attention) is cached under a key that names the CPU, so a home directory moved
to another machine measures again. No torch, no llama.cpp: both runtimes use this.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_fingerprint() -> str:
    """The CPU's name and instruction-set flags, hashed: two machines of the same model name
    whose (virtual) CPUs advertise different flags (AMX on one VM, not on another) differ."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    except OSError:
        pass
    text = "|".join((cpu_name(), platform.machine(), flags))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_json(path: Path) -> dict[str, Any]:
    """A JSON cache file's object; {} when absent or unreadable."""
    try:
        data = json.loads(path.read_text("utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json_entry(path: Path, key: str, value: Any, max_entries: int) -> None:
    """Set one entry of a JSON cache file (newest last, at most max_entries), atomically (a
    temporary file of this thread's own, renamed); best effort: an unwritable cache dir only
    means measuring again next time."""
    data = read_json(path)
    data.pop(key, None)
    data[key] = value
    while len(data) > max_entries:
        data.pop(next(iter(data)))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(data, indent=1), "utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        log.info("cannot write %s: %s", path, exc)
