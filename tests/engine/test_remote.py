"""The remote backend against real servers on 127.0.0.1: `phasewise serve` on the tiny model,
and small fake servers that misbehave in one way each."""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from app.serve import ServerThread
from engine import (
    ChatMessage,
    GenerationRequest,
    ModelLoadError,
    PrefillStarted,
    RequestFailed,
    RequestFinished,
    RequestQueued,
    SamplingParams,
    TokenEmitted,
)
from engine.remote import (
    NO_USAGE_NOTICE,
    RemoteConfig,
    RemoteEngine,
    RemoteError,
    normalize_base_url,
    request_body,
)
from engine.worker import Engine
from tests.support.fake_servers import PARTIAL, fake_app
from tests.support.serving import TOKEN

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def chat(text: str = "Hello, how are you today?", params: SamplingParams = GREEDY,
         conversation_id: str | None = None) -> GenerationRequest:
    return GenerationRequest([ChatMessage("user", text)], params,
                             conversation_id=conversation_id)


@pytest.fixture
def remote(phasewise_server: ServerThread) -> Iterator[RemoteEngine]:
    with RemoteEngine(RemoteConfig(phasewise_server.base_url)) as engine:
        engine.load_model_sync(timeout=30)
        yield engine


def test_remote_matches_the_local_engine(remote: RemoteEngine, served_engine: Engine) -> None:
    events = []
    remote.add_listener(events.append)
    local = served_engine.submit(chat()).wait(60)
    handle = remote.submit(chat())
    result = handle.wait(60)
    assert result.text == local.text
    assert result.finish_reason == local.finish_reason
    kinds = [type(e) for e in events]
    assert kinds[:2] == [RequestQueued, PrefillStarted]
    assert kinds[-1] is RequestFinished
    tokens = [e for e in events if isinstance(e, TokenEmitted)]
    assert "".join(t.text for t in tokens) == result.text
    assert [t.index for t in tokens] == list(range(len(tokens)))
    m = result.metrics
    assert m.prompt_tokens_known and m.cached_tokens_known
    assert m.prompt_tokens == local.metrics.prompt_tokens
    assert m.output_tokens == local.metrics.output_tokens
    assert m.prompt_tokens == m.cached_tokens + m.prefilled_tokens
    assert len(m.itl_s) == len(tokens) - 1
    assert result.model.source == "remote" and result.model.name == served_engine.model_info.name
    assert result.notice is None and result.error is None


def test_client_timings_contain_the_servers(remote: RemoteEngine, served_engine: Engine) -> None:
    """The server's own TTFT and e2e happen inside the client's (same clock order)."""
    server_side: queue.Queue = queue.Queue()
    served_engine.add_listener(
        lambda e: server_side.put(e.result) if isinstance(e, RequestFinished) else None)
    result = remote.submit(chat("The capital of France is")).wait(60)
    server = server_side.get(timeout=30)
    assert server.text == result.text
    assert result.metrics.ttft_s >= server.metrics.ttft_s
    assert result.metrics.e2e_s >= server.metrics.e2e_s
    assert result.metrics.cached_tokens == server.metrics.cached_tokens


def test_remote_next_turn_reports_cached_tokens(remote: RemoteEngine) -> None:
    one = remote.submit(chat("The capital of Germany is")).wait(60)
    history = [ChatMessage("user", "The capital of Germany is"),
               ChatMessage("assistant", one.text), ChatMessage("user", "And France?")]
    two = remote.submit(GenerationRequest(history, GREEDY)).wait(60)
    assert two.metrics.cached_tokens >= one.metrics.prompt_tokens


def test_cancel_closes_the_stream_and_keeps_the_partial_reply(remote: RemoteEngine) -> None:
    # greedy: the tiny model's reply runs all 200 tokens (a sampled one may end early)
    handle = remote.submit(chat(params=SamplingParams(temperature=0, max_tokens=200)))
    for event in handle.events(timeout=60):
        if isinstance(event, TokenEmitted):
            handle.cancel()
            break
    result = handle.wait(60)
    assert result.finish_reason == "cancelled"
    assert result.metrics.output_tokens < 200
    # The backend stays usable.
    assert remote.submit(chat()).wait(60).finish_reason in ("stop", "length")


def test_bearer_token_is_sent(token_server: ServerThread) -> None:
    config = RemoteConfig(token_server.base_url, api_key=TOKEN)
    assert TOKEN not in repr(config)
    with RemoteEngine(config) as engine:
        engine.load_model_sync(timeout=30)
        assert engine.submit(chat()).wait(60).text is not None


def test_wrong_key_is_a_clear_load_error(token_server: ServerThread) -> None:
    with RemoteEngine(RemoteConfig(token_server.base_url, api_key="wrong")) as engine, \
            pytest.raises(ModelLoadError, match=r"refused the API key \(HTTP 401\)"):
        engine.load_model_sync(timeout=30)


def test_unknown_model_name_is_refused(phasewise_server: ServerThread) -> None:
    with RemoteEngine(RemoteConfig(phasewise_server.base_url, model="gpt-9")) as engine, \
            pytest.raises(ModelLoadError, match="has no model 'gpt-9'"):
        engine.load_model_sync(timeout=30)


