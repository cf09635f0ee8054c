"""The engine-to-Qt bridge: engine events (emitted on the engine thread) become Qt signals.

The bridge lives on the GUI thread; the engine listener emits from the engine thread, so Qt
queues every signal to the GUI thread. Nothing here ever waits on the engine.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from engine import (
    Engine,
    EngineEvent,
    ModelLoaded,
    ModelLoadFailed,
    ModelLoading,
    PrefillStarted,
    RequestFailed,
    RequestFinished,
    TextFlushed,
    TokenEmitted,
)


class EngineBridge(QObject):
    """Re-emits an Engine's events as Qt signals on the GUI thread."""

    sig_event = Signal(object)
    """Every engine event, in order (feeds the HUD)."""
    sig_token = Signal(object)
    """A TokenEmitted: one sampled token and its text delta."""
    sig_text_flushed = Signal(object)
    """A TextFlushed: text held back until the end of a reply."""
    sig_prefill_started = Signal(object)
    """A PrefillStarted: prompt size and how much of it came from the cache."""
    sig_request_finished = Signal(object)
    """A RequestFinished: the reply is complete (stop, length or cancelled)."""
    sig_request_failed = Signal(object)
    """A RequestFailed: the request could not run; carries a one-line message."""
    sig_model_loading = Signal(str)
    """A model load progressed; the argument is one human-readable stage line."""
    sig_model_loaded = Signal(object)
    """A model finished loading; the argument is its ModelInfo."""
    sig_model_load_failed = Signal(str)
    """A model load failed (the old model stays); the argument is the one-line reason."""

    def __init__(self, engine: Engine, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.engine = engine
        self._detached = False
        engine.add_listener(self._on_engine_event)

    def detach(self) -> None:
        """Stop forwarding (the window is closing; late events have nowhere to go)."""
        self._detached = True

    def _on_engine_event(self, event: EngineEvent) -> None:
        """Runs on the engine thread: only emit, never touch widgets."""
        if self._detached:
            return
        self.sig_event.emit(event)
        if isinstance(event, TokenEmitted):
            self.sig_token.emit(event)
        elif isinstance(event, TextFlushed):
            self.sig_text_flushed.emit(event)
        elif isinstance(event, PrefillStarted):
            self.sig_prefill_started.emit(event)
        elif isinstance(event, RequestFinished):
            self.sig_request_finished.emit(event)
        elif isinstance(event, RequestFailed):
            self.sig_request_failed.emit(event)
        elif isinstance(event, ModelLoading):
            self.sig_model_loading.emit(event.stage)
        elif isinstance(event, ModelLoaded):
            self.sig_model_loaded.emit(event.info)
        elif isinstance(event, ModelLoadFailed):
            self.sig_model_load_failed.emit(event.message)
