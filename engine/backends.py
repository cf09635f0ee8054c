"""One Backend in front of the local engine and a remote backend, so the window (or any
other caller) can switch between them with a model load and never hold two references.

load_model("remote", base_url=..., model=...) connects to an OpenAI-compatible server; any
other spec loads a local model. As with local loads, a failed switch keeps the old backend.
Given a loop (the GUI's qasync loop), remote backends stream on it instead of in a thread of
their own.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from engine.events import TERMINAL_EVENTS, EngineEvent, ModelInfo, ModelLoaded
from engine.listeners import EventSource
from engine.params import GenerationRequest
from engine.protocol import Backend, Capabilities, PrefixPeek, RequestHandle
from engine.remote import REMOTE_SPEC, RemoteConfig, RemoteEngine, resolve_api_key
from engine.worker import Engine


class BackendRouter(EventSource, Backend):
    """A Backend whose requests go to whichever backend loaded a model last."""

    def __init__(self, local: Engine, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.local = local
        self.loop = loop
        self.remote: RemoteEngine | None = None
        self._pending_remote: RemoteEngine | None = None
        self._active: Engine | RemoteEngine = local
        self._init_listeners()
        self._handles: dict[str, Engine | RemoteEngine] = {}
        self._lent: list[RemoteEngine] = []  # made by new_remote for others (compare mode)
        local.add_listener(lambda event: self._forward(local, event))

    # ----- lifecycle -------------------------------------------------------------------
    def start(self) -> BackendRouter:
        self.local.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Close every backend, lent ones too (their owner may not have): shutdown() of a
        remote that is already shut down does nothing."""
        remotes = [self.remote, self._pending_remote, *self._lent]
        for backend in {id(b): b for b in remotes if b}.values():
            backend.shutdown(timeout)
        self.local.shutdown(timeout)


    @property
    def model_info(self) -> ModelInfo | None:
        return self._active.model_info

    @property
    def is_remote(self) -> bool:
        return self._active is not self.local

    @property
    def capabilities(self) -> Capabilities:
        return self._active.capabilities

    @property
    def prefix_cache(self) -> Any:
        return self._active.prefix_cache

    # ----- commands ----------------------------------------------------------------------
    def load_model(self, spec: str = "default", **options: Any) -> threading.Event:
        """A local model, or (spec "remote", base_url=..., model=...) a remote backend."""
        if spec != REMOTE_SPEC:
            return self.local.load_model(spec, **options)
        return self._connect(options).load_model()

    def load_model_sync(self, spec: str = "default", timeout: float | None = None,
                        **options: Any) -> ModelInfo:
        """load_model, waited for; ModelLoadError with the reason if it failed (the active
        backend stays)."""
        if spec != REMOTE_SPEC:
            return self.local.load_model_sync(spec, timeout, **options)
        return self._connect(options).load_model_sync(timeout=timeout)

    def _connect(self, options: dict[str, Any]) -> RemoteEngine:
        """A started remote backend for options' base_url and model; the active one once its
        load succeeds."""
        config = RemoteConfig(options["base_url"], model=options.get("model") or None,
                              api_key=resolve_api_key(options["base_url"]))
        backend = RemoteEngine(config, loop=self.loop)
        backend.add_listener(lambda event: self._forward(backend, event))
        self._pending_remote = backend
        return backend.start()

    def new_remote(self, base_url: str, model: str | None = None,
                   api_key: str | None = None) -> RemoteEngine:
        """A remote backend on this router's loop (key: the one given, else the URL's stored
        one), not started and not the chat's: compare mode runs its own next to it."""
        config = RemoteConfig(base_url, model=model or None,
                              api_key=api_key or resolve_api_key(base_url))
        backend = RemoteEngine(config, loop=self.loop)
        self._lent = [b for b in self._lent if not b.closed.is_set()]
        self._lent.append(backend)
        return backend

    def submit(self, request: GenerationRequest) -> RequestHandle:
        backend = self._active
        self._handles[request.request_id] = backend
        return backend.submit(request)

    def submit_alternatives(self, request: GenerationRequest, n: int) -> list[RequestHandle]:
        """The active backend's alternatives (the local engine's share one prefill)."""
        backend = self._active
        for alternative in request.alternatives(n):  # known before their first event
            self._handles[alternative.request_id] = backend
        return backend.submit_alternatives(request, n)

    def cancel(self, request_id: str) -> None:
        backend = self._handles.get(request_id)
        if backend is not None:
            backend.cancel(request_id)

    def cancel_all(self) -> None:
        for backend in (self.local, self.remote):
            if backend is not None:
                backend.cancel_all()

    def load_draft(self, spec: str | None, **options: Any) -> threading.Event:
        """A draft model for the active backend's speculative decoding (None drops it); a
        remote backend refuses (capabilities.draft_model)."""
        return self._active.load_draft(spec, **options)

    def load_draft_sync(self, spec: str | None, timeout: float | None = None,
                        **options: Any) -> None:
        self._active.load_draft_sync(spec, timeout, **options)

    def drop_conversation(self, conversation_id: str) -> None:
        self.local.drop_conversation(conversation_id)

    def keep_alternative(self, conversation_id: str, index: int, count: int) -> None:
        self.local.keep_alternative(conversation_id, index, count)

    def peek_prefix(self, request: GenerationRequest) -> PrefixPeek | None:
        return self._active.peek_prefix(request)

    def count_tokens(self, text: str) -> int | None:
        return self._active.count_tokens(text)

    # ----- events (backend threads) --------------------------------------------------------
    def _forward(self, backend: Engine | RemoteEngine, event: EngineEvent) -> None:
        if isinstance(event, ModelLoaded):
            self._switch_to(backend)
        if isinstance(event, TERMINAL_EVENTS):
            self._handles.pop(event.request_id, None)
        self._broadcast(event)

    def _switch_to(self, backend: Engine | RemoteEngine) -> None:
        """A load succeeded: it becomes the active backend; a replaced remote is closed."""
        old_remote = self.remote
        if isinstance(backend, RemoteEngine):
            self.remote, self._pending_remote = backend, None
        self._active = backend
        if old_remote is None or old_remote is backend:
            return
        if self.loop is not None:  # run there: on its own loop shutdown() never waits
            self.loop.call_soon_threadsafe(old_remote.shutdown)
        else:  # off this thread: it may be the old backend's own loop thread
            threading.Thread(target=old_remote.shutdown, daemon=True).start()