# ----- a loop shared with the caller (the GUI's) -------------------------------------------------
@pytest.fixture
def shared_loop() -> Iterator[tuple[asyncio.AbstractEventLoop, threading.Thread]]:
    """A caller's asyncio loop running in its thread, as qasync runs on the GUI's."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop, thread
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_shared_loop_serves_and_never_blocks_its_own_thread(
    phasewise_server: ServerThread, shared_loop: tuple[asyncio.AbstractEventLoop, Any]
) -> None:
    loop, _thread = shared_loop
    engine = RemoteEngine(RemoteConfig(phasewise_server.base_url), loop=loop).start()
    engine.load_model_sync(timeout=30)  # another thread: waiting is safe
    assert engine.submit(chat()).wait(60).finish_reason in ("stop", "length")

    async def on_the_loop() -> str:
        with pytest.raises(RemoteError, match="would block the loop") as caught:
            engine.load_model_sync(timeout=1)
        engine.shutdown()  # only scheduled: the loop is busy running this coroutine
        return f"{caught.value} closed={engine.closed.is_set()}"

    said = asyncio.run_coroutine_threadsafe(on_the_loop(), loop).result(30)
    assert said.endswith("closed=False")
    assert engine.closed.wait(30)


def test_shared_loop_that_stopped_is_run_once_more_to_close(
    phasewise_server: ServerThread, shared_loop: tuple[asyncio.AbstractEventLoop, Any]
) -> None:
    """run_gui's exit: the Qt loop has returned, then the backends shut down."""
    loop, thread = shared_loop
    engine = RemoteEngine(RemoteConfig(phasewise_server.base_url), loop=loop).start()
    engine.load_model_sync(timeout=30)
    assert engine.submit(chat()).wait(60).text is not None  # leaves a pooled connection
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    assert not loop.is_running()
    engine.shutdown()
    assert engine.closed.is_set()


# ----- faults ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_host_is_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    with RemoteEngine(RemoteConfig(url, connect_timeout_s=5)) as engine:
        with pytest.raises(ModelLoadError, match=f"cannot reach {url}"):
            engine.load_model_sync(timeout=30)
        handle = engine.submit(chat())
        assert isinstance(list(handle.events(timeout=30))[-1], RequestFailed)


def run_fault(fault: str, **config: float) -> object:
    """Chat once with a fake server that has the fault; return the request's last event."""
    with ServerThread(fake_app(fault)) as server, \
            RemoteEngine(RemoteConfig(server.base_url, **config)) as engine:
        engine.load_model_sync(timeout=30)
        handle = engine.submit(chat())
        return list(handle.events(timeout=30))[-1]


@pytest.mark.parametrize(("fault", "message"), [
    ("error_mid_stream", "server error mid-reply: CUDA out of memory"),
    ("malformed", "malformed event from the server"),
    ("stall", "the server stalled: no data for 0.5 s"),
])
def test_mid_stream_faults_keep_the_partial_reply(fault: str, message: str) -> None:
    last = run_fault(fault, stall_timeout_s=0.5)
    assert isinstance(last, RequestFinished)
    result = last.result
    assert result.finish_reason == "error"
    assert result.text == "".join(PARTIAL)
    assert result.error.startswith(message)
    assert "\n" not in result.error
    assert result.metrics.output_tokens == len(PARTIAL)


@pytest.mark.parametrize(("fault", "message"), [
    ("server_error", "the server answered HTTP 500: model crashed"),
    ("not_sse", "the server did not stream events (got text/html"),
])
def test_refused_requests_fail_with_one_line(fault: str, message: str) -> None:
    last = run_fault(fault)
    assert isinstance(last, RequestFailed)
    assert last.message.startswith(message)


def test_unauthorized_server_fails_the_load() -> None:
    with ServerThread(fake_app("unauthorized")) as server, \
            RemoteEngine(RemoteConfig(server.base_url)) as engine, \
            pytest.raises(ModelLoadError, match="PHASEWISE_API_KEY"):
        engine.load_model_sync(timeout=30)


def test_no_usage_marks_counts_unknown() -> None:
    last = run_fault("no_usage")
    result = last.result
    assert result.finish_reason == "stop" and result.error is None
    assert result.text == "".join(PARTIAL)
    assert result.notice == NO_USAGE_NOTICE
    m = result.metrics
    assert not m.prompt_tokens_known and not m.cached_tokens_known
    assert m.prompt_tokens == 0 and m.output_tokens == len(PARTIAL)


# ----- configuration -----------------------------------------------------------------------
def test_base_url_is_normalized() -> None:
    assert normalize_base_url("http://h:8000") == "http://h:8000/v1"
    assert normalize_base_url("https://h/v1/") == "https://h/v1"
    with pytest.raises(Exception, match="http:// or https://"):
        normalize_base_url("h:8000")


def test_request_body_never_sends_a_replys_own_ids() -> None:
    """The OpenAI API has no field for them: a reply carried with its ids goes as text."""
    reply = ChatMessage("assistant", "Hi!", (5, 6, 2), "torch:default:x:y")
    request = GenerationRequest([ChatMessage("user", "Hello"), reply,
                                 ChatMessage("user", "And?")], GREEDY)
    assert request_body(request, "m")["messages"] == [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "And?"}]


def test_request_body_maps_the_sliders() -> None:
    params = SamplingParams(temperature=0.3, top_p=0.8, max_tokens=9, seed=4, stop=("END",),
                            top_k=5)
    body = request_body(chat(params=params), "m")
    assert body["stream_options"] == {"include_usage": True}
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"],
            body["stop"], body["top_k"]) == (0.3, 0.8, 9, 4, ["END"], 5)
    assert "min_p" not in body and "repetition_penalty" not in body
