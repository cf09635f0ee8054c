"""How long is the GUI thread ever blocked while a reply streams, and what does the GUI cost?

Runs the same greedy reply (up to --max-tokens, 256) headless on the engine and through the real
window (offscreen, HUD visible), alternating in ABBA order over --rounds pairs so that a load
that drifts over the run (a shared machine) weighs on both sides alike; then once more through
the window with a 5 ms precise timer on the GUI thread: the largest lateness of its ticks is
the longest the event loop was blocked. Prints numbers, asserts nothing.

    QT_QPA_PLATFORM=offscreen .venv/bin/python benchmarks/gui_latency.py [--model default]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PySide6.QtCore import QSettings, Qt, QTimer
from PySide6.QtWidgets import QApplication

from engine import ChatMessage, GenerationRequest, SamplingParams, percentile
from engine.metrics import RequestMetrics
from engine.worker import Engine
from ui.main_window import MainWindow
from ui.store import ChatStore
from ui.theme import apply_theme

PROMPT = "Write a long, detailed story about a dragon who learns to bake bread."
MAX_TOKENS = 256
GUI_CPU_S: list[float] = []  # GUI thread CPU seconds per GUI reply, send to finish


class TickProbe:
    """A 5 ms timer on the GUI thread; a tick's lateness is how long the loop was busy."""

    INTERVAL_MS = 5

    def __init__(self) -> None:
        self.late_ms: list[float] = []
        self.late_at_ns: list[int] = []
        self._last = 0
        self._timer = QTimer()
        self._timer.setTimerType(Qt.TimerType.PreciseTimer)
        self._timer.setInterval(self.INTERVAL_MS)
        self._timer.timeout.connect(self._tick)

    def start(self) -> None:
        self._last = time.perf_counter_ns()
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()

    def _tick(self) -> None:
        now = time.perf_counter_ns()
        self.late_ms.append(max(0.0, (now - self._last) / 1e6 - self.INTERVAL_MS))
        self.late_at_ns.append(now)
        self._last = now


def gui_reply(app: QApplication, engine: Engine, scratch: Path, probe: TickProbe | None,
              max_tokens: int = MAX_TOKENS):
    """One reply through the real window; returns (result, finished_ns, inserts).

    Also records the GUI thread's CPU seconds from send to finish in GUI_CPU_S: unlike a
    decode rate, CPU time barely moves when other processes load the machine.
    """
    store = ChatStore(scratch / "chats.sqlite3")
    settings = QSettings(str(scratch / "s.ini"), QSettings.Format.IniFormat)
    window = MainWindow(engine, store, settings, hud_calibrate=False)
    window.show()
    window.controls.temperature.setValue(0)
    window.controls.max_tokens.setValue(max_tokens)
    results = []
    finished_ns: list[int] = []
    cpu_at_send: list[float] = []
    window.sig_reply_finished.connect(
        lambda r: (results.append(r), finished_ns.append(time.perf_counter_ns()),
                   GUI_CPU_S.append(time.thread_time() - cpu_at_send[0]))
    )
    # keep running a moment after the end: the final Markdown render happens then
    window.sig_reply_finished.connect(lambda _r: QTimer.singleShot(500, app.quit))

    def begin() -> None:  # once the freshly shown window has painted and gone idle
        if probe is not None:
            probe.start()
        cpu_at_send.append(time.thread_time())
        window.send(PROMPT)

    QTimer.singleShot(1000, begin)
    app.exec()
    if probe is not None:
        probe.stop()
    inserts = window.chat.insert_count
    window.close()
    store.close()
    return results[0], finished_ns[0], inserts


def headless_reply(engine: Engine, max_tokens: int = MAX_TOKENS) -> RequestMetrics:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    request = GenerationRequest([ChatMessage("user", PROMPT)], params, "headless")
    return engine.submit(request).wait().metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=2,
                        help="headless/GUI pairs, alternated ABBA (default 2)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                        help=f"tokens per reply (default {MAX_TOKENS})")
    args = parser.parse_args()
    app = QApplication([])
    apply_theme(app)
    engine = Engine().start()
    try:
        info = engine.load_model_sync(args.model)
        headless_runs, gui_runs, inserts = [], [], 0
        for round_ in range(args.rounds):
            for side in ("headless", "gui") if round_ % 2 == 0 else ("gui", "headless"):
                if side == "headless":
                    headless_runs.append(headless_reply(engine, args.max_tokens))
                else:  # throughput without the probe (its ticks cost CPU themselves)
                    with tempfile.TemporaryDirectory() as scratch:
                        plain, _, inserts = gui_reply(app, engine, Path(scratch), None,
                                                      args.max_tokens)
                    gui_runs.append(plain.metrics)
                runs = headless_runs if side == "headless" else gui_runs
                print(f"round {round_ + 1} {side}: {runs[-1].decode_tok_s:.1f} tok/s, load "
                      f"average {os.getloadavg()[0]:.2f}", flush=True)
        probe = TickProbe()
        with tempfile.TemporaryDirectory() as scratch:
            _, finished_ns, _ = gui_reply(app, engine, Path(scratch), probe, args.max_tokens)
    finally:
        engine.shutdown()
    headless, gui = headless_runs[0], gui_runs[0]

    late = probe.late_ms
    worst = max(range(len(late)), key=late.__getitem__)
    from_end_s = (probe.late_at_ns[worst] - finished_ns) / 1e9
    print(f"model {info.name} on {info.device} ({info.dtype}, {info.kernel})")
    print(f"output tokens: headless {headless.output_tokens}, GUI {gui.output_tokens}")
    print(f"GUI timer lateness: max {late[worst]:.1f} ms ({from_end_s:+.2f} s from the reply's "
          f"end), p99 {percentile(late, 99):.1f} ms, p50 {percentile(late, 50):.1f} ms "
          f"over {len(late)} ticks")
    for round_, (h, g) in enumerate(zip(headless_runs, gui_runs, strict=True), 1):
        print(f"round {round_} decode tok/s: headless {h.decode_tok_s:.1f}, GUI "
              f"{g.decode_tok_s:.1f} (GUI/headless = {g.decode_tok_s / h.decode_tok_s:.2f})")
    cpu_ms = [s * 1000 / m.output_tokens for s, m in zip(GUI_CPU_S, gui_runs, strict=False)]
    print("GUI thread CPU per token (whole window, HUD visible): "
          + ", ".join(f"{ms:.2f} ms" for ms in cpu_ms))
    h_mean = statistics.fmean(m.decode_tok_s for m in headless_runs)
    g_mean = statistics.fmean(m.decode_tok_s for m in gui_runs)
    print(f"decode tok/s over {args.rounds} rounds: headless {h_mean:.1f}, GUI {g_mean:.1f} "
          f"(GUI/headless = {g_mean / h_mean:.2f}); load average {os.getloadavg()[0]:.2f}")
    # A shared machine's speed drifts by 10% or more within a minute: the median of the
    # rounds' own ratios (each from neighbouring runs) is the steadier figure.
    ratios = [g.decode_tok_s / h.decode_tok_s for h, g in zip(headless_runs, gui_runs,
                                                                 strict=True)]
    print(f"median of per-round GUI/headless ratios: {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}, {len(ratios)} rounds)")
    print(f"TTFT s: headless {headless.ttft_s:.3f}, GUI {gui.ttft_s:.3f}")
    print(f"chat view inserts: {inserts} for {gui.output_tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
