"""A fingerprint of the source tree that a bundle was built from.

`make package` writes it into the bundle (source-stamp.json); the packaging tests compute it
again from the tree they run in and refuse a bundle built from other sources: a stale .deb in
dist/ would otherwise pass tests of code that is no longer there.

    python packaging/source_stamp.py OUT.json
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What ends up in the bundle: the code, its assets, its packaging and its dependencies' pins.
SOURCES = ("app", "engine", "ui", "assets", "packaging", "pyproject.toml")
STAMP_NAME = "source-stamp.json"


def source_files(root: Path = ROOT) -> list[Path]:
    files: list[Path] = []
    for name in SOURCES:
        path = root / name
        found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        files += [p for p in found if "__pycache__" not in p.parts and p.suffix != ".pyc"]
    return files


def source_digest(root: Path = ROOT) -> str:
    """sha256 over each source file's path (relative to root) and bytes, in a fixed order."""
    digest = hashlib.sha256()
    for path in source_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def main(out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"sources_sha256": source_digest()}) + "\n", "utf-8")


if __name__ == "__main__":
    main(sys.argv[1])
