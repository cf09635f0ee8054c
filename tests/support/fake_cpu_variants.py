"""A stand-in for engine/llamacpp/cpu_backend.py's smoke child: fixed ggml scores, and a
variant that "crashes" (SIGILL, as AMX does on a VM that advertises it) or fails its smoke run
as the plan says. Module level: the child process imports it by name."""

from __future__ import annotations

import os
import signal
from multiprocessing.connection import Connection

# ggml's scores on a Zen 5 for these variants (sapphirerapids: as a CPU advertising AMX sees it)
SCORES = {"sapphirerapids": 4032, "zen4": 1984, "icelake": 1472, "alderlake": 0,
          "haswell": 64, "x64": 1}


def plan(crash: tuple[str, ...] = (), fail: tuple[str, ...] = (),
         unreadable: bool = False) -> str:
    """What the child does, passed where the real child takes the smoke model's path;
    unreadable: the smoke model does not load (nothing runs on the variant)."""
    return f"crash={','.join(crash)};fail={','.join(fail)};unreadable={int(unreadable)}"


def fake_probe_child(conn: Connection, files: dict[str, str], skipped: dict[str, str],
                     smoke_model: str) -> None:
    crash, fail, unreadable = (part.split("=", 1)[1].split(",")
                               for part in smoke_model.split(";"))
    scores = {name: SCORES[name] for name in files}
    conn.send(("scores", scores))
    order = [n for n in sorted(scores, key=lambda n: -scores[n])
             if scores[n] > 0 and n not in skipped]
    conn.send(("trying", order[0] if order else None))
    if not order:
        return
    if order[0] in crash:
        os.kill(os.getpid(), signal.SIGILL)
    if order[0] in fail:
        raise RuntimeError("llama_decode failed")
    conn.send(("ok", "llama.cpp could not load broken.gguf" if unreadable == ["1"] else None))
