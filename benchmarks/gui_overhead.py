"""What does the window cost decode, with 1, 2 or 4 chats streaming at once?

On a shared 2-core machine, decode speed drifts by 10-20% within seconds, so comparing a GUI
reply with a headless one (gui_latency.py) needs many rounds to see a 5% effect. This design
cancels the drift instead: while the replies stream the window alternates, every --phase
seconds on the engine's clock, between

  shown:  the window gets every event: the chats stream, the HUD redraws (the real app), and
  idle:   token and sampler events are held back from the window (it gets only the requests'
          starts and ends), so the GUI thread has nothing to do: the engine runs as if headless.

With N streams the window holds N chats, built as a user would: a reply is started in each
chat in turn, then the first chat is opened again, so one chat is on screen and the other N-1
stream in the background (their dots in the sidebar). The window is the app's own
(app.gui.build_window over app.gui.build_backend, as `phasewise` builds it).

Tokens of both kinds are interleaved in time, so drift weighs on both alike. Each stream's
decode speed of each kind is 1 / mean inter-token gap over its tokens (the first tokens after a
switch are left out: GUI work started in a shown phase can spill a little into the next), over
the stretch where all N streams decode; the aggregate is their sum. Replies are greedy (unless
--temperature), --max-tokens long, on the bundled model. --profile FILE writes a cProfile of
the GUI thread (shown and idle phases together) and prints what it did per shown token. Prints
numbers, asserts nothing.

    QT_QPA_PLATFORM=offscreen .venv/bin/python benchmarks/gui_overhead.py --streams 1 2 4 \
        --engine llama.cpp [--replies 4]
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PySide6.QtCore import QSettings, QTimer
from PySide6.QtWidgets import QApplication

from app.gui import build_backend, build_window
from engine import EngineEvent, SamplerSnapshot, TokenEmitted
from engine.backends import BackendRouter
from engine.worker import Engine
from ui.theme import apply_theme

PROMPTS = (
    "Write a long, detailed story about a dragon who learns to bake bread.",
    "Write a long, detailed story about a lighthouse keeper who finds a map.",
    "Write a long, detailed story about a robot who learns to paint.",
    "Write a long, detailed story about a sailor who crosses a frozen sea.",
)
SETTLE_TOKENS = 3  # tokens of a stream after each switch left out of both sides

Stamp = tuple[int, bool]  # (t_ns, shown)


class PhaseGate:
    """Sits between the backend and the window's bridge, on the engine thread: records every
    token's engine stamp per request and, in idle phases, holds token and sampler events back.
    One phase clock for every stream, started by the first token of any."""

    def __init__(self, forward, phase_s: float) -> None:
        self._forward = forward
        self._phase_ns = int(phase_s * 1e9)
        self._start_ns: int | None = None
        self.stamps: dict[str, list[Stamp]] = {}
        self._lock = threading.Lock()

    def shown_at(self, t_ns: int) -> bool:
        return ((t_ns - (self._start_ns or t_ns)) // self._phase_ns) % 2 == 0

    def __call__(self, event: EngineEvent) -> None:
        if isinstance(event, TokenEmitted | SamplerSnapshot):
            if self._start_ns is None:
                self._start_ns = event.t_ns
            shown = self.shown_at(event.t_ns)
            if isinstance(event, TokenEmitted):
                with self._lock:
                    self.stamps.setdefault(event.request_id, []).append((event.t_ns, shown))
            if not shown:
                return
        self._forward(event)

    def take_stamps(self) -> dict[str, list[Stamp]]:
        with self._lock:
            stamps, self.stamps, self._start_ns = self.stamps, {}, None
        return stamps


def gaps_by_phase(stamps: list[Stamp]) -> dict[bool, list[float]]:
    """Inter-token gaps (s) of each phase kind, leaving out SETTLE_TOKENS after a switch."""
    gaps: dict[bool, list[float]] = {True: [], False: []}
    since_switch = 0
    for (t0, shown0), (t1, shown1) in itertools.pairwise(stamps):
        since_switch = since_switch + 1 if shown1 == shown0 else 0
        if since_switch >= SETTLE_TOKENS:
            gaps[shown1].append((t1 - t0) / 1e9)
    return gaps


def aggregate_rates(stamps: dict[str, list[Stamp]]) -> tuple[float, float, int] | None:
    """(shown, idle) aggregate decode tok/s over the stretch where every stream decodes, and
    the fewest gaps either side had in one stream; None if a side has none."""
    if not stamps:
        return None
    lo = max(s[0][0] for s in stamps.values())
    hi = min(s[-1][0] for s in stamps.values())
    shown = idle = 0.0
    fewest = sys.maxsize
    for stream in stamps.values():
        gaps = gaps_by_phase([s for s in stream if lo <= s[0] <= hi])
        if not (gaps[True] and gaps[False]):
            return None
        shown += 1 / statistics.fmean(gaps[True])
        idle += 1 / statistics.fmean(gaps[False])
        fewest = min(fewest, len(gaps[True]), len(gaps[False]))
    return shown, idle, fewest


def shown_window_round(app: QApplication, backend: BackendRouter, streams: int,
                       max_tokens: int, temperature: float, phase_s: float,
                       profiler: cProfile.Profile | None) -> dict[str, list[Stamp]]:
    """One round: N chats in a fresh window, each streaming one reply, the first on screen;
    the window's bridge sits behind a PhaseGate."""
    with tempfile.TemporaryDirectory() as scratch:
        from ui.store import ChatStore

        store = ChatStore(Path(scratch) / "chats.sqlite3")
        settings = QSettings(str(Path(scratch) / "s.ini"), QSettings.Format.IniFormat)
        window = build_window(backend, store, settings, hud_calibrate=False)
        window.resize(1400, 900)
        window.show()
        window.controls.temperature.setValue(round(temperature * 100))
        window.controls.max_tokens.setValue(max_tokens)
        forward = window.bridge._on_engine_event
        backend.remove_listener(forward)
        gate = PhaseGate(forward, phase_s)
        backend.add_listener(gate)
        finished = []

        def on_finished(_result: object) -> None:
            finished.append(_result)
            if len(finished) == streams:
                QTimer.singleShot(300, app.quit)

        def start() -> None:
            chats = []
            for i in range(streams):
                window.new_chat()
                window.send(PROMPTS[i % len(PROMPTS)])
                chats.append(window.conversation_id)
            if streams > 1:
                window.sidebar.refresh(select=chats[0])
                window.open_conversation(chats[0])  # the user goes back to the first chat

        window.sig_reply_finished.connect(on_finished)
        QTimer.singleShot(500, start)  # once the window has painted
        if profiler is not None:
            profiler.enable()
        cpu_s, wall_s = time.thread_time(), time.monotonic()
        app.exec()
        cpu_s, wall_s = time.thread_time() - cpu_s, time.monotonic() - wall_s
        if profiler is not None:
            profiler.disable()
        backend.remove_listener(gate)
        window.close()
        store.close()
    return gate.take_stamps(), cpu_s, wall_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--engine", default="auto", choices=("auto", "llama.cpp", "torch"))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--replies", type=int, default=3, help="rounds for each stream count")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--phase", type=float, default=1.0, help="seconds per phase")
    parser.add_argument("--profile", help="write a cProfile of the GUI thread here")
    args = parser.parse_args()
    app = QApplication([])
    apply_theme(app)
    backend = build_backend(Engine()).start()
    profiler = cProfile.Profile() if args.profile else None
    results: dict[int, list[tuple[float, float]]] = {n: [] for n in args.streams}
    gui_cpu: dict[int, list[float]] = {n: [] for n in args.streams}  # ms a shown token
    shown_tokens = 0
    try:
        info = backend.load_model_sync(args.model, engine=args.engine)
        for r in range(args.replies):  # stream counts interleaved: drift weighs on each alike
            for n in args.streams:
                stamps, cpu_s, wall_s = shown_window_round(
                    app, backend, n, args.max_tokens, args.temperature, args.phase, profiler)
                shown_now = sum(s for stream in stamps.values() for _, s in stream)
                shown_tokens += shown_now
                gui_cpu[n].append(cpu_s * 1000 / max(shown_now, 1))
                rates = aggregate_rates(stamps)
                if len(stamps) < n or rates is None:
                    print(f"round {r + 1}, {n} streams: too short for both phases in every "
                          f"stream (a reply ended early?); make --phase shorter")
                    continue
                shown, idle, fewest = rates
                results[n].append((shown, idle))
                print(f"round {r + 1}, {n} stream{'s' if n > 1 else ''}: shown {shown:.1f} "
                      f"tok/s, idle {idle:.1f} tok/s (aggregate; >= {fewest} gaps a side "
                      f"a stream): shown/idle = {shown / idle:.3f}; GUI thread "
                      f"{cpu_s * 1000 / max(shown_now, 1):.2f} ms CPU a shown token, "
                      f"{100 * cpu_s / wall_s:.0f}% of a core", flush=True)
    finally:
        backend.shutdown()
    print(f"model {info.name} on {info.device} ({info.engine}, {info.dtype}, {info.kernel}); "
          f"{args.phase:g} s phases, {args.max_tokens} tokens a reply, temperature "
          f"{args.temperature:g}; load average {os.getloadavg()[0]:.2f}")
    print("streams | shown tok/s | idle tok/s | shown/idle median (min-max) | GUI CPU ms a "
          "shown token | rounds")
    for n, rows in results.items():
        if not rows:
            continue
        ratios = [s / i for s, i in rows]
        print(f"{n} | {statistics.median(s for s, _ in rows):.1f} | "
              f"{statistics.median(i for _, i in rows):.1f} | {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}) | {statistics.median(gui_cpu[n]):.2f} | "
              f"{len(rows)}")
    if profiler is not None:
        profiler.dump_stats(args.profile)
        stats = pstats.Stats(profiler)
        print(f"GUI thread profile ({shown_tokens} shown tokens), calls per shown token:")
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:40]  # cumulative time
        for (path, line, name), (_cc, ncalls, _tt, cum, _callers) in rows:
            print(f"  {ncalls / max(shown_tokens, 1):8.3f}  {cum:7.2f} s  "
                  f"{Path(path).name}:{line}:{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
