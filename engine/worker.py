"""The engine thread: owns the model and KV caches, serves requests from a queue.

Callers submit requests and get a RequestHandle back; events flow out through listeners
(called on the engine thread: keep them quick, e.g. put on a queue or emit a Qt signal) and
through each handle's own event queue. Cancellation is cooperative, checked between steps.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import ModelLoadError, PhasewiseError
from engine.events import (
    EngineEvent,
    GenerationResult,
    ModelInfo,
    ModelLoaded,
    ModelLoadFailed,
    ModelLoading,
    RequestFailed,
    RequestFinished,
    RequestQueued,
)
from engine.generate import DecodeSession, now_ns, warm_up
from engine.kernels import AUTO, select_kernel
from engine.listeners import EventSource
from engine.loader import LoadedModel, load_model
from engine.metrics import RequestTimeline
from engine.params import GenerationRequest
from engine.prefix_cache import PrefixCache

log = logging.getLogger(__name__)
_STOP = object()


OUT_OF_MEMORY_MESSAGE = (
    "out of memory while generating; cached prompts were freed. Try again, or use a shorter "
    "chat, fewer max tokens or a smaller model"
)


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (a RuntimeError), the CPU allocator's RuntimeError, MemoryError."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def default_cache_budget(device_type: str) -> int:
    """Bytes of KV cache the prefix pool may keep: 1 GiB on CPU, 25% of free GPU memory."""
    if device_type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info()
        return int(free * 0.25)
    return 1 << 30


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


@dataclass
class _Job:
    handle: RequestHandle
    timeline: RequestTimeline
    cancel: threading.Event


@dataclass
class _LoadCommand:
    spec: str
    options: dict[str, Any]
    done: threading.Event


class Engine(EventSource):
    """One long-lived worker thread that owns the model; everything else talks to it here."""

    def __init__(self, cache_budget_bytes: int | None = None) -> None:
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._init_listeners()
        self._thread = threading.Thread(target=self._run, name="phasewise-engine", daemon=True)
        self._loaded: LoadedModel | None = None
        self._prefix_cache: PrefixCache | None = None
        self._cache_budget = cache_budget_bytes
        self._active: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self.last_load_error: str | None = None

    # ----- lifecycle -------------------------------------------------------------------
    def start(self) -> Engine:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel everything, stop the thread, free the model."""
        self.cancel_all()
        self._inbox.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)


    @property
    def model_info(self) -> ModelInfo | None:
        return self._loaded.info if self._loaded else None

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """For tests and benchmarks; read it only while the engine is idle."""
        return self._prefix_cache

    # ----- commands (any thread) ---------------------------------------------------------
    def load_model(self, spec: str = "default", **options: Any) -> threading.Event:
        """Queue a model load; on failure the old model stays. Returns an event set when done.

        options: load_model's keywords, plus kernel="auto" (measure and pick the fastest
        decode path) or a name from engine.kernels.KERNELS."""
        done = threading.Event()
        self._inbox.put(_LoadCommand(spec, options, done))
        return done

    def load_model_sync(self, spec: str = "default", timeout: float | None = None,
                        **options: Any) -> ModelInfo:
        """Load and wait; raise ModelLoadError with the reason if it failed."""
        self.last_load_error = None
        self.load_model(spec, **options).wait(timeout)
        if self.last_load_error is not None:
            raise ModelLoadError(self.last_load_error)
        assert self._loaded is not None
        return self._loaded.info

    def submit(self, request: GenerationRequest) -> RequestHandle:
        cancel = threading.Event()
        handle = RequestHandle(request, cancel)
        job = _Job(handle, RequestTimeline(submitted_ns=now_ns()), cancel)
        with self._lock:
            self._active[request.request_id] = job
        self._deliver(job, RequestQueued(request.request_id, job.timeline.submitted_ns))
        self._inbox.put(job)
        return handle

    def cancel(self, request_id: str) -> None:
        with self._lock:
            job = self._active.get(request_id)
        if job is not None:
            job.cancel.set()

    def cancel_all(self) -> None:
        with self._lock:
            jobs = list(self._active.values())
        for job in jobs:
            job.cancel.set()

    def drop_conversation(self, conversation_id: str) -> None:
        """Forget a conversation's cached prefix (e.g. the chat was deleted)."""
        self._inbox.put(("drop", conversation_id))

    # ----- engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._inbox.get()
            if item is _STOP:
                break
            try:
                if isinstance(item, _LoadCommand):
                    self._load(item)
                elif isinstance(item, _Job):
                    self._serve(item)
                elif isinstance(item, tuple) and item[0] == "drop" and self._prefix_cache:
                    self._prefix_cache.drop(item[1])
            except Exception:  # never let the engine thread die
                log.exception("engine thread error")
        self._loaded = None
        self._prefix_cache = None

    def _load(self, cmd: _LoadCommand) -> None:
        start = time.perf_counter()
        options = dict(cmd.options)
        kernel = options.pop("kernel", AUTO)
        try:
            loaded = load_model(cmd.spec, progress=self._load_progress, **options)
            loaded = select_kernel(loaded, kernel, progress=self._load_progress)
            self._broadcast(ModelLoading(now_ns(), "warming up"))
            warm_up(loaded)
        except PhasewiseError as exc:
            self._fail_load(str(exc), cmd)
            return
        except Exception as exc:
            self._fail_load(f"cannot load {cmd.spec}: {exc}".splitlines()[0], cmd)
            return
        had_model = self._loaded is not None
        self._loaded = loaded
        budget = self._cache_budget or default_cache_budget(loaded.device.type)
        if self._prefix_cache is None:
            self._prefix_cache = PrefixCache(loaded.model.config, budget)
        else:
            self._prefix_cache.reset(model_changed=had_model, config=loaded.model.config)
            self._prefix_cache.budget_bytes = budget
        self._broadcast(ModelLoaded(now_ns(), loaded.info, time.perf_counter() - start))
        cmd.done.set()

    def _load_progress(self, stage: str) -> None:
        self._broadcast(ModelLoading(now_ns(), stage))

    def _fail_load(self, message: str, cmd: _LoadCommand) -> None:
        self.last_load_error = message
        self._broadcast(ModelLoadFailed(now_ns(), message))
        cmd.done.set()

    def _serve(self, job: _Job) -> None:
        request_id = job.handle.request_id
        try:
            if self._loaded is None or self._prefix_cache is None:
                raise PhasewiseError("no model is loaded")
            session = DecodeSession(self._loaded, self._prefix_cache)
            result = session.run(job.handle.request, job.timeline, job.cancel,
                                 lambda ev: self._deliver(job, ev))
            self._deliver(job, RequestFinished(request_id, now_ns(), result))
        except PhasewiseError as exc:
            self._deliver(job, RequestFailed(request_id, now_ns(), str(exc)))
        except Exception as exc:
            if is_out_of_memory(exc):
                log.warning("request %s ran out of memory; freeing the prefix cache", request_id)
                self._free_memory()
                message = OUT_OF_MEMORY_MESSAGE
            else:
                log.exception("request %s failed", request_id)
                message = f"generation failed: {type(exc).__name__}: {exc}".splitlines()[0]
            self._deliver(job, RequestFailed(request_id, now_ns(), message))
        finally:
            with self._lock:
                self._active.pop(request_id, None)

    def _free_memory(self) -> None:
        """After an out-of-memory error: drop every cached prefix and return freed blocks."""
        if self._prefix_cache is not None:
            self._prefix_cache.evict_all()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _deliver(self, job: _Job, event: EngineEvent) -> None:
        job.handle._deliver(event)
        self._broadcast(event)

    def _broadcast(self, event: EngineEvent) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                log.exception("engine listener failed")

