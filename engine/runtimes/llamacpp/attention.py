"""Flash attention on or off for a llama.cpp model, chosen by a short timing at first load.

Which is faster depends on the model and the CPU, and on what else the KV memory holds. The
context's KV memory is one pool of cells shared by every sequence (the running rows and the
prefix cache's chats: prefix_pool.py). Without flash attention a decode step attends over
every used cell, masked, so other chats' cells cost every step; flash attention skips masked
cells, but on a short context it can cost more (facts: ~15% on SmolLM2 here).
llama.cpp's non-unified KV (a stream per sequence) would keep other chats out of a step
without flash attention, but it splits the context into n_seq_max equal streams (a chat could
use 1/32 of it) and turns the prefix cache's `seq_cp` into a copy of a whole stream: not used.

So the probe times decode steps in both settings, alternating step by step so machine noise
hits both alike, in the three states the engine meets:

- alone: one chat of PROBE_OWN_TOKENS, nothing else in the KV memory (`bench`, a first chat);
- beside: the same chat while other chats' cells fill PROBE_FOREIGN_CELLS (a prefix cache
  holding a few earlier chats, as the app and `serve` do after a while);
- batched: PROBE_ROWS chats decoding in one step (continuous batching).

and chooses the setting whose worst state is the least slower than the other setting's (the
smaller worst-case regret; a tie keeps flash attention, whose cost does not grow with other
chats). The other chats' cells are copies of the first chat's (`llama_state_seq_set_data`), so
the probe prefills only one short prompt per setting. Cached per model, CPU, CPU backend
variant (its library as built: a rebuilt kernel measures again), threads and llama-cpp-python
version (`llama-attention.json` in the cache root); a change of any re-measures.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.machine import cpu_fingerprint, read_json, write_json_entry
from engine.model_files import cache_root
from engine.runtimes.llamacpp.cpu_backend import CpuBackend, library_stamp

log = logging.getLogger(__name__)

CACHE_FILE = "llama-attention.json"
CACHE_MAX_ENTRIES = 64
PROBE_OWN_TOKENS = 128
PROBE_FOREIGN_CELLS = 2048  # at most a quarter of the context
PROBE_ROWS = 4
PROBE_WARM_STEPS = 2
PROBE_TIMED_STEPS = 6
STATES = ("alone", "beside", "batched")
SETTINGS = {"off": False, "on": True}

MakeContext = Callable[[bool, int, int], Any]  # (flash attention, n_ctx, n_seq) -> ctx | None


def cache_key(path: Path, backend: CpuBackend, threads: int, version: str, n_ctx: int) -> str:
    """Identifies (model file, CPU, CPU backend variant and its library, threads,
    llama-cpp-python, the probe's foreign cells): a new one measures again."""
    stat = path.stat()
    parts = [str(path.resolve()), str(stat.st_size), str(stat.st_mtime_ns), cpu_fingerprint(),
             backend.variant, library_stamp(Path(backend.path)) if backend.path else "",
             str(threads), version, str(foreign_cells(n_ctx))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def cache_path() -> Path:
    return cache_root() / CACHE_FILE


def cached_choice(key: str) -> bool | None:
    entry = read_json(cache_path()).get(key)
    choice = entry.get("choice") if isinstance(entry, dict) else None
    return SETTINGS.get(choice) if isinstance(choice, str) else None


def foreign_cells(n_ctx: int) -> int:
    return max(PROBE_OWN_TOKENS, min(PROBE_FOREIGN_CELLS, n_ctx // 4))


def choose(step_s: dict[str, dict[str, float]]) -> str:
    """The setting ("off"/"on") with the smaller worst-case ratio to the other's step time
    over the states both measured; "on" on a tie."""
    regret = {}
    for setting in SETTINGS:
        ratios = [step_s[setting][state] / min(step_s[s][state] for s in SETTINGS)
                  for state in STATES if all(state in step_s[s] for s in SETTINGS)]
        regret[setting] = max(ratios, default=1.0)
    return "off" if regret["off"] < regret["on"] else "on"


def measure(lib: Any, model: Any, make_context: MakeContext, n_ctx: int) -> dict[str, Any]:
    """Time decode steps with flash attention off and on (module doc): the report, with
    `choice`. RuntimeError when a probe context cannot run (then the caller keeps llama.cpp's
    own choice)."""
    # other chats: copies of the first one, at least one per batched row besides it
    copies = max(-(-foreign_cells(n_ctx) // PROBE_OWN_TOKENS), PROBE_ROWS - 1)
    probe_ctx = PROBE_OWN_TOKENS * (copies + 1) + 256
    n_seq = copies + 1
    contexts: dict[str, Any] = {}
    batch = lib.llama_batch_init(max(PROBE_OWN_TOKENS, PROBE_ROWS), 0, 1)
    try:
        for name, flash in SETTINGS.items():
            ctx = make_context(flash, probe_ctx, n_seq)
            if ctx is None:
                if name == "on":
                    log.info("flash attention is not available for this model: off")
                    return {"choice": "off", "reason": "flash attention unavailable"}
                raise RuntimeError("llama.cpp could not make a probe context")
            contexts[name] = ctx
        n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        prompt = [(11 + 7 * i) % n_vocab for i in range(PROBE_OWN_TOKENS)]
        probes = {name: _Probe(lib, ctx, batch) for name, ctx in contexts.items()}
        for probe in probes.values():
            probe.decode([(t, i, 0) for i, t in enumerate(prompt)])
        step_s: dict[str, dict[str, float]] = {name: {} for name in SETTINGS}
        _time_steps(probes, step_s, "alone", [0])
        for probe in probes.values():
            probe.copy_sequence(0, range(1, copies + 1))
        _time_steps(probes, step_s, "beside", [0])
        _time_steps(probes, step_s, "batched", list(range(PROBE_ROWS)))
    finally:
        for ctx in contexts.values():
            lib.llama_free(ctx)
        lib.llama_batch_free(batch)
    choice = choose(step_s)
    return {"choice": choice, "step_ms": {n: {s: t * 1e3 for s, t in v.items()}
                                          for n, v in step_s.items()},
            "own_tokens": PROBE_OWN_TOKENS, "foreign_cells": copies * PROBE_OWN_TOKENS,
            "rows": PROBE_ROWS, "measured_at": time.time()}


def _time_steps(probes: dict[str, _Probe], step_s: dict[str, dict[str, float]], state: str,
                seqs: list[int]) -> None:
    """The fastest of PROBE_TIMED_STEPS decode steps of one token per sequence in seqs, per
    setting, alternating settings step by step; each step's cells are removed after it, so
    every step sees the same memory."""
    times: dict[str, list[float]] = {name: [] for name in probes}
    for step in range(PROBE_WARM_STEPS + PROBE_TIMED_STEPS):
        for name, probe in probes.items():
            elapsed = probe.step(seqs)
            if step >= PROBE_WARM_STEPS:
                times[name].append(elapsed)
    for name, values in times.items():
        step_s[name][state] = min(values)


class _Probe:
    """One probe context: decode rows, copy a sequence's cells, time a step."""

    def __init__(self, lib: Any, ctx: Any, batch: Any) -> None:
        self.lib, self.ctx, self.batch = lib, ctx, batch
        self.memory = lib.llama_get_memory(ctx)

    def decode(self, rows: list[tuple[int, int, int]], every_row: bool = False) -> None:
        """rows: (token, position, sequence); logits for the last row, or every_row's."""
        batch = self.batch
        for i, (token, pos, seq) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = every_row or i == len(rows) - 1
        batch.n_tokens = len(rows)
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed in the attention probe")

    def step(self, seqs: list[int]) -> float:
        lib = self.lib
        rows = [(1 + seq, PROBE_OWN_TOKENS, seq) for seq in seqs]
        start = time.perf_counter()
        self.decode(rows, every_row=True)  # each row samples, as in a batched step
        lib.llama_get_logits_ith(self.ctx, -1)
        elapsed = time.perf_counter() - start
        for seq in seqs:
            lib.llama_memory_seq_rm(self.memory, seq, PROBE_OWN_TOKENS, -1)
        return elapsed

    def copy_sequence(self, source: int, targets: range) -> None:
        """Other chats' cells: copies of source's state in cells of their own (not shared)."""
        lib = self.lib
        size = lib.llama_state_seq_get_size(self.ctx, source)
        data = (ctypes.c_uint8 * size)()
        if lib.llama_state_seq_get_data(self.ctx, data, size, source) == 0:
            raise RuntimeError("llama_state_seq_get_data failed in the attention probe")
        for target in targets:
            if lib.llama_state_seq_set_data(self.ctx, data, size, target) == 0:
                raise RuntimeError("llama.cpp could not place the probe's other chats")


def choose_flash_attention(lib: Any, model: Any, path: Path, make_context: MakeContext,
                           n_ctx: int, threads: int, backend: CpuBackend,
                           progress: Callable[[str], None] | None = None) -> bool | None:
    """Flash attention on (True) or off (False) for this model here, from the cache or a probe;
    None when the probe cannot run (the caller lets llama.cpp decide: "auto")."""
    version = str(getattr(lib, "__version__", "?"))
    try:
        key = cache_key(path, backend, threads, version, n_ctx)
    except OSError:
        return None
    cached = cached_choice(key)
    if cached is not None:
        return cached
    if progress:
        progress("timing attention with and without flash attention (once per model and CPU)")
    try:
        report = measure(lib, model, make_context, n_ctx)
    except RuntimeError as exc:
        log.warning("attention probe failed (%s); llama.cpp chooses", exc)
        return None
    log.info("attention probe: %s", report)
    write_json_entry(cache_path(), key, report, CACHE_MAX_ENTRIES)
    return SETTINGS[report["choice"]]
