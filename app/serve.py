"""`phasewise serve`: the local engine behind an OpenAI-compatible HTTP API.

Starlette routes on uvicorn. Every request goes to the one engine thread (requests queue
there and share its prefix cache); engine events reach the HTTP handlers through one
listener that hands each event to its request's asyncio queue on the server's loop.

Endpoints: GET /v1/models, POST /v1/chat/completions (plain or SSE streaming), GET /metrics
(Prometheus text). Loopback by default; with a token every endpoint needs
`Authorization: Bearer <token>`.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.errors import PhasewiseError
from engine.events import (
    EngineEvent,
    GenerationResult,
    RequestFailed,
    RequestFinished,
    TextFlushed,
    TokenEmitted,
)
from engine.params import ChatMessage, GenerationRequest, Role, SamplingParams
from engine.protocol import Backend

T = TypeVar("T")
ROLES: dict[str, Role] = {"system": "system", "developer": "system", "user": "user",
                          "assistant": "assistant"}
# Seconds; finer at the low end, where small models on a desktop live.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# The engine thread waits at most this long for a stream's first text to reach the socket
# (EventRouter._on_event says why); it is normally well under a millisecond.
FIRST_TEXT_HANDOFF_S = 0.05


class BadRequest(Exception):
    """An OpenAI-style 400: the message says which field is wrong."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse to expose the engine beyond this machine without a token."""
    if not is_loopback(host) and not token:
        raise PhasewiseError(
            f"refusing to serve on {host} without --token: anyone on the network could use "
            "this machine's model (use --host 127.0.0.1, or set --token)")


# ----- request mapping ----------------------------------------------------------------------
def message_text(content: Any) -> str:
    """OpenAI content is a string or a list of parts; only text parts are supported."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadRequest("only text content parts are supported")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    if content is None:
        return ""
    raise BadRequest("message content must be a string or a list of text parts")


def parse_messages(raw: Any) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list")
    messages = []
    for item in raw:
        if not isinstance(item, dict) or item.get("role") not in ROLES:
            raise BadRequest(f"each message needs a role in {sorted(ROLES)}")
        messages.append(ChatMessage(ROLES[item["role"]], message_text(item.get("content"))))
    return messages


def parse_stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("'stop' must be a non-empty string or a list of them")
    return tuple(stops)


def _field(body: dict[str, Any], key: str, default: Any) -> Any:
    value = body.get(key)
    return default if value is None else value


def parse_sampling(body: dict[str, Any], default_max_tokens: int) -> SamplingParams:
    """Map the OpenAI sampling fields; the engine caps max_tokens at the context anyway."""
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
    seed = body.get("seed")
    try:
        return SamplingParams(
            temperature=float(_field(body, "temperature", 1.0)),
            top_p=float(_field(body, "top_p", 1.0)),
            max_tokens=int(max_tokens),
            seed=None if seed is None else int(seed),
            stop=parse_stop(body.get("stop")),
        )
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"bad sampling value: {exc}") from None


def conversation_key(model: str, messages: list[ChatMessage]) -> str:
    """A stable key per API conversation: its model, system prompt and first user message.

    API clients resend the whole history each turn; keying the prefix cache on the opening
    lets turn N+1 reuse turn N's cache in place instead of copying it from the pool. Two
    chats with the same opening share a key, which only costs reuse, never correctness: the
    cache always checks the token prefix.
    """
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    end = users[0] + 1 if users else len(messages)
    opening = [(m.role, m.content) for m in messages[:end]]
    digest = hashlib.sha256(json.dumps([model, opening]).encode()).hexdigest()[:16]
    return f"api-{digest}"


def build_request(body: Any, model: str, default_max_tokens: int) -> GenerationRequest:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported")
    if body.get("tools"):
        raise BadRequest("tools are not supported")
    messages = parse_messages(body.get("messages"))
    request = GenerationRequest(
        messages=messages,
        params=parse_sampling(body, default_max_tokens),
        conversation_id=conversation_key(model, messages),
    )
    try:
        request.validate()
    except PhasewiseError as exc:
        raise BadRequest(str(exc)) from None
    return request


# ----- response shapes ----------------------------------------------------------------------
def usage_of(result: GenerationResult) -> dict[str, Any]:
    m = result.metrics
    return {
        "prompt_tokens": m.prompt_tokens,
        "completion_tokens": m.output_tokens,
        "total_tokens": m.prompt_tokens + m.output_tokens,
        "prompt_tokens_details": {"cached_tokens": m.cached_tokens},
    }


@dataclass
class Stamps:
    """perf_counter_ns stamps of what the HTTP layer adds around the engine's own times."""

    received_ns: int  # the handler started (the request's head was parsed)
    submitted_ns: int = 0  # handed to the engine
    engine_ns: int = 0  # the engine stamped the first text (or the end, without any)
    sent_ns: int = 0  # the bytes carrying it went to the socket

    def overhead_s(self) -> float:
        """The server's own share of what a client waits for its first text: before the
        engine had the request, and between the engine's stamp and the socket."""
        return ((self.submitted_ns - self.received_ns) + (self.sent_ns - self.engine_ns)) / 1e9


