"""How long is the GUI thread ever blocked while a reply streams, and what does the GUI cost?

Runs one greedy reply (up to 256 tokens) headless on the engine, then the same reply through
the real window (offscreen) twice: once plain, for the decode rate with the HUD visible, and
once with a 1 ms precise timer on the GUI thread: the largest gap between its ticks is the
longest the event loop was blocked. Prints numbers, asserts nothing.

    QT_QPA_PLATFORM=offscreen .venv/bin/python benchmarks/gui_latency.py [--model default]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PySide6.QtCore import QSettings, Qt, QTimer
from PySide6.QtWidgets import QApplication

from engine import ChatMessage, Engine, GenerationRequest, SamplingParams, percentile
from ui.main_window import MainWindow
from ui.store import ChatStore
from ui.theme import apply_theme

PROMPT = "Write a long, detailed story about a dragon who learns to bake bread."
MAX_TOKENS = 256


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


def gui_reply(app: QApplication, engine: Engine, scratch: Path, probe: TickProbe | None):
    """One reply through the real window; returns (result, finished_ns, inserts)."""
    store = ChatStore(scratch / "chats.sqlite3")
    settings = QSettings(str(scratch / "s.ini"), QSettings.Format.IniFormat)
    window = MainWindow(engine, store, settings, hud_calibrate=False)
    window.show()
    window.controls.temperature.setValue(0)
    window.controls.max_tokens.setValue(MAX_TOKENS)
    results = []
    finished_ns: list[int] = []
    window.sig_reply_finished.connect(
        lambda r: (results.append(r), finished_ns.append(time.perf_counter_ns()))
    )
    # keep running a moment after the end: the final Markdown render happens then
    window.sig_reply_finished.connect(lambda _r: QTimer.singleShot(500, app.quit))

    def begin() -> None:  # once the freshly shown window has painted and gone idle
        if probe is not None:
            probe.start()
        window.send(PROMPT)

    QTimer.singleShot(1000, begin)
    app.exec()
    if probe is not None:
        probe.stop()
    inserts = window.chat.insert_count
    window.close()
    store.close()
    return results[0], finished_ns[0], inserts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    args = parser.parse_args()
    app = QApplication([])
    apply_theme(app)
    engine = Engine().start()
    try:
        info = engine.load_model_sync(args.model)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        request = GenerationRequest([ChatMessage("user", PROMPT)], params, "headless")
        headless = engine.submit(request).wait().metrics
        # Throughput without the probe (its 1 ms ticks cost CPU themselves), then stalls with it.
        with tempfile.TemporaryDirectory() as scratch:
            plain, _, inserts = gui_reply(app, engine, Path(scratch), None)
        probe = TickProbe()
        with tempfile.TemporaryDirectory() as scratch:
            _, finished_ns, _ = gui_reply(app, engine, Path(scratch), probe)
        gui = plain.metrics
    finally:
        engine.shutdown()

    late = probe.late_ms
    worst = max(range(len(late)), key=late.__getitem__)
    from_end_s = (probe.late_at_ns[worst] - finished_ns) / 1e9
    print(f"model {info.name} on {info.device} ({info.dtype}, {info.kernel})")
    print(f"output tokens: headless {headless.output_tokens}, GUI {gui.output_tokens}")
    print(f"GUI timer lateness: max {late[worst]:.1f} ms ({from_end_s:+.2f} s from the reply's "
          f"end), p99 {percentile(late, 99):.1f} ms, p50 {percentile(late, 50):.1f} ms "
          f"over {len(late)} ticks")
    print(f"decode tok/s: headless {headless.decode_tok_s:.1f}, GUI {gui.decode_tok_s:.1f} "
          f"(GUI/headless = {gui.decode_tok_s / max(headless.decode_tok_s, 1e-9):.2f})")
    print(f"TTFT s: headless {headless.ttft_s:.3f}, GUI {gui.ttft_s:.3f}")
    print(f"chat view inserts: {inserts} for {gui.output_tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
