"""Native code that might crash, run in a child process so a crash is an error, not our death.

A CPU may advertise an instruction set it faults on (a VM that reports AMX and then kills the
process with SIGILL on the first tile instruction), and foreign native code (llama.cpp, torch's
quantized kernels) may pick such a path by itself. Python cannot catch SIGILL or SIGSEGV, so
whatever runs such code at a moment we choose (the llama.cpp peer, the kernel smoke runs) runs
in a spawned child: the child's death becomes NativeCrashError, which names the signal and what
the native code was built with.

The protocol is a pipe of (kind, payload) tuples. The child's main(conn, *args) sends what it
likes; an exception escaping it is sent as ("error", one line). The parent's receive() returns
the payload of the next message, raises ChildError for an "error", and NativeCrashError when
the child dies (by a signal, or by exiting without answering).
"""

from __future__ import annotations

import contextlib
import faulthandler
import glob
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from engine.errors import PhasewiseError, one_line

# The spawn start method everywhere: no forked copy of the parent's threads and locks (torch,
# Qt), and the same behaviour on Linux, macOS and Windows.
_SPAWN = multiprocessing.get_context("spawn")
JOIN_S = 10.0


class ChildError(PhasewiseError):
    """The child raised an exception: str() is its one-line message."""


class NativeCrashError(PhasewiseError):
    """A child process died without answering: by a signal (SIGILL, SIGSEGV...) or an exit."""

    def __init__(self, what: str, exitcode: int | None, build: str = "",
                 timeout_s: float | None = None) -> None:
        self.what = what
        self.exitcode = exitcode
        self.signal = -exitcode if exitcode is not None and exitcode < 0 else None
        # What happened, without the subject: "crashed: SIGILL (illegal instruction)".
        self.reason = (f"did not answer in {timeout_s:g} s (killed)" if timeout_s is not None
                       else f"crashed: {describe_exit(exitcode)}")
        built = f"; built with {build}" if build else ""
        super().__init__(f"{what} {self.reason}{built}")


def describe_exit(exitcode: int | None) -> str:
    """'SIGILL (illegal instruction)' for a death by signal, else 'exit code N'."""
    if exitcode is None:
        return "still running"
    if exitcode >= 0:
        return f"exit code {exitcode} without an answer"
    number = -exitcode
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    detail = signal.strsignal(number) or ""
    return f"{name} ({detail.lower()})" if detail else name



def _child_entry(main: Callable[..., None], conn: Connection, *args: Any) -> None:
    """Runs in the child: a Python stack on stderr if native code faults, errors as messages."""
    faulthandler.enable()
    try:
        main(conn, *args)
    except Exception as exc:
        conn.send(("error", one_line(exc)))
    finally:
        conn.close()


class NativeChild:
    """A spawned child running main(conn, *args); the parent side of its pipe.

    `what` names it in errors ("llama.cpp peer"); `build` says what its native code was built
    with, and may be updated once the child has reported it."""

    def __init__(self, main: Callable[..., None], *args: Any, what: str,
                 build: str = "", daemon: bool = True) -> None:
        """daemon=False lets the child start children of its own (a model load's kernel
        smoke runs); the caller must then end it (close or kill) before it exits."""
        self.what = what
        self.build = build
        self._conn, child_end = _SPAWN.Pipe()
        self._process = _SPAWN.Process(target=_child_entry, args=(main, child_end, *args),
                                       name=what, daemon=daemon)
        self._process.start()
        child_end.close()  # only the child holds it now: its death reads as EOF here

    def send(self, message: Any) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, ConnectionResetError):
            raise self._crash() from None

    def receive(self, timeout_s: float | None = None) -> Any:
        """The next message's payload; ChildError for ("error", line); NativeCrashError if
        the child dies first, or says nothing for timeout_s seconds (then it is killed)."""
        try:
            if timeout_s is not None and not self._conn.poll(timeout_s):
                self._process.kill()
                raise self._crash(timeout_s)
            kind, payload = self._conn.recv()
        except (EOFError, ConnectionResetError):
            raise self._crash() from None
        if kind == "error":
            raise ChildError(payload)
        return payload

    def ready(self, timeout_s: float) -> bool:
        """A message (or the child's end) is there to receive, within timeout_s seconds."""
        try:
            return self._conn.poll(timeout_s)
        except (EOFError, OSError):
            return True  # receive() says what happened

    def kill(self) -> None:
        """End the child now (the caller gave up on it), then close. Idempotent."""
        if not self._conn.closed and self._process.is_alive():
            self._process.kill()
            self._process.join(JOIN_S)
        self.close()

    def call(self, request: Any, timeout_s: float | None = None) -> Any:
        self.send(request)
        return self.receive(timeout_s)

    def _crash(self, timeout_s: float | None = None) -> NativeCrashError:
        self._process.join(JOIN_S)
        return NativeCrashError(self.what, self._process.exitcode, self.build, timeout_s)

    def close(self) -> None:
        """Ask the child to finish (a None message), then make sure it has. Idempotent."""
        if self._conn.closed:
            return
        if self._process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._process.join(JOIN_S)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(JOIN_S)
        self._conn.close()
        self._process.close()


def recorded_llama_cpp_build() -> str:
    """The CMake flags `make peers` recorded next to the llama-cpp-python it installed (a stamp
    in the environment's prefix), or "" when it was installed some other way."""
    for stamp in sorted(glob.glob(os.path.join(sys.prefix, ".llama-cpp-*"))):
        try:
            with open(stamp, encoding="utf-8") as handle:
                flags = handle.read().strip()
        except OSError:
            continue
        if flags:
            return flags
    return ""