def server_timings(result: GenerationResult, stamps: Stamps) -> dict[str, float]:
    """The server's own stamps (a Phasewise extension), to compare with a client's view.
    ttft_s is the engine's (submit -> first token); server_overhead_s is what the HTTP layer
    added to it (Stamps.overhead_s), so a client can tell the server's share from the
    network's."""
    m = result.metrics
    return {"queue_s": m.queue_s, "prefill_s": m.prefill_s, "ttft_s": m.ttft_s,
            "e2e_s": m.e2e_s, "decode_tok_s": m.decode_tok_s,
            "server_overhead_s": stamps.overhead_s()}


def has_text(event: EngineEvent) -> bool:
    return isinstance(event, (TokenEmitted, TextFlushed)) and bool(event.text)


def finish_reason(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def failure_response(message: str) -> JSONResponse:
    crashed = message.startswith("generation failed")
    return JSONResponse(error_body(message, "server_error" if crashed else
                                   "invalid_request_error"), status_code=500 if crashed else 400)


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


# ----- waiting on the engine -------------------------------------------------------------------
class ClientGone(Exception):
    """The HTTP client disconnected before the reply was ready."""


async def first_event(queue: asyncio.Queue[EngineEvent], streaming: bool) -> EngineEvent:
    """The event a response starts from: the end of the request, or (streaming) its first
    token, so that a refused request still gets a real 4xx status."""
    starts = (TokenEmitted, TextFlushed) if streaming else ()
    while True:
        event = await queue.get()
        if isinstance(event, (*starts, RequestFinished, RequestFailed)):
            return event


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await work, or raise ClientGone as soon as the client hangs up."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ----- metrics ------------------------------------------------------------------------------
class ServerMetrics:
    """Prometheus collectors on a private registry (several servers can live in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("phasewise_requests", "Chat completion requests by outcome",
                                ["outcome"], registry=r)
        self.ttft = Histogram("phasewise_time_to_first_token_seconds",
                              "Submit to first token, in the engine thread",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("phasewise_inter_token_latency_seconds",
                             "Gap between consecutive tokens", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("phasewise_e2e_request_latency_seconds", "Submit to done",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("phasewise_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter("phasewise_cached_prompt_tokens",
                                     "Prompt tokens served from the prefix cache", registry=r)
        self.generation_tokens = Counter("phasewise_generation_tokens", "Generated tokens",
                                         registry=r)

    def observe(self, result: GenerationResult) -> None:
        m = result.metrics
        self.requests.labels(result.finish_reason).inc()
        if m.output_tokens:
            self.ttft.observe(m.ttft_s)
        for gap in m.itl_s:
            self.itl.observe(gap)
        self.e2e.observe(m.e2e_s)
        self.prompt_tokens.inc(m.prompt_tokens)
        self.cached_tokens.inc(m.cached_tokens)
        self.generation_tokens.inc(m.output_tokens)


# ----- the app ------------------------------------------------------------------------------
@dataclass
class _Route:
    loop: asyncio.AbstractEventLoop
    loop_thread: int
    queue: asyncio.Queue[EngineEvent]
    # Set once the stream's first text is on the socket (or the request is over); None for
    # a request that does not stream.
    first_text_sent: threading.Event | None
    waited: bool = False  # the engine thread already waited for it (touched only there)


class EventRouter:
    """One engine listener that forwards each request's events to its asyncio queue."""

    def __init__(self, engine: Backend, handoff_s: float = FIRST_TEXT_HANDOFF_S) -> None:
        self._routes: dict[str, _Route] = {}
        self._handoff_s = handoff_s
        engine.add_listener(self._on_event)

    def open(self, request_id: str, streaming: bool) -> _Route:
        queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        route = _Route(asyncio.get_running_loop(), threading.get_ident(), queue,
                       threading.Event() if streaming else None)
        self._routes[request_id] = route
        return route

    def close(self, request_id: str) -> None:
        route = self._routes.pop(request_id, None)
        if route is not None and route.first_text_sent is not None:
            route.first_text_sent.set()  # nobody will send it: never keep the engine waiting

    def _on_event(self, event: EngineEvent) -> None:
        """Runs on the engine thread: hand the event over.

        A stream's first text is the one exception to never blocking: the engine thread waits
        (at most handoff_s) until the server has written it. Otherwise the engine goes straight
        on to its next step and the server's loop thread, woken for the hand-over, has to win
        the GIL back from the engine's Python work at each of its several awaits before the
        bytes go out (up to sys.getswitchinterval(), 5 ms, each time) and a core back from
        the kernels' threads: tens of ms added to the time to first token. Waiting costs the
        engine that one hand-over (well under a millisecond) once per request."""
        route = self._routes.get(getattr(event, "request_id", ""))
        if route is None:
            return
        route.loop.call_soon_threadsafe(route.queue.put_nowait, event)
        sent = route.first_text_sent
        if (sent is not None and not route.waited and has_text(event)
                and threading.get_ident() != route.loop_thread):
            route.waited = True
            sent.wait(self._handoff_s)


class ChatServer:
    """The HTTP side: handlers, auth and metrics around one started, loaded Engine."""

    def __init__(self, engine: Backend, *, token: str | None = None,
                 handoff_s: float = FIRST_TEXT_HANDOFF_S) -> None:
        if engine.model_info is None:
            raise PhasewiseError("load a model before serving it")
        self.engine = engine
        self.token = token
        self.model = engine.model_info.name
        self.metrics = ServerMetrics()
        self.router = EventRouter(engine, handoff_s)
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [
            Route("/v1/models", self._guard(self.list_models), methods=["GET"]),
            Route("/v1/chat/completions", self._guard(self.chat_completions), methods=["POST"]),
            Route("/metrics", self._guard(self.prometheus), methods=["GET"]),
        ]
        return Starlette(routes=routes)

    def _guard(self, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def guarded(request: Request) -> Response:
            if self.token and not self._authorized(request):
                return JSONResponse(error_body("missing or wrong API key",
                                               "authentication_error"), status_code=401)
            return await handler(request)

        return guarded

    def _authorized(self, request: Request) -> bool:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(given.strip(),
                                                                       self.token or "")

    async def list_models(self, _request: Request) -> Response:
        info = self.engine.model_info
        card = {"id": self.model, "object": "model", "created": self.created,
                "owned_by": "phasewise", "max_model_len": info.context_length if info else 0}
        return JSONResponse({"object": "list", "data": [card]})

    async def prometheus(self, _request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def chat_completions(self, request: Request) -> Response:
        stamps = Stamps(time.perf_counter_ns())
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(error_body("the body is not valid JSON"), status_code=400)
        info = self.engine.model_info
        try:
            gen = build_request(body, self.model, info.context_length if info else 512)
        except BadRequest as exc:
            return JSONResponse(error_body(str(exc)), status_code=400)
        streaming = bool(body.get("stream"))
        route = self.router.open(gen.request_id, streaming)
        queue = route.queue
        stamps.submitted_ns = time.perf_counter_ns()
        self.engine.submit(gen)
        try:
            # Until the first token the handler itself watches for a hang-up; once the
            # stream has started, Starlette cancels the stream when the client goes away.
            first = await until_disconnect(request, first_event(queue, streaming))
        except ClientGone:
            first = None
        if isinstance(first, (RequestFailed, RequestFinished)) or not streaming:
            self._end(gen)
        if first is None:
            return Response(status_code=499)  # nobody is listening any more
        if isinstance(first, RequestFailed):
            self.metrics.requests.labels("failed").inc()
            return failure_response(first.message)
        if not streaming:
            assert isinstance(first, RequestFinished)  # first_event's only other end
            stamps.engine_ns = first.t_ns
            return JSONResponse(self._completion_body(gen, first.result, stamps))
        options = body.get("stream_options") or {}
        chunks = self._chunks(gen, route, first, bool(options.get("include_usage")), stamps)
        return StreamingResponse(chunks, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def _end(self, gen: GenerationRequest) -> None:
        """Stop the request (a no-op when it already ended) and drop its route."""
        self.engine.cancel(gen.request_id)
        self.router.close(gen.request_id)

    def _completion_body(self, gen: GenerationRequest, result: GenerationResult,
                         stamps: Stamps) -> dict:
        self.metrics.observe(result)
        stamps.sent_ns = time.perf_counter_ns()  # the body is serialized and sent right after
        return {
            "id": f"chatcmpl-{gen.request_id}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "finish_reason": finish_reason(result), "logprobs": None}],
            "usage": usage_of(result), "phasewise_timings": server_timings(result, stamps),
        }

    async def _chunks(self, gen: GenerationRequest, route: _Route, event: EngineEvent,
                      include_usage: bool, stamps: Stamps) -> AsyncIterator[str]:
        base = {"id": f"chatcmpl-{gen.request_id}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self.model}

        def chunk(delta: dict, reason: str | None = None) -> str:
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            return sse(base | {"choices": [choice]})

        try:
            yield chunk({"role": "assistant", "content": ""})
            while True:
                if isinstance(event, (TokenEmitted, TextFlushed)) and event.text:
                    yield chunk({"content": event.text})
                    if not stamps.sent_ns:  # Starlette has written it: resumed after send
                        stamps.engine_ns, stamps.sent_ns = event.t_ns, time.perf_counter_ns()
                        assert route.first_text_sent is not None  # a streaming route
                        route.first_text_sent.set()
                elif isinstance(event, RequestFailed):
                    self.metrics.requests.labels("failed").inc()
                    yield sse(error_body(event.message, "server_error"))
                    return
                elif isinstance(event, RequestFinished):
                    result = event.result
                    self.metrics.observe(result)
                    if not stamps.sent_ns:  # no text at all: the end is what the client waits for
                        stamps.engine_ns, stamps.sent_ns = event.t_ns, time.perf_counter_ns()
                    yield chunk({}, finish_reason(result))
                    if include_usage:
                        yield sse(base | {"choices": [], "usage": usage_of(result),
                                          "phasewise_timings": server_timings(result, stamps)})
                    yield sse("[DONE]")
                    return
                event = await route.queue.get()
        finally:  # the client went away (or we are done): stop the engine within a step
            self._end(gen)


def create_app(engine: Backend, *, token: str | None = None,
               handoff_s: float = FIRST_TEXT_HANDOFF_S) -> Starlette:
    """The ASGI app for a started Engine with a model loaded."""
    return ChatServer(engine, token=token, handoff_s=handoff_s).app()


def uvicorn_server(app: Starlette, host: str, port: int,
                   on_started: Callable[[], None] | None = None) -> Any:
    """A uvicorn Server that leaves the process's logging configuration alone.

    `on_started` is called once it listens. By then uvicorn's own Ctrl+C and SIGTERM handlers
    are in place, so a signal sent after that call always reaches a server that drains
    (announcing before `run` left a window in which the signal broke into the event loop's
    construction).
    """
    import uvicorn

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and on_started is not None:
                on_started()

    config = uvicorn.Config(app, host=host, port=port, log_config=None, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=2)
    return AnnouncingServer(config)


class ServerThread:
    """Serve an app on an already-bound socket in a background thread (tests, the GUI)."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0) -> None:
        import socket
        import threading

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = uvicorn_server(app, self.host, self.port)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="phasewise-serve", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise PhasewiseError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
