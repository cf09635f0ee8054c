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
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from engine import runtimes
from engine.core.batch import alternative_cache_key, batchable
from engine.core.ledger import KvLedger
from engine.core.prompt import prepare_prompt
from engine.core.reply import ReplyJob
from engine.core.runtime import Runtime
from engine.core.snapshots import DEFAULT_BUDGET_BYTES as DEFAULT_SNAPSHOT_BUDGET
from engine.core.snapshots import KvShelf
from engine.core.speculative import TokenProposer
from engine.errors import ContextOverflowError, ModelLoadError, PhasewiseError, one_line
from engine.events import (
    DraftModelChanged,
    EngineEvent,
    GenerationResult,
    ModelInfo,
    ModelLoaded,
    ModelLoadFailed,
    ModelLoading,
    ModelLoadProgress,
    RequestFailed,
    RequestFinished,
    RequestQueued,
)
from engine.listeners import EventSource
from engine.metrics import RequestTimeline, now_ns
from engine.params import GenerationRequest
from engine.protocol import (
    SPECULATIVE_METHODS,
    Backend,
    Capabilities,
    PrefixPeek,
    RequestHandle,
)

log = logging.getLogger(__name__)
SHELF_CLOSE_TIMEOUT_S = 10.0  # at quit, snapshots still being written get this long


LOCAL_CAPABILITIES = Capabilities(
    shared_prefill_alternatives=True, speculative=SPECULATIVE_METHODS, draft_model=True,
    sampler_view=True, prefix_cache_ledger=True, conversation_cache=True,
    drop_oldest_turns=True,
)

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


def default_cache_budget(device: str) -> int:
    """Bytes of KV cache the prefix pool may keep: 1 GiB on CPU, 25% of free GPU memory."""
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info()
        return int(free * 0.25)
    return 1 << 30


@dataclass
class _Job:
    handle: RequestHandle
    timeline: RequestTimeline
    cancel: threading.Event

    @property
    def request(self) -> GenerationRequest:
        return self.handle.request


@dataclass
class _Group:
    """Alternatives of one prompt: admitted together, so they share one prefill."""

    jobs: list[_Job]


# ----- the inbox's commands (requests travel as _Job / _Group) ---------------------------------
@dataclass(frozen=True)
class LoadModel:
    """Load a model (options: runtimes.load's keywords: engine, kernel, device, ...)."""

    spec: str
    options: dict[str, Any]
    done: threading.Event


@dataclass(frozen=True)
class LoadDraft:
    """Load a draft model for speculative="draft" requests; spec None drops it."""

    spec: str | None
    options: dict[str, Any]
    done: threading.Event


@dataclass(frozen=True)
class DropConversation:
    """Forget a conversation's cached prefix."""

    conversation_id: str


@dataclass(frozen=True)
class AdoptCache:
    """Make source's cached prefix target's own (a kept alternative)."""

    source: str
    target: str


@dataclass(frozen=True)
class Shutdown:
    """Stop the engine thread after what is queued before it."""


CacheCommand = DropConversation | AdoptCache


def _done_ns(job: ReplyJob) -> int:
    """The done event's stamp: the one the metrics' e2e ends at (the remote backend's too), so
    a listener working from the events' stamps gets the engine's numbers."""
    return job.timeline.done_ns or now_ns()


