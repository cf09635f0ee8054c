"""The wait forecast beside Send: as the user types (debounced), how many of the message's
prompt tokens are new, how long the first token will take, and how many come from the cache.

The cached count comes from the backend (`peek_prefix`, never waiting for the engine thread);
the time from a prefill cost line fitted to this session's finished replies of the loaded
model (engine/forecast.py). No time is said until that line is trusted."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, QTimer

from engine.events import ModelInfo, RequestFinished
from engine.forecast import PrefillCost, forecast_text
from engine.params import GenerationRequest
from engine.protocol import Backend

DEBOUNCE_MS = 400  # typing pauses this long before the prompt is tokenized again


class WaitForecast(QObject):
    def __init__(self, backend: Backend, request: Callable[[str], GenerationRequest | None],
                 show: Callable[[str], None], parent: QObject | None = None) -> None:
        """request(text): what sending `text` now would ask (None: nothing to forecast);
        show(line): puts the forecast beside Send."""
        super().__init__(parent)
        self.backend = backend
        self.cost = PrefillCost()
        self._request, self._show = request, show
        self._text = ""
        self.seconds: float | None = None  # the forecast on screen now
        self.cold_seconds: float | None = None  # reading the whole prompt, nothing cached
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(DEBOUNCE_MS)
        self._timer.timeout.connect(self.refresh)
        self._stopped = False

    def stop(self) -> None:
        """The window is closing: no forecast after this (the chat store closes)."""
        self._timer.stop()
        self._stopped = True

    def text_changed(self, text: str) -> None:
        self._text = text
        self._restart()

    def finished(self, event: RequestFinished) -> None:
        m = event.result.metrics
        if m.prefill_complete and m.prompt_tokens_known and m.cached_tokens_known:
            self.cost.add(m.cached_tokens, m.prompt_tokens, m.prefill_s, m.restored_tokens,
                          m.restore_s)
        self._restart()  # the cache changed too

    def model_loaded(self, _info: ModelInfo) -> None:
        self.cost.clear()
        self._restart()

    def _restart(self) -> None:
        if not self._stopped:
            self._timer.start()

    def refresh(self) -> None:
        request = self._request(self._text) if self._text.strip() else None
        peek = self.backend.peek_prefix(request) if request is not None else None
        if peek is None:
            self.seconds = self.cold_seconds = None
            self._show("")
            return
        self.seconds = self.cost.seconds(peek.cached_tokens, peek.prompt_tokens, peek.from_disk)
        self.cold_seconds = self.cost.seconds(0, peek.prompt_tokens)
        self._show(forecast_text(peek, self.seconds))
