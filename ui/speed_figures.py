"""Prediction against reality: what a local model's replies measure here (decode and prefill,
from each reply's RequestMetrics) is kept per model file (engine/tools/speed.py's MeasuredSpeeds),
so the model picker sets it beside the speed predicted for this computer; and the HUD's
roofline is told the loaded model's prediction, to say it beside each reply's figures.

A reply that ran beside another (a batch, alternatives) or decoded speculatively is not kept:
its decode rate is not the model's alone.
"""

from __future__ import annotations

from PySide6.QtCore import QObject

from engine.events import ModelInfo, PrefillStarted, RequestFailed, RequestFinished
from engine.runtime_choice import LLAMA_CPP, TORCH
from engine.tools.speed import MeasuredSpeeds, file_speed, info_file
from ui.bridge import EngineBridge
from ui.hud.widget import HudWidget


class SpeedFigures(QObject):
    def __init__(self, bridge: EngineBridge, hud: HudWidget, parent: QObject | None = None,
                 store: MeasuredSpeeds | None = None) -> None:
        super().__init__(parent)
        self.hud = hud
        self.store = store or MeasuredSpeeds()
        self._running: set[str] = set()
        self._crowded: set[str] = set()  # replies that ran beside another
        bridge.sig_prefill_started.connect(self._started)
        bridge.sig_request_finished.connect(self._finished)
        bridge.sig_request_failed.connect(self._failed)
        bridge.sig_model_loaded.connect(self.model_loaded)

    def model_loaded(self, info: ModelInfo | None) -> None:
        """The HUD hears the loaded model's prediction (None: no measurement of this
        computer yet, or a model whose files do not tell, or a remote one)."""
        path = info_file(info.source, info.path) if info is not None else None
        if info is None or path is None or info.engine not in (TORCH, LLAMA_CPP):
            self.hud.set_model_speed(None)
            return
        device = "cpu" if info.engine == LLAMA_CPP else info.device
        self.hud.set_model_speed(file_speed(path, info.engine, device), info.identity)

    def _started(self, event: PrefillStarted) -> None:
        if self._running:
            self._crowded |= self._running | {event.request_id}
        self._running.add(event.request_id)

    def _failed(self, event: RequestFailed) -> None:
        self._running.discard(event.request_id)
        self._crowded.discard(event.request_id)

    def _finished(self, event: RequestFinished) -> None:
        rid = event.request_id
        crowded = rid in self._crowded
        self._running.discard(rid)
        self._crowded.discard(rid)
        result = event.result
        info = result.model
        if info is None or crowded or result.speculative or info.engine not in (TORCH,
                                                                                  LLAMA_CPP):
            return
        path = info_file(info.source, info.path)
        if path is not None:
            self.store.add(path, info.engine, result.metrics)
        if self.hud.model_speed is None:  # this computer may have been measured meanwhile
            self.model_loaded(info)
