"""What does the window (HUD visible) cost decode, measured inside one reply?

On a shared 2-core machine, decode speed drifts by 10-20% within seconds, so comparing a GUI
reply with a headless one (gui_latency.py) needs many rounds to see a 5% effect. This design
cancels the drift instead: during each reply the window alternates, every --phase seconds on
the engine's clock, between

  shown:  the window gets every event: the chat streams, the HUD redraws (the real app), and
  idle:   token and sampler events are held back from the window (it gets only the request's
          start and end), so the GUI thread has nothing to do: the engine runs as if headless.

Tokens of both kinds are interleaved in time, so drift weighs on both alike. Decode speed of
each kind is 1 / mean inter-token gap over its tokens (the first tokens after a switch are left
out: GUI work started in a shown phase can spill a little into the next). Replies are greedy,
--max-tokens long, on the bundled model. Prints numbers, asserts nothing.

    QT_QPA_PLATFORM=offscreen .venv/bin/python benchmarks/gui_overhead.py [--replies 4]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PySide6.QtCore import QSettings, QTimer
from PySide6.QtWidgets import QApplication

from engine import Engine, EngineEvent, SamplerSnapshot, TokenEmitted
from ui.main_window import MainWindow
from ui.store import ChatStore
from ui.theme import apply_theme

PROMPT = "Write a long, detailed story about a dragon who learns to bake bread."
SETTLE_TOKENS = 3  # tokens after each switch left out of both sides


class PhaseGate:
    """Sits between the engine and the window's bridge, on the engine thread: records every
    token's engine stamp and, in idle phases, holds token and sampler events back."""

    def __init__(self, forward, phase_s: float) -> None:
        self._forward = forward
        self._phase_ns = int(phase_s * 1e9)
        self._start_ns: int | None = None
        self.stamps: list[tuple[int, bool]] = []  # (t_ns, shown)
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
                    self.stamps.append((event.t_ns, shown))
            if not shown:
                return
        self._forward(event)

    def take_stamps(self) -> list[tuple[int, bool]]:
        with self._lock:
            stamps, self.stamps, self._start_ns = self.stamps, [], None
        return stamps


def gaps_by_phase(stamps: list[tuple[int, bool]]) -> dict[bool, list[float]]:
    """Inter-token gaps (s) of each phase kind, leaving out SETTLE_TOKENS after a switch."""
    gaps: dict[bool, list[float]] = {True: [], False: []}
    since_switch = 0
    for (t0, shown0), (t1, shown1) in itertools.pairwise(stamps):
        since_switch = since_switch + 1 if shown1 == shown0 else 0
        if since_switch >= SETTLE_TOKENS:
            gaps[shown1].append((t1 - t0) / 1e9)
    return gaps


def shown_window_reply(app: QApplication, engine: Engine, max_tokens: int,
                       phase_s: float) -> list[tuple[int, bool]]:
    """One reply through a fresh window whose bridge sits behind a PhaseGate."""
    with tempfile.TemporaryDirectory() as scratch:
        store = ChatStore(Path(scratch) / "chats.sqlite3")
        settings = QSettings(str(Path(scratch) / "s.ini"), QSettings.Format.IniFormat)
        window = MainWindow(engine, store, settings, hud_calibrate=False)
        window.show()
        window.controls.temperature.setValue(0)
        window.controls.max_tokens.setValue(max_tokens)
        forward = window.bridge._on_engine_event
        engine.remove_listener(forward)
        gate = PhaseGate(forward, phase_s)
        engine.add_listener(gate)
        window.sig_reply_finished.connect(lambda _r: QTimer.singleShot(300, app.quit))
        QTimer.singleShot(500, lambda: window.send(PROMPT))  # once the window has painted
        app.exec()
        engine.remove_listener(gate)
        window.close()
        store.close()
    return gate.take_stamps()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--replies", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--phase", type=float, default=1.0, help="seconds per phase")
    args = parser.parse_args()
    app = QApplication([])
    apply_theme(app)
    engine = Engine().start()
    results = []
    try:
        info = engine.load_model_sync(args.model)
        for n in range(args.replies):
            stamps = shown_window_reply(app, engine, args.max_tokens, args.phase)
            gaps = gaps_by_phase(stamps)
            if not (gaps[True] and gaps[False]):
                print(f"reply {n + 1}: too short for both phases; make --phase shorter")
                continue
            shown, idle = (statistics.fmean(gaps[k]) for k in (True, False))
            results.append((1 / shown, 1 / idle))
            print(f"reply {n + 1}: shown {1 / shown:.1f} tok/s over {len(gaps[True])} gaps, "
                  f"idle {1 / idle:.1f} tok/s over {len(gaps[False])} gaps: "
                  f"shown/idle = {idle / shown:.3f}", flush=True)
    finally:
        engine.shutdown()
    ratios = [s / i for s, i in results]
    print(f"model {info.name} on {info.device} ({info.dtype}, {info.kernel}); "
          f"{args.phase:g} s phases, {args.max_tokens} tokens a reply")
    print(f"decode with the window shown / idle: median {statistics.median(ratios):.3f} over "
          f"{len(ratios)} replies (min {min(ratios):.3f}, max {max(ratios):.3f}); load "
          f"average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
