"""The one contract above every engine: what the window, the CLI, `serve` and compare mode
may call on a backend, and what a backend says it can do.

Implementations: the local `Engine` (engine/worker.py; a torch model or, later, a GGUF on
llama.cpp), `RemoteEngine` (engine/remote.py, an OpenAI-compatible server) and
`BackendRouter` (engine/backends.py, whichever of those is active). Callers hold a `Backend`
and ask `capabilities`; they never probe a backend with getattr/hasattr. Each implementation
subclasses `Backend` explicitly, so the type checker reports a missing or mismatched method
where the class is defined.

A request's handle (RequestHandle: its events, result and cancel) is part of the contract, so
it lives here, not with one backend. Nothing here imports torch: a backend need not run one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from engine.errors import PhasewiseError
from engine.events import (
    EngineEvent,
    GenerationResult,
    ModelInfo,
    RequestFailed,
    RequestFinished,
)
from engine.listeners import Listener
from engine.params import GenerationRequest, Speculative

SPECULATIVE_METHODS: tuple[Speculative, ...] = ("ngram", "draft")


@dataclass(frozen=True)
class PrefixPeek:
    """How much of a prompt is cached right now (a forecast, not a promise)."""

    prompt_tokens: int
    cached_tokens: int
    from_disk: bool = False  # the cached part would be read back from a snapshot on disk

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond submit/cancel (every backend can do those)."""

    shared_prefill_alternatives: bool = False
    """submit_alternatives prefills the prompt once for all N (else: N plain requests)."""
    speculative: tuple[Speculative, ...] = ()
    """Speculative methods it runs ("ngram": prompt lookup, "draft": a draft model)."""
    draft_model: bool = False
    """load_draft can load a draft model (for speculative="draft")."""
    sampler_view: bool = False
    """TokenEmitted events carry SamplerSnapshot views of the sampler (the HUD's panel)."""
    prefix_cache_ledger: bool = False
    """PrefillStarted and the metrics report cached tokens and why a miss happened."""
    conversation_cache: bool = False
    """It keeps a prefix cache per conversation: drop_conversation / keep_alternative act."""
    drop_oldest_turns: bool = False
    """overflow="drop_oldest" leaves a chat's oldest turns out of a prompt over the context
    (and the result counts them); else such a prompt is refused (a server decides itself)."""

    def runs(self, speculative: str | None) -> bool:
        """True if a request with this speculative method (None: plain) can run here."""
        return speculative is None or speculative in self.speculative


class RequestHandle:
    """The caller's side of one request: its events, its result, and a cancel button."""

    def __init__(self, request: GenerationRequest, cancel: threading.Event) -> None:
        self.request = request
        self.request_id = request.request_id
        self._cancel = cancel
        self._events: queue.Queue[EngineEvent] = queue.Queue()
        self._done = threading.Event()
        self.result: GenerationResult | None = None
        self.error: str | None = None

    def cancel(self) -> None:
        """Ask the engine to stop this request; it stops within one decode step."""
        self._cancel.set()

    def events(self, timeout: float | None = None) -> Iterator[EngineEvent]:
        """Yield this request's events until it finishes or fails."""
        while True:
            event = self._events.get(timeout=timeout)
            yield event
            if isinstance(event, (RequestFinished, RequestFailed)):
                return

    def wait(self, timeout: float | None = None) -> GenerationResult:
        """Block until done; raise PhasewiseError with the engine's message if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} still running")
        if self.result is None:
            raise PhasewiseError(self.error or "request failed")
        return self.result

    def _deliver(self, event: EngineEvent) -> None:
        if isinstance(event, RequestFinished):
            self.result = event.result
        elif isinstance(event, RequestFailed):
            self.error = event.message
        self._events.put(event)
        if isinstance(event, (RequestFinished, RequestFailed)):
            self._done.set()


class Backend(Protocol):
    """Everything above the engine talks to this, never to a concrete class."""

    # ----- lifecycle -------------------------------------------------------------------------
    def start(self) -> Backend:
        """Start its threads (or loop tasks); returns itself."""
        ...

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel everything and stop; a second call does nothing."""
        ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...

    # ----- what it is ------------------------------------------------------------------------
    @property
    def model_info(self) -> ModelInfo | None:
        """The model requests run on now; None before the first load succeeds."""
        ...

    @property
    def is_remote(self) -> bool:
        """True when another process (a server) runs the model and owns its cache."""
        ...

    @property
    def capabilities(self) -> Capabilities:
        """What it can do now (a router answers for its active backend)."""
        ...

    # ----- models ------------------------------------------------------------------------------
    def load_model(self, spec: str = "default", **options: Any) -> threading.Event:
        """Queue a load; the outcome arrives as ModelLoaded or ModelLoadFailed (the old model
        stays). Returns an event set when it is over."""
        ...

    def load_model_sync(self, spec: str = "default", timeout: float | None = None,
                        **options: Any) -> ModelInfo:
        """Load and wait; raise ModelLoadError with the one-line reason on failure."""
        ...

    def load_draft(self, spec: str | None, **options: Any) -> threading.Event:
        """Queue a draft model load (None drops it): DraftModelChanged, or
        ModelLoadFailed(draft=True) (always, where capabilities.draft_model is False)."""
        ...

    def load_draft_sync(self, spec: str | None, timeout: float | None = None,
                        **options: Any) -> None:
        """Load a draft model and wait; raise ModelLoadError on failure."""
        ...

    # ----- requests ----------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request (never blocks on the model); its events reach the listeners."""
        ...

    def submit_alternatives(self, request: GenerationRequest, n: int) -> list[RequestHandle]:
        """N sampled replies to one prompt, ids `{request_id}.{i}` (see
        GenerationRequest.alternatives); capabilities.shared_prefill_alternatives says whether
        they share one prefill."""
        ...

    def cancel(self, request_id: str) -> None:
        """Stop a request (within one decode step); unknown ids are ignored."""
        ...

    def cancel_all(self) -> None: ...

    # ----- conversations' caches -------------------------------------------------------------
    def peek_prefix(self, request: GenerationRequest) -> PrefixPeek | None:
        """How much of this request's prompt a turn sent now would find cached (any thread;
        for the wait forecast); None where that is not known (a remote server, no model)."""
        ...

    def count_tokens(self, text: str) -> int | None:
        """How many tokens the loaded model reads `text` as, inside a message (any thread);
        None where not known (a remote server, no model)."""
        ...

    def keep_alternative(self, conversation_id: str, index: int, count: int) -> None:
        """The user kept alternative `index` of `count`: its cached prefix becomes the
        conversation's own."""
        ...

    def drop_conversation(self, conversation_id: str) -> None:
        """Forget a conversation's cached prefix (the chat was deleted)."""
        ...

    # ----- events ------------------------------------------------------------------------------
    def add_listener(self, listener: Listener) -> None:
        """Call listener with every event, on the backend's own thread (keep it quick)."""
        ...

    def remove_listener(self, listener: Listener) -> None: ...
