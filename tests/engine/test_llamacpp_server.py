"""The remote backend against a real llama.cpp server: llama-cpp-python's OpenAI-compatible
server on 127.0.0.1, serving the bundled GGUF, driven from the CLI and from the window.

llama-cpp-python 0.3.36 sends no `timings` and no `usage` in its streams; its own timings are
the llama_perf lines it logs per completion (prompt eval and eval time), which the metrics are
checked against.

The server is a child process: if llama.cpp crashes in it (SIGILL on a CPU that faults on an
instruction set it advertises), the test that was running and every later one fail with one
line naming the signal and llama.cpp's compiled CPU features, and the rest of the suite runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from app.cli import main
from engine import ChatMessage, GenerationRequest, SamplingParams
from engine.model_files import default_gguf_path
from engine.native import describe_exit, recorded_llama_cpp_build
from engine.remote import NO_USAGE_NOTICE, RemoteConfig, RemoteEngine
from engine.remote import now_ns as remote_now_ns
from tests.support.window_helpers import WAIT_MS, send_and_wait

# llama_cpp itself and the modules its [server] extra brings (checked without importing them).
SERVER_MODULES = ("llama_cpp", "fastapi", "sse_starlette", "pydantic_settings")
pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(
        any(importlib.util.find_spec(name) is None for name in SERVER_MODULES),
        reason="llama-cpp-python[server] is not installed: `make peers` builds it (a C++ "
               "compiler and CMake are needed; CI runs it before the tests)"),
]
ALIAS = "smollm2-gguf"
QUESTION = "What is the capital of France? Answer in one sentence."
STORY = "Write a long story about a dragon who learns to cook."
READY_S = 120.0
# One llama_perf report per completion (llama.cpp's own clock, printed by the server).
PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
EVAL = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs")


@dataclass(frozen=True)
class ServerTimings:
    prompt_eval_s: float
    prompt_eval_tokens: int
    eval_s: float
    eval_runs: int


@dataclass
class LlamaServer:
    base_url: str
    log: Path
    process: subprocess.Popen

    def death(self) -> str | None:
        """None while the server runs; else one line: how it ended, what it was built with."""
        code = self.process.poll()
        return None if code is None else server_death(code, self.log)

    def timings(self) -> list[ServerTimings]:
        text = self.log.read_text(encoding="utf-8", errors="replace")
        prompts, evals = PROMPT_EVAL.findall(text), EVAL.findall(text)
        return [ServerTimings(float(p_ms) / 1e3, int(p_n), float(e_ms) / 1e3, int(e_n))
                for (p_ms, p_n), (e_ms, e_n) in zip(prompts, evals, strict=False)]

    def wait_for_timings(self, count: int, timeout_s: float = 10.0) -> ServerTimings:
        """The count-th completion's timings (the server logs them just before [DONE])."""
        deadline = time.monotonic() + timeout_s
        while len(found := self.timings()) < count:
            assert time.monotonic() < deadline, f"no timings in {self.log.read_text()[-2000:]}"
            time.sleep(0.05)
        return found[count - 1]


def server_death(code: int, log: Path) -> str:
    if code >= 0:
        return f"llama_cpp.server exited with code {code}:\n{log.read_text()[-2000:]}"
    return f"llama_cpp.server crashed: {describe_exit(code)}; built with {build_of(log)}"


