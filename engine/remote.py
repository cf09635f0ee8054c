"""A remote OpenAI-compatible backend (vLLM, SGLang, llama.cpp server, Ollama, `phasewise
serve`) with the local Engine's API and the same events and metrics.

Every stamp is taken here, at the client, on time.perf_counter_ns() the moment a chunk is
read, so TTFT and ITL mean what they mean for the local engine (and in vLLM's
benchmark_serving): TTFT = first content chunk - submit; ITL = gaps between content chunks.
A server may pack several tokens into one chunk; output_tokens then comes from `usage`.
Prompt and cached token counts come from `usage` (`prompt_tokens_details.cached_tokens`)
when the server sends them and are marked unknown otherwise.

The HTTP streams run on an asyncio loop: by default one in this backend's own thread (the CLI,
headless use); in the GUI, the caller's loop (qasync's loop on the Qt event loop), where events
reach listeners on the GUI thread. Cancelling a request cancels its task, which closes the
stream at once, even while the server is silent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import httpx

from engine.errors import ModelLoadError, PhasewiseError
from engine.events import (
    EngineEvent,
    FinishReason,
    GenerationResult,
    ModelInfo,
    ModelLoaded,
    ModelLoadFailed,
    ModelLoading,
    PrefillStarted,
    RequestFailed,
    RequestFinished,
    RequestQueued,
    TokenEmitted,
)
from engine.listeners import EventSource
from engine.metrics import RequestMetrics, RequestTimeline, compute_metrics
from engine.params import GenerationRequest, SamplingParams
from engine.protocol import Backend, Capabilities, PrefixPeek, RequestHandle

log = logging.getLogger(__name__)
now_ns = time.perf_counter_ns  # the clock every engine event is stamped on
API_KEY_ENV = "PHASEWISE_API_KEY"
KEYRING_SERVICE = "phasewise"
REMOTE_SPEC = "remote"  # the model spec that selects a remote backend in BackendRouter
# Servers that do not say their context (Ollama) still cap max_tokens themselves.
UNKNOWN_CONTEXT = 32768
NO_USAGE_NOTICE = "the server sent no usage: prompt and cached token counts are unknown"
NO_DRAFT_MESSAGE = "a draft model runs on the local engine, not on a remote backend"
# The server decodes its own way and owns its cache: alternatives are N plain requests.
REMOTE_CAPABILITIES = Capabilities()


class RemoteError(PhasewiseError):
    """A remote request failed; str() is one line for the chat."""


# ----- configuration -------------------------------------------------------------------------
def normalize_base_url(url: str) -> str:
    """'http://host:8000' or 'http://host:8000/v1/' -> 'http://host:8000/v1'."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteError(f"backend URL must start with http:// or https:// (got {url!r})")
    return url if parts.path else f"{url}/v1"


def resolve_api_key(base_url: str) -> str | None:
    """The key for a backend: $PHASEWISE_API_KEY, else the OS keyring, else none."""
    key = os.environ.get(API_KEY_ENV)
    if key:
        return key
    try:
        import keyring

        return keyring.get_password(KEYRING_SERVICE, normalize_base_url(base_url))
    except Exception:  # no keyring backend on this machine: run without a key
        return None


def store_api_key(base_url: str, key: str) -> None:
    """Keep a backend's key in the OS keyring (never in settings files)."""
    import keyring

    keyring.set_password(KEYRING_SERVICE, normalize_base_url(base_url), key)


@dataclass(frozen=True)
class RemoteConfig:
    base_url: str
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = field(default=None, repr=False)  # never printed or logged
    connect_timeout_s: float = 10.0
    stall_timeout_s: float = 60.0  # no byte for this long: the server is stalled

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_url", normalize_base_url(self.base_url))

    @property
    def host(self) -> str:
        return urlsplit(self.base_url).netloc


