"""Running a test body in a spawned child process: how every test that runs llama.cpp (foreign
native code) runs it, so a crash in native code is a failed test naming the signal, not a dead
test run. The body and its arguments are pickled: a module-level function of a test module."""

from __future__ import annotations

import importlib.util
import multiprocessing
import signal
import traceback
from collections.abc import Callable
from typing import Any

import pytest

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (make llama-cpp)")
CHILD_TIMEOUT_S = 600  # a test module's own timeout is this + 60: the child's limit comes first


def _child_main(conn: Any, body: Callable[..., Any], args: tuple) -> None:
    try:
        conn.send(("ok", body(*args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_in_child(body: Callable[..., Any], *args: Any) -> Any:
    """body(*args) in a spawned process: its return value, its exception as a test failure
    with the child's traceback, or a failure naming the signal that killed it."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child_main, args=(child, body, args), daemon=True)
    process.start()
    child.close()
    try:
        if not parent.poll(CHILD_TIMEOUT_S):
            process.kill()
            pytest.fail(f"{body.__name__} did not finish within {CHILD_TIMEOUT_S} s")
        status, value = parent.recv()
    except EOFError:  # the child died without reporting
        process.join(10)
        code = process.exitcode
        if code is not None and code < 0:
            pytest.fail(f"{body.__name__}: the child process died of "
                        f"{signal.Signals(-code).name}")
        pytest.fail(f"{body.__name__}: the child process exited with code {code}")
    finally:
        process.join(10)
    if status == "error":
        pytest.fail(f"{body.__name__} failed in the child process:\n{value}")
    return value