class Engine(EventSource, Backend):
    """One long-lived worker thread that owns the model; everything else talks to it here."""

    def __init__(self, cache_budget_bytes: int | None = None, *,
                 snapshot_dir: Path | None = None,
                 snapshot_budget_bytes: int = DEFAULT_SNAPSHOT_BUDGET) -> None:
        """snapshot_dir: where chats' KV snapshots are kept across restarts (None: nowhere)."""
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._init_listeners()
        self._thread = threading.Thread(target=self._run, name="phasewise-engine", daemon=True)
        self._runtime: Runtime | None = None  # the model, on whichever runtime loaded it
        self._prefix_cache: KvLedger[Any] | None = None
        # for speculative="draft", on the model's runtime; dropped on model change
        self._draft: TokenProposer | None = None
        self._cache_budget = cache_budget_bytes
        self._snapshot_dir, self._snapshot_budget = snapshot_dir, snapshot_budget_bytes
        self._active: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()  # shutdown() was called: a model load gives up
        self.last_load_error: str | None = None

    # ----- lifecycle -------------------------------------------------------------------
    def start(self) -> Engine:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel everything, stop the thread, free the model. A model load under way stops at
        its next stage or converted tensor; what cannot stop within `timeout` is left to
        engine.threads.settle."""
        self._closing.set()
        self.cancel_all()
        self._inbox.put(Shutdown())
        if self._thread.is_alive():
            self._thread.join(timeout)


    @property
    def model_info(self) -> ModelInfo | None:
        return self._runtime.info if self._runtime else None

    @property
    def is_remote(self) -> bool:
        return False

    @property
    def capabilities(self) -> Capabilities:
        """Alternatives share one prefill where the model's cache batches row-wise (plain
        full-attention layers); otherwise they run one after another. Both local runtimes
        speculate by prompt lookup and with a draft model (a GGUF for llama.cpp)."""
        runtime = self._runtime
        batching = runtime is not None and runtime.supports_batching
        return replace(LOCAL_CAPABILITIES, shared_prefill_alternatives=batching)

    @property
    def prefix_cache(self) -> KvLedger[Any] | None:
        """For tests and benchmarks; read it only while the engine is idle."""
        return self._prefix_cache

    # ----- commands (any thread) ---------------------------------------------------------
    def load_model(self, spec: str = "default", **options: Any) -> threading.Event:
        """Queue a model load; on failure the old model stays. Returns an event set when done.

        options: load_model's keywords, plus kernel="auto" (measure and pick the fastest
        decode path) or a name from engine.runtimes.torch.kernels.KERNELS, and engine="auto" |
        "torch" | "llama.cpp" (engine.runtimes: auto runs a GGUF on llama.cpp when there is no
        GPU)."""
        done = threading.Event()
        self._inbox.put(LoadModel(spec, options, done))
        return done

    def load_model_sync(self, spec: str = "default", timeout: float | None = None,
                        **options: Any) -> ModelInfo:
        """Load and wait; raise ModelLoadError with the reason if it failed."""
        self.last_load_error = None
        self.load_model(spec, **options).wait(timeout)
        if self.last_load_error is not None:
            raise ModelLoadError(self.last_load_error)
        assert self._runtime is not None
        return self._runtime.info

    def load_draft_sync(self, spec: str | None, timeout: float | None = None,
                        **options: Any) -> None:
        """Load a draft model for speculative="draft" requests after the model loads (None
        drops it). It must share the model's vocabulary; a new model drops it. options:
        load_model's keywords and kernel. Raise ModelLoadError with the reason on failure
        (the previous draft, if any, stays)."""
        self.last_load_error = None
        self.load_draft(spec, **options).wait(timeout)
        if self.last_load_error is not None:
            raise ModelLoadError(self.last_load_error)

    def load_draft(self, spec: str | None, **options: Any) -> threading.Event:
        """Queue a draft model load (None drops it); the outcome arrives as DraftModelChanged
        or ModelLoadFailed(draft=True). Returns an event set when done."""
        done = threading.Event()
        self._inbox.put(LoadDraft(spec, options, done))
        return done

    def submit(self, request: GenerationRequest) -> RequestHandle:
        job = self._new_job(request)
        if not self._refused_after_shutdown([job]):
            self._inbox.put(job)
        return job.handle

    def submit_alternatives(self, request: GenerationRequest, n: int) -> list[RequestHandle]:
        """N sampled replies to one prompt that share one prefill; each has its own request
        id, events, seed and cancel (see GenerationRequest.alternatives)."""
        jobs = [self._new_job(r) for r in request.alternatives(n)]
        if not self._refused_after_shutdown(jobs):
            self._inbox.put(_Group(jobs))
        return [job.handle for job in jobs]

    def _refused_after_shutdown(self, jobs: list[_Job]) -> bool:
        """After shutdown() no thread serves the inbox: fail the jobs now rather than leave
        their callers waiting for a reply that never comes."""
        if not self._closing.is_set():
            return False
        for job in jobs:
            self._end_job(job, None, PhasewiseError("the engine has shut down"))
        return True

    def _new_job(self, request: GenerationRequest) -> _Job:
        cancel = threading.Event()
        job = _Job(RequestHandle(request, cancel), RequestTimeline(submitted_ns=now_ns()), cancel)
        with self._lock:
            self._active[request.request_id] = job
        self._deliver(job, RequestQueued(request.request_id, job.timeline.submitted_ns))
        return job

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
        self._inbox.put(DropConversation(conversation_id))

    def keep_alternative(self, conversation_id: str, index: int, count: int) -> None:
        """The user kept alternative `index` of `count`: its cached prefix becomes the
        conversation's own and the other alternatives' entries are dropped."""
        siblings = [alternative_cache_key(conversation_id, i) for i in range(1, count)]
        if index:
            self._inbox.put(AdoptCache(alternative_cache_key(conversation_id, index),
                                       conversation_id))
        for key in siblings:
            self._inbox.put(DropConversation(key))

    def peek_prefix(self, request: GenerationRequest) -> PrefixPeek | None:
        """Tokenizes the prompt on the calling thread (the tokenizers are safe to share) and
        asks the ledger's published index: the engine thread is never waited for."""
        runtime, pool = self._runtime, self._prefix_cache
        if runtime is None or pool is None:
            return None
        try:
            prompt = prepare_prompt(runtime, request)
        except ContextOverflowError as exc:  # too long: the count says so, nothing is cached
            return PrefixPeek(exc.prompt_tokens, 0)
        except PhasewiseError:
            return None
        cached, from_disk = pool.peek(request.conversation_id, prompt.ids) \
            if request.reuse_cache else (0, False)
        return PrefixPeek(len(prompt.ids), cached, from_disk)

    def count_tokens(self, text: str) -> int | None:
        runtime = self._runtime
        if runtime is None:
            return None
        # As message text is encoded: no BOS, special tokens' text kept as text.
        ids = runtime.tokenizer(text, add_special_tokens=False, split_special_tokens=True)
        return len(ids["input_ids"])

    # ----- engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        item: Any = None  # an item the batch loop took from the inbox but could not serve
        while True:
            if item is None:
                self._shelve_while_idle()
                self._settle_while_idle()
                self._set_idle(True)
            item = self._inbox.get() if item is None else item
            self._set_idle(False)
            if isinstance(item, Shutdown):
                break
            current, item = item, None
            try:
                if self._joins_batch(current):
                    item = self._serve_batch(current)
                elif isinstance(current, _Job):
                    self._serve(current)
                elif isinstance(current, _Group):
                    for job in current.jobs:
                        self._serve(job)
                else:
                    self._handle_command(current)
            except Exception:  # never let the engine thread die
                log.exception("engine thread error")
        self._close_shelf()
        self._prefix_cache = None
        self._draft = None
        if self._runtime is not None:
            self._runtime.close()
        self._runtime = None

    def _set_idle(self, idle: bool) -> None:
        """Tell the snapshot writer whether it may use the CPU (only while nothing runs)."""
        shelf = self._prefix_cache.shelf if self._prefix_cache is not None else None
        if shelf is not None:
            (shelf.engine_idle.set if idle else shelf.engine_idle.clear)()

    def _shelve_while_idle(self) -> None:
        """Snapshot chats to disk while nothing waits: one at a time, each time looking
        whether a request came in."""
        pool = self._prefix_cache
        while pool is not None and self._inbox.empty() and pool.shelve_one():
            pass

    def _settle_while_idle(self) -> None:
        """The runtime's idle work (huge pages for a llama.cpp model's memory), a few ms at a
        time, each time looking whether a request came in."""
        runtime = self._runtime
        try:
            while runtime is not None and self._inbox.empty() and runtime.idle_work():
                pass
        except Exception:  # only speed is lost: the model runs as it is
            log.exception("idle work failed")

    def _close_shelf(self) -> None:
        """Snapshot what is left and let it reach the disk (bounded: quitting must not hang;
        a model switch writes the old model's chats before its KV goes)."""
        pool = self._prefix_cache
        if pool is None or pool.shelf is None:
            return
        while pool.shelve_one():
            pass
        pool.shelf.close(SHELF_CLOSE_TIMEOUT_S)
        pool.shelf = None

    def _handle_command(self, item: Any) -> None:
        if isinstance(item, LoadModel):
            self._load(item)
        elif isinstance(item, LoadDraft):
            self._load_draft(item)
        elif isinstance(item, DropConversation) and self._prefix_cache:
            self._prefix_cache.drop(item.conversation_id)
        elif isinstance(item, AdoptCache) and self._prefix_cache:
            self._prefix_cache.adopt(item.source, item.target)

    def _joins_batch(self, item: Any) -> bool:
        if self._runtime is None or not self._runtime.supports_batching:
            return False
        if isinstance(item, _Group):
            return True
        return isinstance(item, _Job) and batchable(item.request, self._runtime.drafts_in_batch)

    def _serve_batch(self, first: _Job | _Group) -> Any:
        """Continuous batching: queued requests join between decode steps, finished ones
        leave, until the batch is empty. Returns the first inbox item that cannot join (a
        load, a speculative request, stop): nothing queued after it joins, keeping order."""
        assert self._runtime is not None and self._prefix_cache is not None
        batcher = self._runtime.new_batcher(self._prefix_cache, self._deliver, self._end_job)
        waiting: deque[_Job | _Group] = deque([first])
        blocked: Any = None
        try:
            while True:
                if blocked is None:
                    blocked = self._pull_joinable(waiting)
                while waiting and batcher.room >= len(_jobs(waiting[0])):
                    batcher.admit(_jobs(waiting.popleft()))
                if batcher.rows:
                    batcher.step()
                elif not waiting:
                    return blocked
        except Exception as exc:  # e.g. out of memory re-packing: no request may hang
            stranded = [row.job for row in batcher.rows]
            stranded += [job for item in waiting for job in _jobs(item)]
            for job in stranded:
                self._end_job(job, None, exc)
            return blocked

    def _pull_joinable(self, waiting: deque[Any]) -> Any:
        """Move queued requests that may join into `waiting`; return the first that may not."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return None
            if self._joins_batch(item):
                waiting.append(item)
            elif isinstance(item, CacheCommand):
                self._handle_command(item)
            else:
                return item

    def _end_job(self, job: ReplyJob, result: GenerationResult | None,
                 error: BaseException | None) -> None:
        """The batcher's report: a result, or the error that ended the request."""
        request_id = _queued(job).handle.request_id
        try:
            if result is not None:
                self._deliver(job, RequestFinished(request_id, _done_ns(job), result))
            else:
                message = self._failure_message(request_id, error)
                self._deliver(job, RequestFailed(request_id, now_ns(), message,
                                                 isinstance(error, ContextOverflowError)))
        finally:
            with self._lock:
                self._active.pop(request_id, None)

    def _load(self, cmd: LoadModel) -> None:
        start = time.perf_counter()
        try:
            runtime = runtimes.load(cmd.spec, progress=self._load_progress,
                                   conversion_progress=self._conversion_progress, **cmd.options)
        except PhasewiseError as exc:
            self._fail_load(str(exc), cmd)
            return
        except Exception as exc:
            self._fail_load(f"cannot load {cmd.spec}: {one_line(exc)}", cmd)
            return
        old, self._runtime = self._runtime, runtime
        if self._draft is not None:  # it was checked against the old model's vocabulary
            self._draft = None
            self._broadcast(DraftModelChanged(now_ns(), None))
        budget = self._cache_budget or default_cache_budget(runtime.info.device)
        self._close_shelf()
        self._prefix_cache = runtimes.switch_prefix_cache(self._prefix_cache, runtime, budget)
        if self._snapshot_dir is not None:
            self._prefix_cache.shelf = KvShelf(self._snapshot_dir, runtimes.snapshot_key(runtime),
                                               self._snapshot_budget)
        if old is not None:
            old.close()
        self._broadcast(ModelLoaded(now_ns(), runtime.info, time.perf_counter() - start))
        cmd.done.set()

    def _load_draft(self, cmd: LoadDraft) -> None:
        spec = cmd.spec
        # A draft runs on its model's runtime: the engine choice (the window passes its load
        # options to both) does not apply to it.
        options = {k: v for k, v in cmd.options.items() if k != "engine"}
        if spec is None:
            self._draft = None
            self._broadcast(DraftModelChanged(now_ns(), None))
        elif self._runtime is None:
            self._fail_load("load a model before its draft model", cmd, draft=True)
            return
        else:
            try:
                self._draft = self._runtime.load_draft(spec,
                                                  progress=self._load_progress, **options)
            except PhasewiseError as exc:
                self._fail_load(str(exc), cmd, draft=True)
                return
            except Exception as exc:
                self._fail_load(f"cannot load draft model {spec}: {one_line(exc)}", cmd,
                                draft=True)
                return
            info = self._draft.info
            self._broadcast(DraftModelChanged(now_ns(), info.name, info.kernel))
        cmd.done.set()

    def _load_progress(self, stage: str) -> None:
        self._give_up_if_closing()
        self._broadcast(ModelLoading(now_ns(), stage))

    def _conversion_progress(self, done: int, total: int) -> None:
        """A GGUF converting for torch: a ModelLoadProgress at each whole percent."""
        self._give_up_if_closing()
        if total and (done == total or 100 * done // total != 100 * (done - 1) // total):
            self._broadcast(ModelLoadProgress(now_ns(), "converting GGUF", done, total))

    def _give_up_if_closing(self) -> None:
        """Called between a load's steps: after shutdown() nobody waits for the model, and the
        process must not end under a conversion (its staging folder is removed on the way)."""
        if self._closing.is_set():
            raise ModelLoadError("the engine is shutting down")

    def _fail_load(self, message: str, cmd: LoadModel | LoadDraft, *,
                   draft: bool = False) -> None:
        self.last_load_error = message
        self._broadcast(ModelLoadFailed(now_ns(), message, draft))
        cmd.done.set()

    def _serve(self, job: _Job) -> None:
        request_id = job.handle.request_id
        try:
            if self._runtime is None or self._prefix_cache is None:
                raise PhasewiseError("no model is loaded")
            session = self._runtime.new_session(self._prefix_cache, self._draft)
            result = session.run(job.handle.request, job.timeline, job.cancel,
                                 lambda ev: self._deliver(job, ev))
            self._deliver(job, RequestFinished(request_id, _done_ns(job), result))
        except Exception as exc:
            message = self._failure_message(request_id, exc)
            self._deliver(job, RequestFailed(request_id, now_ns(), message,
                                             isinstance(exc, ContextOverflowError)))
        finally:
            with self._lock:
                self._active.pop(request_id, None)

    def _failure_message(self, request_id: str, exc: BaseException | None) -> str:
        """The one line a failed request reports; out of memory also frees the cache."""
        if isinstance(exc, PhasewiseError):
            return str(exc)
        if exc is not None and is_out_of_memory(exc):
            log.warning("request %s ran out of memory; freeing the prefix cache", request_id)
            self._free_memory()
            return OUT_OF_MEMORY_MESSAGE
        log.error("request %s failed", request_id, exc_info=exc)
        return f"generation failed: {type(exc).__name__}: {exc}".splitlines()[0]

    def _free_memory(self) -> None:
        """After an out-of-memory error: drop every cached prefix and return freed blocks."""
        if self._prefix_cache is not None:
            self._prefix_cache.evict_all()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _deliver(self, job: ReplyJob, event: EngineEvent) -> None:
        _queued(job).handle._deliver(event)
        self._broadcast(event)


def _queued(job: ReplyJob) -> _Job:
    """A job a batch reports on: always one this engine queued (it admits nothing else)."""
    assert isinstance(job, _Job)
    return job


def _jobs(item: _Job | _Group) -> list[_Job]:
    return item.jobs if isinstance(item, _Group) else [item]
