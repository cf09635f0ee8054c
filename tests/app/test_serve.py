"""`phasewise serve`: a real server on 127.0.0.1 over the tiny model, driven by `openai`."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time

import httpx
import openai
import pytest

from app.cli import main
from app.serve import (
    ServerThread,
    check_bind,
    conversation_key,
    create_app,
    is_loopback,
    parse_messages,
)
from engine import ChatMessage, PhasewiseError, RequestFinished, TokenEmitted
from engine.events import GenerationResult, ModelInfo
from engine.metrics import RequestTimeline, compute_metrics
from engine.worker import Engine
from tests.support.serving import TOKEN

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello, how are you today?"}]


def client(server: ServerThread, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=60)


def test_models_lists_the_loaded_model(phasewise_server: ServerThread,
                                       served_engine: Engine) -> None:
    models = client(phasewise_server).models.list()
    assert [m.id for m in models.data] == [served_engine.model_info.name]


def test_non_streaming_completion_has_text_and_usage(phasewise_server: ServerThread) -> None:
    reply = client(phasewise_server).chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=6)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens > 0
    assert 1 <= usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_streaming_matches_non_streaming_and_reports_usage(
    phasewise_server: ServerThread,
) -> None:
    api = client(phasewise_server)
    plain = api.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                        max_tokens=8)
    stream = api.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                         max_tokens=8, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == plain.choices[0].finish_reason
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage.completion_tokens == plain.usage.completion_tokens
    # The same prompt again: everything but the last prompt token comes from the cache.
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_stream_without_include_usage_sends_no_usage(phasewise_server: ServerThread) -> None:
    stream = client(phasewise_server).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, stream=True)
    assert all(c.usage is None for c in stream)


def test_next_turn_reuses_the_conversation_prefix(phasewise_server: ServerThread) -> None:
    api = client(phasewise_server)
    first = [{"role": "user", "content": "The capital of France is"}]
    one = api.chat.completions.create(model="tiny", messages=first, temperature=0,
                                      max_tokens=5)
    second = [*first, {"role": "assistant", "content": one.choices[0].message.content},
              {"role": "user", "content": "And Germany?"}]
    two = api.chat.completions.create(model="tiny", messages=second, temperature=0,
                                      max_tokens=5)
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens


def test_sampling_params_are_mapped(phasewise_server: ServerThread) -> None:
    api = client(phasewise_server)

    def sample(seed: int) -> str:
        return api.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.5,
                                           top_p=0.9, seed=seed, max_completion_tokens=10
                                           ).choices[0].message.content

    assert sample(7) == sample(7)
    capped = api.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                         max_tokens=2)
    assert capped.usage.completion_tokens <= 2


def test_bad_requests_get_openai_style_400(phasewise_server: ServerThread) -> None:
    api = client(phasewise_server)
    with pytest.raises(openai.BadRequestError, match="top-p"):
        api.chat.completions.create(model="tiny", messages=MESSAGES, top_p=0)
    with pytest.raises(openai.BadRequestError, match="role"):
        api.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="prompt is empty"):
        api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": " "}],
                                    stream=True)


def test_token_is_required_when_set(token_server: ServerThread) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(token_server, "wrong").models.list()
    assert httpx.get(f"{token_server.base_url}/models").status_code == 401
    assert client(token_server, TOKEN).models.list().data


def test_metrics_expose_latency_histograms(phasewise_server: ServerThread) -> None:
    client(phasewise_server).chat.completions.create(model="tiny", messages=MESSAGES,
                                                     max_tokens=4)
    text = httpx.get(f"http://127.0.0.1:{phasewise_server.port}/metrics").text
    for name in ("phasewise_time_to_first_token_seconds_bucket",
                 "phasewise_inter_token_latency_seconds_count",
                 "phasewise_e2e_request_latency_seconds_sum",
                 "phasewise_requests_total", "phasewise_cached_prompt_tokens_total"):
        assert name in text, name


def test_client_disconnect_cancels_the_request(
    phasewise_server: ServerThread, served_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    hung_up = threading.Event()
    real_cancel = served_engine.cancel

    def recording_cancel(request_id: str) -> None:
        hung_up.set()
        real_cancel(request_id)

    monkeypatch.setattr(served_engine, "cancel", recording_cancel)
    results: queue.Queue = queue.Queue()
    holding = [True]

    def hold_second_token(event: object) -> None:
        """Runs on the engine thread: keep the reply going until the server reacts."""
        if holding[0] and isinstance(event, TokenEmitted) and event.index == 1:
            hung_up.wait(30)
        if holding[0] and isinstance(event, RequestFinished):
            results.put(event.result)

    served_engine.add_listener(hold_second_token)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "stream": True,
            "temperature": 1.0, "seed": 1}
    try:
        with httpx.stream("POST", f"{phasewise_server.base_url}/chat/completions", json=body,
                          timeout=60) as response:
            assert response.status_code == 200
            next(line for line in response.iter_lines() if line.startswith("data:"))
        result = results.get(timeout=60)
    finally:
        holding[0] = False
    assert hung_up.is_set()
    assert result.finish_reason == "cancelled"
    assert result.metrics.output_tokens < 200


def test_loopback_rules() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0")
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "secret")
    with pytest.raises(PhasewiseError, match="without --token"):
        check_bind("0.0.0.0", None)


def test_serve_refuses_public_host_without_token(capsys) -> None:
    code = main(["serve", "--host", "0.0.0.0", "--model", "no-such-model"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and "without --token" in err


def test_conversation_key_follows_the_opening() -> None:
    a = [ChatMessage("system", "s"), ChatMessage("user", "hi")]
    b = [*a, ChatMessage("assistant", "hello"), ChatMessage("user", "more")]
    assert conversation_key("m", a) == conversation_key("m", b)
    assert conversation_key("m", a) != conversation_key("m", [ChatMessage("user", "hi")])


def test_a_clients_token_ids_are_never_taken() -> None:
    """Ids the engine would trust as a reply's own come from this process only: a client's
    extra fields on a message are dropped (the engine still checks any ids it gets)."""
    messages = parse_messages([
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!", "token_ids": [1, 2, 3],
         "token_model": "torch:default:x:y"}])
    assert [(m.token_ids, m.token_model) for m in messages] == [(None, None), (None, None)]


# ----- the first token's way out, with a stand-in engine ------------------------------------------
class HandEngine:
    """A stand-in Backend whose events the test emits itself, from the test's thread, as the
    engine thread would (listeners run on the emitting thread)."""

    model_info = ModelInfo("hand", "default", "hand", "cpu", "fp32", 512, 1, 1, "none")

    def __init__(self) -> None:
        self.listeners: list = []
        self.submitted: queue.Queue[str] = queue.Queue()

    def add_listener(self, listener) -> None:
        self.listeners.append(listener)

    def submit(self, request) -> None:
        self.submitted.put(request.request_id)

    def cancel(self, request_id: str) -> None:
        pass

    def emit(self, event: object) -> None:
        for listener in self.listeners:
            listener(event)

    def finish(self, request_id: str, text: str) -> None:
        t = time.perf_counter_ns()
        timeline = RequestTimeline(submitted_ns=t, prefill_start_ns=t, first_logits_ns=t,
                                   token_ns=[t], done_ns=t)
        metrics = compute_metrics(timeline, prompt_tokens=3, cached_tokens=0, parameters=1,
                                  weight_bytes_per_step=1, cache_miss_reason="cold")
        result = GenerationResult(request_id, text, "stop", [1], [1, 2, 3], metrics)
        self.emit(RequestFinished(request_id, t, result))


def recording_sends(app, bodies: list[bytes]):
    """The ASGI app, recording each response body it has handed to the socket."""
    async def recorded(scope, receive, send):
        async def send_and_record(message):
            await send(message)
            if message["type"] == "http.response.body":
                bodies.append(message["body"])
        await app(scope, receive, send_and_record)
    return recorded


def raw_request(server: ServerThread, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection((server.host, server.port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                 b"Connection: close\r\n\r\n%b" % (len(data), data))
    return sock


def read_all(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_a_streams_first_text_is_written_before_the_engine_goes_on() -> None:
    """The engine thread's emit of a stream's first text returns only once the server has
    written it: otherwise the server's loop thread wins the GIL and a core back from the
    engine's next step at each of its awaits (tens of ms on a busy 2-core machine)."""
    engine = HandEngine()
    bodies: list[bytes] = []
    # A hand-over this slow would only happen if the server never signalled the write.
    app = recording_sends(create_app(engine, handoff_s=60), bodies)
    with ServerThread(app) as server:
        body = {"model": "hand", "stream": True, "messages": MESSAGES,
                "stream_options": {"include_usage": True}}
        with raw_request(server, body) as sock:
            started = time.perf_counter_ns()
            request_id = engine.submitted.get(timeout=30)
            engine.emit(TokenEmitted(request_id, time.perf_counter_ns(), 0, 1, ""))
            engine.emit(TokenEmitted(request_id, time.perf_counter_ns(), 1, 2, "Paris"))
            written = list(bodies)  # what the server had written when the emit returned
            engine.finish(request_id, "Paris")
            received = read_all(sock)
            waited_s = (time.perf_counter_ns() - started) / 1e9
    assert any(b'"content":"Paris"' in b for b in written), written
    usage = json.loads(next(line for line in received.split(b"\n")
                            if b'"usage"' in line).removeprefix(b"data: "))
    overhead = usage["phasewise_timings"]["server_overhead_s"]
    assert 0 <= overhead <= waited_s  # the server's own share of what this client waited


def test_a_plain_completion_reports_the_servers_overhead() -> None:
    engine = HandEngine()
    with (ServerThread(create_app(engine)) as server,
          raw_request(server, {"model": "hand", "messages": MESSAGES}) as sock):
        started = time.perf_counter_ns()
        engine.finish(engine.submitted.get(timeout=30), "Paris")
        received = read_all(sock)
        waited_s = (time.perf_counter_ns() - started) / 1e9
    reply = json.loads(received.split(b"\r\n\r\n", 1)[1])
    assert reply["choices"][0]["message"]["content"] == "Paris"
    assert 0 <= reply["phasewise_timings"]["server_overhead_s"] <= waited_s