def build_of(log: Path) -> str:
    """llama.cpp's compiled CPU features, as the server logged them when it loaded the model
    (verbose), else the flags `make peers` recorded."""
    text = log.read_text(encoding="utf-8", errors="replace")
    for line in text.splitlines():
        if "AVX2 = " in line or "SSE3 = " in line:
            return " ".join(line.split())
    return recorded_llama_cpp_build() or "flags unknown"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_threads() -> int:
    """The CPUs this process may use: the same count our engine gives torch."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)


def wait_ready(process: subprocess.Popen, base_url: str, log: Path) -> None:
    """Poll /v1/models until it answers, the process dies, or READY_S passes."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(server_death(process.returncode, log))
        try:
            if httpx.get(f"{base_url}/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"llama_cpp.server not ready in {READY_S:g} s:\n{log.read_text()[-2000:]}")


@pytest.fixture(scope="session")
def llamacpp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """`python -m llama_cpp.server` on the bundled GGUF, on a free loopback port, once, with
    the CPU backend variant Phasewise chooses loaded first (llama-cpp-python loads none)."""
    port, threads = free_port(), str(cpu_threads())
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    gguf = str(default_gguf_path())
    command = [sys.executable, "-m", "engine.runtimes.llamacpp.cpu_backend", "--smoke-model", gguf,
               "llama_cpp.server", "--model", gguf,
               "--model_alias", ALIAS, "--host", "127.0.0.1", "--port", str(port),
               "--n_ctx", "2048", "--n_threads", threads, "--n_threads_batch", threads,
               "--seed", "1234"]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_ready(process, base_url, log)
        yield LlamaServer(base_url, log, process)
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(autouse=True)
def server_alive(llamacpp_server: LlamaServer) -> Iterator[None]:
    """A server that died fails the running test (at teardown) and each later one (at setup)
    with the signal's name, instead of as a connection error."""
    if death := llamacpp_server.death():
        pytest.fail(death)
    yield
    if death := llamacpp_server.death():
        pytest.fail(death)


@pytest.fixture
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the user's keyring out; llama_cpp.server ignores the key when it has none."""
    monkeypatch.setenv("PHASEWISE_API_KEY", "test-key")


def greedy(text: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest([ChatMessage("user", text)],
                             SamplingParams(temperature=0.0, max_tokens=max_tokens))


def test_ask_streams_a_reply_from_llama_cpp_server(
    capsys, api_key, llamacpp_server: LlamaServer
) -> None:
    code = main(["ask", "--backend", llamacpp_server.base_url, "--json", "--temperature", "0",
                 "--max-tokens", "24", QUESTION])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out.strip().splitlines()[-1])
    assert "Paris" in data["text"] and out.startswith(data["text"])  # streamed, then JSON
    assert data["model"] == ALIAS and data["device"].startswith("remote 127.0.0.1:")
    assert data["finish_reason"] == "stop"
    assert data["ttft_s"] > 0 and data["output_tokens"] >= 2
    assert len(data["itl_s"]) == data["output_tokens"] - 1
    # No usage in 0.3.36's streams: the counts are marked unknown, and the user is told.
    assert not data["prompt_tokens_known"] and data["notice"] == NO_USAGE_NOTICE
    assert "prompt and cached token counts are unknown" in err


def test_window_chats_with_llama_cpp_server_and_the_hud_is_live(
    qtbot, api_key, remote_window, llamacpp_server: LlamaServer
) -> None:
    window = remote_window(llamacpp_server.base_url)
    assert window.model_info.name == ALIAS and window.model_info.source == "remote"
    window.controls.temperature.setValue(0)
    window.controls.max_tokens.setValue(24)
    result = send_and_wait(qtbot, window, QUESTION)
    assert result.error is None and "Paris" in result.text
    saved = window.store.messages(window.conversation_id)[-1]
    assert saved.content == result.text
    record = window.hud.model.finished()[-1]
    # Every token reached the HUD live (one stamp each), then the reply's metrics.
    assert len(record.token_ns) == result.metrics.output_tokens >= 2
    assert len(record.live_itl_s) == result.metrics.output_tokens - 1
    assert record.metrics is result.metrics and record.metrics.ttft_s > 0
    assert window.hud.model.throughput, "no live throughput points reached the HUD"


def test_cancel_mid_stream_keeps_the_partial_reply(
    qtbot, api_key, remote_window, llamacpp_server: LlamaServer
) -> None:
    window = remote_window(llamacpp_server.base_url)
    window.controls.temperature.setValue(0)
    window.controls.max_tokens.setValue(400)
    tokens: list[str] = []
    window.bridge.sig_token.connect(lambda event: tokens.append(event.text))
    assert window.send(STORY)
    qtbot.waitUntil(lambda: len(tokens) >= 3, timeout=WAIT_MS)
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS) as blocker:
        window.stop()
    result = blocker.args[0]
    assert result.finish_reason == "cancelled"
    assert 3 <= result.metrics.output_tokens < 400
    assert result.text == "".join(tokens)  # every streamed token, nothing after the stop
    assert window.store.messages(window.conversation_id)[-1].content == result.text
    # The server noticed the hang-up and is free for the next reply.
    again = send_and_wait(qtbot, window, QUESTION)
    assert again.error is None and again.finish_reason == "stop"


def test_metrics_agree_with_the_servers_own_timings(llamacpp_server: LlamaServer) -> None:
    """Client-side TTFT contains the server's prompt eval; client decode tok/s is close to
    the server's eval rate (generous bounds: the client also pays HTTP and JSON per token)."""
    before = len(llamacpp_server.timings())
    with RemoteEngine(RemoteConfig(llamacpp_server.base_url)) as remote:
        remote.load_model_sync(timeout=30)
        # A prompt the server has not seen, so its prompt eval is the whole prompt.
        result = remote.submit(greedy(f"[{remote_now_ns()}] {STORY}", 32)).wait(120)
    server = llamacpp_server.wait_for_timings(before + 1)
    m = result.metrics
    assert result.error is None and m.output_tokens >= 12, result.text
    # llama.cpp evaluates each emitted token but the last (and the stop token when it ends).
    assert abs(server.eval_runs - (m.output_tokens - 1)) <= 1
    assert m.ttft_s >= server.prompt_eval_s
    server_tok_s = server.eval_runs / server.eval_s
    assert 0.25 * server_tok_s <= m.decode_tok_s <= 1.5 * server_tok_s, (m, server)
