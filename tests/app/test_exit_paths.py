"""Every way a user ends Phasewise ends cleanly: the documented exit code, and never an abort.

Each test runs the real program (`python -m app`, i.e. app.cli.entry) in a child process with
an empty HOME, as a first start is: the HUD's device calibration is not cached yet and runs
in its thread while the user quits. That was the installed app's abort ("terminate called
without an active exception", SIGABRT): Python finalized under a thread inside torch. The GUI
paths run through tests/support/exit_driver.py, which ends the window the way a user does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ui.store import STOPPED, ChatStore

ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 240
pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                       reason="llama-cpp-python is not installed (`make llama-cpp`)"),
    pytest.mark.timeout(2 * CHILD_TIMEOUT_S),
]
EXIT_CANCELLED = 130  # app.cli: a cancelled `ask` or `bench`, as a shell's Ctrl+C


def _env(home: Path) -> dict[str, str]:
    """A first start: empty HOME, data and cache in it, the GUI offscreen."""
    return {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8", "QT_QPA_PLATFORM": "offscreen", "PYTHONUNBUFFERED": "1",
            "PHASEWISE_DATA_DIR": str(home / "data"), "PHASEWISE_CACHE_DIR": str(home / "cache"),
            "HF_HUB_OFFLINE": "1"}


def _ctrl_c_as_in_a_terminal() -> None:
    """In the child before it runs: Ctrl+C at its default. A test runner started in the
    background (`cmd &`) ignores SIGINT, and a child would inherit that and never see it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(args: list[str], home: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(home), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_ctrl_c_as_in_a_terminal)


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running after {CHILD_TIMEOUT_S} s; stderr: {err[-2000:]}")
    return proc.returncode, out, err


def _assert_clean(code: int, err: str, expected: int = 0) -> None:
    assert "terminate called" not in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "Fatal Python error" not in err, err[-3000:]
    assert code == expected, f"exit code {code}, expected {expected}; stderr: {err[-3000:]}"


def _wait_for_line(proc: subprocess.Popen[str], stream: str, marker: str) -> str:
    """Read the child's stdout or stderr until a line holding `marker`; fail if it ends first.
    Returns all it read."""
    pipe = proc.stdout if stream == "stdout" else proc.stderr
    assert pipe is not None
    seen = []
    for line in pipe:
        seen.append(line)
        if marker in line:
            return "".join(seen)
    pytest.fail(f"the child ended without printing {marker!r}: {''.join(seen)[-2000:]}")


def _driver(mode: str, home: Path) -> subprocess.Popen[str]:
    return _start(["-m", "tests.support.exit_driver", mode], home)


def _acted(out: str) -> dict[str, object]:
    """What the driver saw when it acted (with the question it answered, if one was asked);
    and no thread of ours outlived the app's shutdown."""
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    acted = [line for line in lines if "acted" in line]
    asked = [line for line in lines if "asked" in line]
    assert len(acted) == 1 and len(asked) <= 1, out
    assert [line for line in lines if "threads_at_exit" in line] == [{"threads_at_exit": []}]
    return acted[0] | (asked[0] if asked else {})


def _last_reply_status(home: Path) -> str:
    store = ChatStore(home / "data" / "chats.sqlite3")
    try:
        conversations = store.conversations()
        assert conversations, "no chat was saved"
        messages = store.messages(conversations[-1].id)
    finally:
        store.close()
    return messages[-1].status


# ----- the window ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["close-streaming", "ctrl-q-streaming"])
def test_quitting_while_a_reply_streams_exits_cleanly_and_keeps_it_stopped(
        mode: str, tmp_path: Path) -> None:
    code, out, err = _finish(_driver(mode, tmp_path))
    _assert_clean(code, err)
    acted = _acted(out)
    assert acted["streaming"] is True
    assert _last_reply_status(tmp_path) == STOPPED
    # Ctrl+Q says first that the reply is kept as stopped; closing the window does not ask.
    if mode == "ctrl-q-streaming":
        assert "kept in the chat, marked stopped" in str(acted["asked"])
    else:
        assert "asked" not in acted


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_a_reply_streams_closes_the_window(signum: int, tmp_path: Path) -> None:
    proc = _driver("signal-streaming", tmp_path)
    before = _wait_for_line(proc, "stdout", "STREAMING")
    proc.send_signal(signum)
    code, out, err = _finish(proc)
    _assert_clean(code, err)
    assert _acted(before + out)["streaming"] is True
    assert _last_reply_status(tmp_path) == STOPPED


def test_closing_while_the_model_loads_exits_cleanly(tmp_path: Path) -> None:
    code, out, err = _finish(_driver("close-loading", tmp_path))
    _assert_clean(code, err)
    assert _acted(out)["loaded"] is False


def test_closing_while_a_long_prompt_is_read_beside_a_stream_exits_cleanly(
        tmp_path: Path) -> None:
    code, out, err = _finish(_driver("close-beside", tmp_path))
    _assert_clean(code, err)
    acted = _acted(out)
    assert acted["streaming"] is True
    assert len(acted["tokens"]) == 1  # the long prompt had produced no token yet


# ----- the command line ------------------------------------------------------------------------
def test_ask_ends_cleanly(tmp_path: Path) -> None:
    proc = _start(["-m", "app", "ask", "--temperature", "0", "--max-tokens", "8", "Hello"],
                  tmp_path)
    code, out, err = _finish(proc)
    _assert_clean(code, err)
    assert out.strip()


def test_ask_interrupted_by_ctrl_c_keeps_the_text_and_exits_cancelled(tmp_path: Path) -> None:
    proc = _start(["-m", "app", "ask", "--temperature", "0", "--max-tokens", "2048",
                   "Count from 1 to 500, one number per line."], tmp_path)
    assert proc.stdout is not None
    first = proc.stdout.read(1)  # the reply has started streaming
    proc.send_signal(signal.SIGINT)
    code, out, err = _finish(proc)
    _assert_clean(code, err, EXIT_CANCELLED)
    assert (first + out).strip()


def test_bench_ends_cleanly_and_on_ctrl_c(tmp_path: Path) -> None:
    args = ["-m", "app", "bench", "--json", "--prompt-tokens", "16"]
    code, out, err = _finish(_start([*args, "--max-tokens", "8", "--repeats", "1"],
                                    tmp_path / "a"))
    _assert_clean(code, err)
    assert json.loads(out.splitlines()[-1])["engine"] == "llama.cpp"
    proc = _start([*args, "--max-tokens", "4000", "--repeats", "3"], tmp_path / "b")
    _wait_for_line(proc, "stderr", "run 1/3")  # measuring: Ctrl+C lands inside a run
    proc.send_signal(signal.SIGINT)
    code, _, err = _finish(proc)
    _assert_clean(code, err, EXIT_CANCELLED)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_serve_stops_cleanly_on_ctrl_c_and_sigterm(signum: int, tmp_path: Path) -> None:
    """"serving" is said once the server listens with its signal handlers in place: the first
    connection is accepted, and a signal right after the line drains the server (said earlier,
    the signal could break into the event loop's construction with a traceback)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = _start(["-m", "app", "serve", "--port", str(port)], tmp_path)
    _wait_for_line(proc, "stderr", "phasewise: serving")
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    proc.send_signal(signum)
    code, _, err = _finish(proc)
    _assert_clean(code, err)
    assert "server stopped" in err
