"""What keeps the GUI thread off decode's back: batched bridge drains, labels that repaint
without re-laying out the HUD. (Their effect on decode speed is measured in benchmarks/.)"""

from __future__ import annotations

import threading
import time

from PySide6.QtCore import QEvent, QObject
from PySide6.QtWidgets import QVBoxLayout, QWidget

from engine import TokenEmitted
from engine.events import EngineEvent
from ui.bridge import MIN_DRAIN_INTERVAL_S, EngineBridge
from ui.chat_view import CPU_FLUSH_INTERVAL_MS
from ui.hud.live_label import LiveLabel


class FakeEngine:
    """Just the listener registry a bridge needs."""

    def __init__(self) -> None:
        self.listeners: list = []

    def add_listener(self, listener) -> None:
        self.listeners.append(listener)

    def remove_listener(self, listener) -> None:
        self.listeners.remove(listener)


class CountingBridge(EngineBridge):
    def __init__(self, engine) -> None:
        self.drain_stamps: list[float] = []  # one per event: the drain that handled it
        super().__init__(engine)

    def _dispatch(self, event: EngineEvent) -> None:
        self.drain_stamps.append(self._last_drain)
        super()._dispatch(event)

    def _emit_run(self, run: list[EngineEvent]) -> None:  # tokens come in runs
        self.drain_stamps += [self._last_drain] * len(run)
        super()._emit_run(run)


def test_a_token_flood_is_handled_in_few_drains_in_order(qtbot) -> None:
    engine = FakeEngine()
    bridge = CountingBridge(engine)
    received: list[int] = []
    bridge.sig_token.connect(lambda e: received.append(e.index))
    count = 200

    def produce() -> None:  # the engine thread: a token every 2 ms
        for i in range(count):
            engine.listeners[0](TokenEmitted("r", time.perf_counter_ns(), i, 7, "x"))
            time.sleep(0.002)

    started = time.monotonic()
    thread = threading.Thread(target=produce)
    thread.start()
    qtbot.waitUntil(lambda: len(received) == count, timeout=10_000)
    elapsed = time.monotonic() - started
    thread.join()
    assert received == list(range(count))
    drains = len(set(bridge.drain_stamps))
    assert 2 <= drains <= elapsed / MIN_DRAIN_INTERVAL_S + 2  # batches, not one per token


def test_the_first_event_after_a_pause_is_not_held_back(qtbot) -> None:
    engine = FakeEngine()
    bridge = CountingBridge(engine)
    received: list[int] = []
    bridge.sig_token.connect(lambda e: received.append(e.index))
    engine.listeners[0](TokenEmitted("r", 0, 0, 7, "x"))
    qtbot.waitUntil(lambda: received == [0], timeout=5_000)
    assert not bridge._later.isActive()  # handled by the wake-up itself, no deferral


class LayoutRequests(QObject):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def eventFilter(self, _obj: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.LayoutRequest:
            self.count += 1
        return False


def test_live_label_relays_out_only_when_its_height_changes(qtbot) -> None:
    parent = QWidget()
    qtbot.addWidget(parent)
    layout = QVBoxLayout(parent)
    label = LiveLabel("Reply #1: 0 gaps · p50 30.1 ms", word_wrap=True)
    layout.addWidget(label)
    layout.addStretch(1)  # the label gets its text's height, not the spare room
    parent.resize(300, 200)
    parent.show()
    qtbot.waitExposed(parent)
    qtbot.wait(50)  # the first layout is done
    requests = LayoutRequests()
    parent.installEventFilter(requests)

    for n in range(1, 30):  # a live caption: new numbers, same one line
        label.setText(f"Reply #1: {n} gaps · p50 {30 + n / 10:.1f} ms")
        qtbot.wait(1)
    assert requests.count == 0
    one_line = label.height()

    label.setText("A much longer caption that cannot fit on one line of a narrow dock, so "
                  "it wraps onto several lines and the layout must make room for it.")
    qtbot.waitUntil(lambda: label.height() > one_line, timeout=2_000)
    assert requests.count >= 1
    assert label.text().startswith("A much longer caption")


def test_a_model_on_this_cpu_streams_text_at_the_cpu_rate(make_window) -> None:
    window = make_window()  # the tiny model runs on the CPU
    assert window.chat.flush_interval_ms == CPU_FLUSH_INTERVAL_MS
    assert window.bridge.min_drain_interval_s == CPU_FLUSH_INTERVAL_MS / 1000
    assert window.hud._text_interval_s == CPU_FLUSH_INTERVAL_MS / 1000
