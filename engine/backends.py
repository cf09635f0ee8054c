"""One Engine-shaped front for the local engine and a remote backend, so the window (or any
other caller) can switch between them with a model load and never hold two references.

load_model("remote", base_url=..., model=...) connects to an OpenAI-compatible server; any
other spec loads a local model. As with local loads, a failed switch keeps the old backend.
"""

from __future__ import annotations

import threading
from typing import Any

from engine.events import TERMINAL_EVENTS, EngineEvent, ModelInfo, ModelLoaded
from engine.listeners import EventSource
from engine.params import GenerationRequest
from engine.remote import REMOTE_SPEC, RemoteConfig, RemoteEngine, resolve_api_key
from engine.worker import Engine, RequestHandle


class BackendRouter(EventSource):
    """Engine's API; requests go to whichever backend loaded a model last."""

    def __init__(self, local: Engine) -> None:
        self.local = local
        self.remote: RemoteEngine | None = None
        self._pending_remote: RemoteEngine | None = None
        self._active: Engine | RemoteEngine = local
        self._init_listeners()
        self._handles: dict[str, Engine | RemoteEngine] = {}
        local.add_listener(lambda event: self._forward(local, event))

    # ----- lifecycle -------------------------------------------------------------------
    def start(self) -> BackendRouter:
        self.local.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        for backend in {id(b): b for b in (self.remote, self._pending_remote) if b}.values():
            backend.shutdown(timeout)
        self.local.shutdown(timeout)


    @property
    def model_info(self) -> ModelInfo | None:
        return self._active.model_info

    @property
    def is_remote(self) -> bool:
        return self._active is not self.local

    @property
    def prefix_cache(self) -> Any:
        return self._active.prefix_cache

    # ----- commands ----------------------------------------------------------------------
    def load_model(self, spec: str = "default", **options: Any) -> threading.Event:
        """A local model, or (spec "remote", base_url=..., model=...) a remote backend."""
        if spec != REMOTE_SPEC:
            return self.local.load_model(spec, **options)
        base_url = options["base_url"]
        backend = RemoteEngine(RemoteConfig(base_url, model=options.get("model") or None,
                                            api_key=resolve_api_key(base_url)))
        backend.add_listener(lambda event: self._forward(backend, event))
        self._pending_remote = backend
        return backend.start().load_model()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        backend = self._active
        self._handles[request.request_id] = backend
        return backend.submit(request)

    def cancel(self, request_id: str) -> None:
        backend = self._handles.get(request_id)
        if backend is not None:
            backend.cancel(request_id)

    def cancel_all(self) -> None:
        for backend in (self.local, self.remote):
            if backend is not None:
                backend.cancel_all()

    def drop_conversation(self, conversation_id: str) -> None:
        self.local.drop_conversation(conversation_id)

    # ----- events (backend threads) --------------------------------------------------------
    def _forward(self, backend: Engine | RemoteEngine, event: EngineEvent) -> None:
        if isinstance(event, ModelLoaded):
            self._switch_to(backend)
        if isinstance(event, TERMINAL_EVENTS):
            self._handles.pop(event.request_id, None)
        for listener in list(self._listeners):
            listener(event)

    def _switch_to(self, backend: Engine | RemoteEngine) -> None:
        """A load succeeded: it becomes the active backend; a replaced remote is closed."""
        old_remote = self.remote
        if isinstance(backend, RemoteEngine):
            self.remote, self._pending_remote = backend, None
        self._active = backend
        if old_remote is not None and old_remote is not backend:
            # Shut down off this thread: it may be the old backend's own loop thread.
            threading.Thread(target=old_remote.shutdown, daemon=True).start()
