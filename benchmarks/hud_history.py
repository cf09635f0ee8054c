"""Does the HUD stay responsive with 10,000 tokens of history?

Replays a long synthetic session (tests/support/hud_events.history_events: replies of 250 tokens,
metrics from the engine's own code) through the real HUD widget, offscreen at dock size, on
the event loop: a 1 ms timer delivers one token's events per tick, the HUD redraws on its own
throttle timer (and every 40 tokens, since tokens come far faster than from a real decode), and
a 5 ms probe timer measures how late the GUI thread gets to it (a stall).

Prints, for the first and the last 1,000 tokens of history: event handling per token (the
HUD's on_engine_event and on_token_painted), and redraw cost (the HUD's flush plus the paint
that follows it) while a reply streams and at a reply's end; their late/early ratios; and the
longest GUI stall. Asserts nothing.

    QT_QPA_PLATFORM=offscreen .venv/bin/python benchmarks/hud_history.py [--tokens 10000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QApplication

from engine.events import EngineEvent, TokenEmitted
from engine.metrics import percentile
from engine.tools.calibrate import DevicePeaks
from tests.support.hud_events import MS, history_events, loaded_event
from ui.hud.widget import HudWidget

PEAKS = DevicePeaks("cpu: benchmark", 28.0, 0.16, "fixed for the benchmark")
PAINT_LAG_NS = 4 * MS  # the chat view reports each token painted this long after emission
WINDOW = 1_000  # tokens of history compared at the start and at the end
LIVE_REDRAW_EVERY = 40  # tokens


@dataclass
class Redraw:
    history: int  # tokens emitted before this redraw
    final: bool  # every panel (a reply just ended) rather than the live ones
    flush_s: float
    paint_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.flush_s + self.paint_s


class TimedHud(HudWidget):
    """The real HUD; each timer-driven redraw records its flush and the paint after it."""

    def __init__(self) -> None:
        super().__init__(calibrate=False)
        self.history = 0
        self.redraws: list[Redraw] = []

    def flush(self) -> None:
        if self.redraws:  # the previous redraw's paint has happened by now
            self.redraws[-1].paint_s = sum(p.plot.paint_s for p in self.panels.values())
        final = "all" in self._dirty
        started = time.perf_counter()
        super().flush()
        self.redraws.append(Redraw(self.history, final, time.perf_counter() - started))


class Replay:
    """Delivers the session one token (with the events around it) per timer tick."""

    def __init__(self, app: QApplication, hud: TimedHud, replies: list[list[EngineEvent]]):
        self.app, self.hud = app, hud
        self._chunks = (chunk for events in replies for chunk in _token_chunks(events))
        self.handled: list[tuple[int, float]] = []  # (history tokens, seconds per token)
        self.late_ms: list[tuple[int, float]] = []  # (history tokens, probe lateness)
        self._feeder = _precise_timer(1, self._feed)
        self._probe = _precise_timer(5, self._tick)
        self._last_tick = 0

    def run(self) -> None:
        self._last_tick = time.perf_counter_ns()
        self._feeder.start()
        self._probe.start()
        self.app.exec()

    def _feed(self) -> None:
        chunk = next(self._chunks, None)
        if chunk is None:
            self._feeder.stop()
            QTimer.singleShot(500, self._finish)  # let the final redraw land
            return
        started = time.perf_counter()
        for event in chunk:
            self.hud.on_engine_event(event)
            if isinstance(event, TokenEmitted):
                self.hud.on_token_painted(event.request_id, event.index,
                                          event.t_ns + PAINT_LAG_NS)
        spent = time.perf_counter() - started
        if any(isinstance(e, TokenEmitted) for e in chunk):
            self.handled.append((self.hud.history, spent))
            self.hud.history += 1
            # Tokens arrive far faster than a real decode, so the throttle alone would see few
            # live redraws: ask for one every LIVE_REDRAW_EVERY tokens as well.
            if self.hud.history % LIVE_REDRAW_EVERY == 0:
                self.hud.flush()

    def _tick(self) -> None:
        now = time.perf_counter_ns()
        self.late_ms.append((self.hud.history, max(0.0, (now - self._last_tick) / 1e6 - 5)))
        self._last_tick = now

    def _finish(self) -> None:
        self._probe.stop()
        self.app.quit()


def _token_chunks(events: list[EngineEvent]) -> list[list[EngineEvent]]:
    """Split a reply's events so each chunk ends with one token (the rest ride along)."""
    chunks: list[list[EngineEvent]] = [[]]
    for event in events:
        chunks[-1].append(event)
        if isinstance(event, TokenEmitted):
            chunks.append([])
    return [c for c in chunks if c]


def _precise_timer(interval_ms: int, slot: object) -> QTimer:
    timer = QTimer()
    timer.setTimerType(Qt.TimerType.PreciseTimer)
    timer.setInterval(interval_ms)
    timer.timeout.connect(slot)
    return timer


def _median_us(values: list[float]) -> float:
    return statistics.median(values) * 1e6 if values else float("nan")


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


def report(replay: Replay, hud: TimedHud, tokens: int, replies: int) -> None:
    early = range(0, WINDOW)
    late = range(tokens - WINDOW, tokens + 1)
    handled_early = [s for h, s in replay.handled if h in early]
    handled_late = [s for h, s in replay.handled if h in late]
    print(f"history: {tokens:,} tokens in {replies} replies; HUD {hud.width()}x{hud.height()} "
          f"offscreen; load average {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")
    a, b = _median_us(handled_early), _median_us(handled_late)
    print(f"event handling per token (median): first {WINDOW:,} tokens {a:.1f} us, "
          f"last {WINDOW:,} {b:.1f} us (late/early = {b / a:.2f})")
    for final, what in ((False, "while streaming"), (True, "at a reply's end (all panels)")):
        done = [r for r in hud.redraws[:-1] if r.final == final]  # the last has no paint yet
        a = _median_ms([r.total_s for r in done if r.history in early])
        b = _median_ms([r.total_s for r in done if r.history in late])
        paint = _median_ms([r.paint_s for r in done if r.history in late])
        print(f"redraw {what} (flush + paint, median): first {WINDOW:,} tokens {a:.1f} ms, "
              f"last {WINDOW:,} {b:.1f} ms, of which paint {paint:.1f} ms "
              f"(late/early = {b / a:.2f}); {len(done)} redraws")
    history, worst = max(replay.late_ms, key=lambda item: item[1])
    late_ms = [ms for _, ms in replay.late_ms]
    print(f"GUI stall (5 ms probe lateness): max {worst:.1f} ms at {history:,} tokens of "
          f"history, p99 {percentile(late_ms, 99):.1f} ms, p50 {percentile(late_ms, 50):.1f} ms "
          f"over {len(late_ms)} ticks")
    ring = hud.model.throughput_ring
    print(f"throughput ring: {len(ring):,} of {ring.capacity:,} points kept, {ring.nbytes:,} "
          f"bytes (fixed at start)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=10_000)
    parser.add_argument("--per-reply", type=int, default=250)
    args = parser.parse_args()
    app = QApplication([])
    hud = TimedHud()
    hud.resize(420, 1000)
    hud.show()
    hud.set_device_peaks(PEAKS)
    hud.on_engine_event(loaded_event())
    replies = history_events(args.tokens, args.per_reply)
    replay = Replay(app, hud, replies)
    replay.run()
    report(replay, hud, args.tokens, len(replies))
    hud.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