# ----- wire format ------------------------------------------------------------------------------
def request_body(request: GenerationRequest, model: str) -> dict[str, Any]:
    """The /v1/chat/completions body; non-OpenAI knobs only when the user moved them."""
    p: SamplingParams = request.params
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": m.role, "content": m.content} for m in request.messages],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": p.temperature,
        "top_p": p.top_p,
        "max_tokens": p.max_tokens,
    }
    if p.seed is not None:
        body["seed"] = p.seed
    if p.stop:
        body["stop"] = list(p.stop)
    extras = {"top_k": (p.top_k, 0), "min_p": (p.min_p, 0.0),
              "repetition_penalty": (p.repetition_penalty, 1.0)}
    body.update({k: v for k, (v, off) in extras.items() if v != off})
    return body


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The data payloads of a server-sent event stream (comments and other fields skipped)."""
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def parse_chunk(data: str) -> dict[str, Any]:
    try:
        chunk = json.loads(data)
    except ValueError:
        raise RemoteError(f"malformed event from the server: {data[:60]!r}") from None
    if not isinstance(chunk, dict):
        raise RemoteError(f"malformed event from the server: {data[:60]!r}")
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise RemoteError(f"server error mid-reply: {one_line(str(message))}")
    return chunk


def one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


async def http_error(response: httpx.Response) -> RemoteError:
    """A one-line reason for a non-200 answer (the server's own message when it sent one)."""
    await response.aread()
    try:
        detail = response.json().get("error", {})
        detail = detail.get("message", "") if isinstance(detail, dict) else str(detail)
    except (ValueError, AttributeError):
        detail = response.text
    code = response.status_code
    if code in (401, 403):
        return RemoteError(f"the server refused the API key (HTTP {code}): set {API_KEY_ENV} "
                           "or store the key in the keyring")
    suffix = f": {one_line(detail)}" if detail.strip() else ""
    return RemoteError(f"the server answered HTTP {code}{suffix}")


def transport_error(exc: httpx.HTTPError, config: RemoteConfig) -> RemoteError:
    """httpx's exception -> one line that says what to check."""
    if isinstance(exc, httpx.ConnectTimeout):
        return RemoteError(f"cannot reach {config.base_url}: no answer in "
                           f"{config.connect_timeout_s:g} s")
    if isinstance(exc, httpx.ConnectError):
        reason = one_line(str(exc)) or "connection refused"
        return RemoteError(f"cannot reach {config.base_url}: {reason}")
    if isinstance(exc, httpx.ReadTimeout):
        return RemoteError(f"the server stalled: no data for {config.stall_timeout_s:g} s")
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return RemoteError(f"the connection broke mid-reply: {one_line(str(exc)) or 'closed'}")
    return RemoteError(f"request to {config.base_url} failed: {type(exc).__name__}: "
                       f"{one_line(str(exc))}")


# ----- metrics ---------------------------------------------------------------------------------
def remote_metrics(timeline: RequestTimeline, usage: dict[str, Any] | None) -> RequestMetrics:
    """compute_metrics on the client's stamps, with the server's token counts when sent."""
    usage = usage or {}
    prompt = usage.get("prompt_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    m = compute_metrics(timeline, prompt_tokens=int(prompt or 0),
                        cached_tokens=int(cached or 0) if prompt is not None else 0,
                        parameters=0, weight_bytes_per_step=0, cache_miss_reason="unknown")
    m = replace(m, prompt_tokens_known=prompt is not None,
                cached_tokens_known=prompt is not None and cached is not None)
    completion = usage.get("completion_tokens")
    if isinstance(completion, int) and completion > m.output_tokens and m.decode_s > 0:
        # Several tokens per chunk: rates use the real count, ITL stays per chunk.
        m = replace(m, output_tokens=completion, decode_tok_s=(completion - 1) / m.decode_s,
                    tpot_s=(m.e2e_s - m.ttft_s) / (completion - 1))
    return m


# ----- a shared loop --------------------------------------------------------------------------
def close_async_generators_on(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Have async generators dropped unfinished on this thread closed by a task on `loop`.

    asyncio's own loops install this hook in run_forever(); qasync's does not. Without it an
    HTTP stream left early (cancel, error, [DONE]) is closed by the garbage collector outside
    any task, and httpx's cleanup fails. Returns a function that restores the old hooks."""
    old = sys.get_asyncgen_hooks()

    def finalize(agen: Any) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(loop.create_task, agen.aclose())

    sys.set_asyncgen_hooks(firstiter=old.firstiter, finalizer=finalize)
    return lambda: sys.set_asyncgen_hooks(*old)


# ----- one request ----------------------------------------------------------------------------
@dataclass
class _Reply:
    """What one streamed reply has produced so far."""

    timeline: RequestTimeline
    parts: list[str] = field(default_factory=list)
    finish: FinishReason | None = None
    usage: dict[str, Any] | None = None
    done: bool = False  # [DONE] arrived


@dataclass
class _Job:
    handle: RequestHandle
    reply: _Reply
    cancel: threading.Event
    # Set by the task itself once it runs: only a running coroutine can be cancelled into
    # its except clauses (one cancelled before its first step would never report).
    task: asyncio.Task[None] | None = None


class _RemoteHandle(RequestHandle):
    """A RequestHandle whose cancel also closes the HTTP stream."""

    def __init__(self, request: GenerationRequest, cancel: threading.Event,
                 on_cancel: Callable[[str], None]) -> None:
        super().__init__(request, cancel)
        self._on_cancel = on_cancel

    def cancel(self) -> None:
        self._on_cancel(self.request_id)


class RemoteEngine(EventSource, Backend):
    """Engine's API over an OpenAI-compatible server; requests may run concurrently.

    loop: run the HTTP streams on this asyncio loop (the GUI's qasync loop) instead of a
    loop in a thread of our own. Nothing here then blocks the loop's thread: shutdown() from
    it only schedules the closing (see `closed`).
    """

    def __init__(self, config: RemoteConfig,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.config = config
        self._init_listeners()
        self._own_loop = loop is None
        self._loop = loop or asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="phasewise-remote",
                                        daemon=True) if self._own_loop else None
        self._client: httpx.AsyncClient | None = None
        self._info: ModelInfo | None = None
        self._jobs: dict[str, _Job] = {}
        self._tasks: set[asyncio.Task[Any]] = set()  # every task we made; touched on the loop only
        self._loading: set[asyncio.Task[Any]] = set()  # model-list requests that have begun
        self._lock = threading.Lock()
        self._started = False
        self._shut = False
        self._closing = False  # the loop has begun closing: start no more tasks
        self._closing_task: asyncio.Task[None] | None = None
        self.closed = threading.Event()
        """Set once every task has ended and the connections are closed."""
        self.last_load_error: str | None = None

    # ----- lifecycle ---------------------------------------------------------------------
    def start(self) -> RemoteEngine:
        if self._thread is not None:
            self._thread.start()
        self._started = True
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel everything and close the connections (and our own loop's thread).

        On a shared loop: from the loop's own thread this only schedules the closing (a
        wait there would deadlock); from another thread it waits; after the loop stopped
        (the GUI's exit) it runs the loop until the closing is done, as asyncio.run does."""
        if not self._started or self.closed.is_set():
            return
        if not self._shut:
            self._shut = True
            self.cancel_all()
            if self._own_loop:
                asyncio.run_coroutine_threadsafe(self._aclose(), self._loop).result(timeout)
                self._loop.call_soon_threadsafe(self._loop.stop)
                assert self._thread is not None  # an own loop runs in our thread
                self._thread.join(timeout)
                self._loop.close()
                return
            if self._on_loop_thread():
                self._closing_task = self._spawn(self._aclose())
                return
            if self._loop.is_running():
                asyncio.run_coroutine_threadsafe(self._aclose(), self._loop).result(timeout)
                return
        # The shared loop has stopped (the GUI is exiting): run it until the closing is done.
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.run_until_complete(self._closing_task or self._aclose())

    def _on_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False


    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The asyncio loop the HTTP streams run on."""
        return self._loop

    @property
    def model_info(self) -> ModelInfo | None:
        return self._info

    @property
    def prefix_cache(self) -> None:
        """The server keeps its own cache; nothing to inspect here."""
        return None

    @property
    def is_remote(self) -> bool:
        return True

    @property
    def capabilities(self) -> Capabilities:
        return REMOTE_CAPABILITIES

    # ----- commands (any thread) ---------------------------------------------------------
    def load_model(self, spec: str = REMOTE_SPEC, **options: Any) -> threading.Event:
        """Ask the server which models it has and pick ours (model=NAME switches to another
        model on the same server; if it has none such, the old one stays); events report the
        outcome. Local-load options (device, dtype, kernel) mean nothing here and are ignored."""
        done = threading.Event()
        self._loop.call_soon_threadsafe(self._start_load, done, options.get("model") or None)
        return done

    def load_model_sync(self, spec: str = REMOTE_SPEC, timeout: float | None = None,
                        **options: Any) -> ModelInfo:
        if self._on_loop_thread():
            raise RemoteError("load_model_sync would block the loop that does the loading: "
                              "use load_model and its events")
        self.last_load_error = None
        self.load_model(spec, **options).wait(timeout)
        if self.last_load_error is not None or self._info is None:
            raise ModelLoadError(self.last_load_error or "the backend did not answer")
        return self._info

    def submit(self, request: GenerationRequest) -> RequestHandle:
        cancel = threading.Event()
        handle = _RemoteHandle(request, cancel, self.cancel)
        job = _Job(handle, _Reply(RequestTimeline(submitted_ns=now_ns())), cancel)
        with self._lock:
            self._jobs[request.request_id] = job
        self._deliver(job, RequestQueued(request.request_id, job.reply.timeline.submitted_ns))
        self._loop.call_soon_threadsafe(self._start_job, job)
        return handle

    def submit_alternatives(self, request: GenerationRequest, n: int) -> list[RequestHandle]:
        """N plain requests (the server prefills each; it may cache the shared prompt)."""
        return [self.submit(r) for r in request.alternatives(n)]

    def load_draft(self, spec: str | None, **_options: Any) -> threading.Event:
        """Refused (capabilities.draft_model is False): ModelLoadFailed(draft=True) reports
        it; dropping (None) has nothing to drop."""
        done = threading.Event()
        if spec is None:
            done.set()
        else:
            self._loop.call_soon_threadsafe(self._refuse_draft, done)
        return done

    def load_draft_sync(self, spec: str | None, timeout: float | None = None,
                        **_options: Any) -> None:
        if spec is not None:
            raise ModelLoadError(NO_DRAFT_MESSAGE)

    def cancel(self, request_id: str) -> None:
        """Stop a request now: its task is cancelled, which closes the stream. One that has
        not started yet sees the flag when it starts and ends as cancelled."""
        with self._lock:
            job = self._jobs.get(request_id)
        if job is not None:
            job.cancel.set()
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._cancel_task, job)

    def cancel_all(self) -> None:
        with self._lock:
            ids = list(self._jobs)
        for request_id in ids:
            self.cancel(request_id)

    def drop_conversation(self, conversation_id: str) -> None:
        """The server owns its cache; there is nothing to drop here."""

    def keep_alternative(self, conversation_id: str, index: int, count: int) -> None:
        """The server owns its cache; there is nothing to adopt here."""

    def peek_prefix(self, request: GenerationRequest) -> PrefixPeek | None:
        """The server owns its cache: what it holds is not known here."""
        return None

    def count_tokens(self, text: str) -> int | None:
        """The server's tokenizer is not here."""
        return None

    # ----- the loop thread ---------------------------------------------------------------
    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _start_load(self, done: threading.Event, model: str | None) -> None:
        if self._closing:
            done.set()
            return
        self._spawn(self._load(done, model))

    def _refuse_draft(self, done: threading.Event) -> None:
        self._broadcast(ModelLoadFailed(now_ns(), NO_DRAFT_MESSAGE, True))
        done.set()

    def _start_job(self, job: _Job) -> None:
        if self._closing:  # submitted while shutting down: it ends before it began
            job.cancel.set()
        self._spawn(self._serve(job))

    @staticmethod
    def _cancel_task(job: _Job) -> None:
        if job.task is not None:
            job.task.cancel()

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:  # created on the loop thread, used only there
            timeout = httpx.Timeout(self.config.stall_timeout_s,
                                    connect=self.config.connect_timeout_s)
            headers = ({"Authorization": f"Bearer {self.config.api_key}"}
                       if self.config.api_key else {})
            self._client = httpx.AsyncClient(timeout=timeout, headers=headers, verify=True)
        return self._client

    async def _aclose(self) -> None:
        """End every task (each reports its outcome), then close the connections."""
        self._closing = True
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:  # one not started yet sees the flag and ends as cancelled
            job.cancel.set()
            self._cancel_task(job)
        for task in self._loading:
            task.cancel()
        await asyncio.gather(*(t for t in self._tasks if t is not asyncio.current_task()),
                             return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self.closed.set()

    async def _load(self, done: threading.Event, model: str | None) -> None:
        if self._closing:
            done.set()
            return
        task = asyncio.current_task()
        assert task is not None
        self._loading.add(task)
        self.last_load_error = None
        self._broadcast(ModelLoading(now_ns(), f"connecting to {self.config.base_url}"))
        config = replace(self.config, model=model) if model else self.config
        try:
            self._info = await self._fetch_model_info(config)
            self.config = config
        except RemoteError as exc:
            self.last_load_error = str(exc)
            self._broadcast(ModelLoadFailed(now_ns(), str(exc)))
        else:
            self._broadcast(ModelLoaded(now_ns(), self._info, 0.0))
        finally:
            self._loading.discard(task)
            done.set()

    async def _fetch_model_info(self, config: RemoteConfig) -> ModelInfo:
        try:
            response = await self._http().get(f"{config.base_url}/models")
        except httpx.HTTPError as exc:
            raise transport_error(exc, config) from None
        if response.status_code != 200:
            raise await http_error(response)
        try:
            cards = response.json()["data"]
        except (ValueError, KeyError, TypeError):
            raise RemoteError("the server's model list is not OpenAI-shaped") from None
        return model_info(config, cards)

    async def _serve(self, job: _Job) -> None:
        job.task = asyncio.current_task()
        error: str | None = None
        try:
            if job.cancel.is_set():
                raise asyncio.CancelledError
            await self._stream(job)
        except asyncio.CancelledError:
            job.reply.finish = "cancelled"
        except PhasewiseError as exc:
            error = str(exc)
        except Exception as exc:  # never lose a reply to a bug: report it in the chat
            log.exception("remote request failed")
            error = f"remote request failed: {type(exc).__name__}: {one_line(str(exc))}"
        finally:
            with self._lock:
                self._jobs.pop(job.handle.request_id, None)
        self._finish(job, error)

    async def _stream(self, job: _Job) -> None:
        request, reply = job.handle.request, job.reply
        if request.prompt_token_ids is not None:
            raise RemoteError("a remote backend takes chat messages, not token ids")
        request.validate()
        if self._info is None:
            raise RemoteError("the backend is not connected yet")
        body = request_body(request, self._info.name)
        url = f"{self.config.base_url}/chat/completions"
        reply.timeline.prefill_start_ns = now_ns()
        self._deliver(job, PrefillStarted(request.request_id, reply.timeline.prefill_start_ns,
                                          0, 0, "unknown"))  # counts arrive with usage
        try:
            async with self._http().stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    raise await http_error(response)
                kind = response.headers.get("content-type", "")
                if "text/event-stream" not in kind:
                    raise RemoteError(f"the server did not stream events (got {kind or 'no'} "
                                      "content type)")
                async for data in sse_data(response.aiter_lines()):
                    if data.strip() == "[DONE]":
                        reply.done = True
                        break
                    self._apply(job, parse_chunk(data))
        except httpx.HTTPError as exc:
            raise transport_error(exc, self.config) from None
        if not reply.done and reply.finish is None:
            raise RemoteError("the server closed the stream before the reply ended")

    def _apply(self, job: _Job, chunk: dict[str, Any]) -> None:
        """One chunk: stamp and emit its text, note its finish reason and usage."""
        reply = job.reply
        if isinstance(chunk.get("usage"), dict):
            reply.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") or ""
            if text:
                t = now_ns()
                if not reply.timeline.token_ns:
                    reply.timeline.first_logits_ns = t
                reply.timeline.token_ns.append(t)
                reply.parts.append(text)
                self._deliver(job, TokenEmitted(job.handle.request_id, t,
                                                len(reply.timeline.token_ns) - 1, -1, text))
            if choice.get("finish_reason"):
                reply.finish = "length" if choice["finish_reason"] == "length" else "stop"

    def _finish(self, job: _Job, error: str | None) -> None:
        reply, request_id = job.reply, job.handle.request_id
        reply.timeline.done_ns = now_ns()
        text = "".join(reply.parts)
        if error is not None and not text:
            self._deliver(job, RequestFailed(request_id, reply.timeline.done_ns, error))
            return
        finish: FinishReason = "error" if error else (reply.finish or "stop")
        notice = NO_USAGE_NOTICE if reply.usage is None and finish in ("stop", "length") \
            else None
        result = GenerationResult(
            request_id=request_id, text=text, finish_reason=finish, token_ids=[],
            prompt_token_ids=[], metrics=remote_metrics(reply.timeline, reply.usage),
            model=self._info, error=error, notice=notice)
        self._deliver(job, RequestFinished(request_id, reply.timeline.done_ns, result))

    def _deliver(self, job: _Job, event: EngineEvent) -> None:
        job.handle._deliver(event)
        self._broadcast(event)


def model_info(config: RemoteConfig, cards: list[dict[str, Any]]) -> ModelInfo:
    """Our ModelInfo for the configured (or first) model in a /v1/models list."""
    ids = [str(c.get("id")) for c in cards if isinstance(c, dict)]
    if not ids:
        raise RemoteError(f"{config.base_url} lists no models")
    name = config.model or ids[0]
    if name not in ids:
        raise RemoteError(f"{config.base_url} has no model {name!r} (it has: "
                          f"{', '.join(ids[:5])})")
    card = next(c for c in cards if str(c.get("id")) == name)
    context = next((int(card[k]) for k in ("max_model_len", "context_length", "context_window")
                    if isinstance(card.get(k), int)), UNKNOWN_CONTEXT)
    return ModelInfo(name=name, source="remote", path=config.base_url,
                     device=f"remote {config.host}", dtype="n/a", context_length=context,
                     parameters=0, weight_bytes_per_step=0, kernel="remote")
