"""What every Engine-shaped backend shares: listeners for its events, and `with` support."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from engine.events import EngineEvent

Listener = Callable[[EngineEvent], None]
log = logging.getLogger(__name__)


class EventSource:
    """Listener registry plus context management (start on enter, shutdown on exit).

    Subclasses call `_init_listeners()` and implement start() and shutdown().
    """

    _listeners: list[Listener]

    def _init_listeners(self) -> None:
        self._listeners = []

    def add_listener(self, listener: Listener) -> None:
        """Call listener with every event (on the backend's own thread: keep it quick)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling listener (its owner is going away); unknown listeners are ignored."""
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def _broadcast(self, event: EngineEvent) -> None:
        """Give event to every listener; one that raises is logged, the rest still run."""
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                log.exception("%s listener failed", type(self).__name__)

    def start(self) -> Any:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
