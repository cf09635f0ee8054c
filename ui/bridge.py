"""The engine-to-Qt bridge: engine events (emitted on the engine thread) become Qt signals.

The engine thread only appends events to a thread-safe queue and, if the GUI is not already
due to drain it, emits one argument-free wake-up signal (queued to the GUI thread). The GUI
thread drains the queue and emits the typed signals there. No Python object crosses threads
through Qt's queued-connection machinery, and a burst of tokens costs one wake-up. Drains are
at most min_drain_interval_s apart (the window matches it to the chat view's paint rate): a
fast decode is handled in batches instead of one GUI wake-up per token, while the first event
after a pause is handled at once. Nothing here ever waits on the engine.
"""

from __future__ import annotations

import queue
import threading
import time

from PySide6.QtCore import QObject, QTimer, Signal

from engine import (
    DraftModelChanged,
    EngineEvent,
    ModelLoaded,
    ModelLoadFailed,
    ModelLoading,
    ModelLoadProgress,
    PrefillProgress,
    PrefillStarted,
    RequestFailed,
    RequestFinished,
    SamplerSnapshot,
    TextFlushed,
    TokenEmitted,
)
from engine.protocol import Backend

MIN_DRAIN_INTERVAL_S = 0.05  # 20 Hz, the chat view's paint rate (the window may lower both)


class EngineBridge(QObject):
    """Re-emits a Backend's events as Qt signals on the GUI thread."""

    sig_event = Signal(object)
    """Every engine event but a streaming reply's tokens and sampler snapshots, in order
    (feeds the HUD); those come in runs on sig_stream, each run before the next event here."""
    sig_stream = Signal(object)
    """A run of consecutive TokenEmitted and SamplerSnapshot events of every streaming reply,
    in order (a list): a drain's burst of tokens is one call, however many chats stream."""
    sig_token = Signal(object)
    """A TokenEmitted: one sampled token and its text delta (after its run on sig_stream; for
    observers: the window takes sig_stream)."""
    sig_text_flushed = Signal(object)
    """A TextFlushed: text held back until the end of a reply."""
    sig_prefill_started = Signal(object)
    """A PrefillStarted: prompt size and how much of it came from the cache."""
    sig_prefill_progress = Signal(object)
    """A PrefillProgress: how far the reading of a long prompt has got (a few times a second)."""
    sig_request_finished = Signal(object)
    """A RequestFinished: the reply is complete (stop, length or cancelled)."""
    sig_request_failed = Signal(object)
    """A RequestFailed: the request could not run; carries a one-line message."""
    sig_model_loading = Signal(str)
    """A model load progressed; the argument is one human-readable stage line."""
    sig_model_load_progress = Signal(object)
    """A ModelLoadProgress: how far a long load step got (a GGUF converting, in tensors)."""
    sig_model_loaded = Signal(object)
    """A model finished loading; the argument is its ModelInfo."""
    sig_model_load_failed = Signal(str)
    """A model load failed (the old model stays); the argument is the one-line reason."""
    sig_draft_changed = Signal(object)
    """A DraftModelChanged: a draft model for speculative decoding loaded (or was dropped)."""
    sig_draft_load_failed = Signal(str)
    """A draft model failed to load (the model and any previous draft stay); the reason."""

    _sig_wake = Signal()
    """Internal: events are waiting in the queue (emitted on the engine thread)."""

    def __init__(self, engine: Backend, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.engine = engine
        self._pending: queue.SimpleQueue[EngineEvent] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._wake_due = False
        self._detached = False
        self._last_drain = 0.0
        self.min_drain_interval_s = MIN_DRAIN_INTERVAL_S
        self._later = QTimer(self)  # a deferred drain (the last one was too recent)
        self._later.setSingleShot(True)
        self._later.timeout.connect(self.drain)
        self._sig_wake.connect(self.drain)
        engine.add_listener(self._on_engine_event)
        # If Qt deletes the bridge with its parent, the engine must stop calling into it.
        listener = self._on_engine_event
        self.destroyed.connect(lambda *_: engine.remove_listener(listener))

    def detach(self) -> None:
        """Stop forwarding (the window is closing; late events have nowhere to go)."""
        self._detached = True
        self.engine.remove_listener(self._on_engine_event)

    def _on_engine_event(self, event: EngineEvent) -> None:
        """Runs on the engine thread: queue the event, wake the GUI thread at most once."""
        if self._detached:
            return
        self._pending.put(event)
        with self._lock:
            if self._wake_due:
                return
            self._wake_due = True
        self._sig_wake.emit()

    def drain(self) -> None:
        """GUI thread: emit every queued event's signals, in order (or soon, if it just did:
        the wake-up flag stays set meanwhile, so the engine thread sends no more wake-ups)."""
        wait_s = self._last_drain + self.min_drain_interval_s - time.monotonic()
        if wait_s > 0:
            if not self._later.isActive():
                self._later.start(max(1, round(wait_s * 1000)))
            return
        self._last_drain = time.monotonic()
        with self._lock:
            self._wake_due = False
        run: list[EngineEvent] = []  # stream events since the last other event
        while not self._detached:
            try:
                event = self._pending.get_nowait()
            except queue.Empty:
                break
            if isinstance(event, TokenEmitted | SamplerSnapshot):
                run.append(event)
                continue
            self._emit_run(run)
            run = []
            self._dispatch(event)
        self._emit_run(run)

    def _emit_run(self, run: list[EngineEvent]) -> None:
        if not run or self._detached:
            return
        self.sig_stream.emit(run)
        for event in run:
            if isinstance(event, TokenEmitted):
                self.sig_token.emit(event)

    def _dispatch(self, event: EngineEvent) -> None:
        self.sig_event.emit(event)
        if isinstance(event, TextFlushed):
            self.sig_text_flushed.emit(event)
        elif isinstance(event, PrefillStarted):
            self.sig_prefill_started.emit(event)
        elif isinstance(event, PrefillProgress):
            self.sig_prefill_progress.emit(event)
        elif isinstance(event, RequestFinished):
            self.sig_request_finished.emit(event)
        elif isinstance(event, RequestFailed):
            self.sig_request_failed.emit(event)
        elif isinstance(event, ModelLoading):
            self.sig_model_loading.emit(event.stage)
        elif isinstance(event, ModelLoadProgress):
            self.sig_model_load_progress.emit(event)
        elif isinstance(event, ModelLoaded):
            self.sig_model_loaded.emit(event.info)
        elif isinstance(event, ModelLoadFailed):
            failed = self.sig_draft_load_failed if event.draft else self.sig_model_load_failed
            failed.emit(event.message)
        elif isinstance(event, DraftModelChanged):
            self.sig_draft_changed.emit(event)
