"""Threads that may be inside native code (torch, llama.cpp), and how the process ends with them.

Why this exists: when Python finalizes, a daemon thread that comes back from native code and
asks for the GIL is ended with pthread_exit. The forced unwind that follows runs through the
C++ frame that released the GIL (torch's pybind11 `gil_scoped_release`, a destructor, hence
noexcept), and the C++ runtime calls std::terminate: "terminate called without an active
exception", SIGABRT, after the app has already answered. That is how the installed app died as
it quit: the HUD's device calibration (a timed `copy_` on a daemon thread) was still running.

So the rule: a thread of ours that may call native code is named "phasewise-..." and its
owner stops and joins it when it closes. Short-lived work starts with `start_worker` (never a
daemon, so even a forgotten one is waited for before finalizing); the long-lived engine and
side-prefill threads stay daemons (an idle one blocks in a queue) and are joined by
Engine.shutdown and SideWorker.close. What an owner could not join in time (a model load
cannot always be interrupted) is found by `stragglers`, and the process ends with
`exit_without_finalizing`, which never runs the finalizer under it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable

PREFIX = "phasewise-"
log = logging.getLogger(__name__)


def start_worker(target: Callable[[], object], name: str) -> threading.Thread:
    """Start `target` on a non-daemon thread called "phasewise-<name>" and return it."""
    thread = threading.Thread(target=target, name=PREFIX + name, daemon=False)
    thread.start()
    return thread


def stragglers(grace_s: float = 0.0) -> list[threading.Thread]:
    """Our threads still alive after waiting up to `grace_s` seconds in all for them."""
    live = [t for t in threading.enumerate()
            if t.name.startswith(PREFIX) and t is not threading.current_thread()]
    for thread in live:
        thread.join(grace_s / max(len(live), 1))
    return [t for t in live if t.is_alive()]


def exit_without_finalizing(code: int, stuck: list[threading.Thread]) -> None:
    """End the process now with `code`: streams flushed, the interpreter not finalized (it
    would abort under a thread inside native code). Callers have saved what must be saved."""
    names = ", ".join(sorted(t.name for t in stuck))
    print(f"phasewise: {names} still busy at exit; ending without waiting for it",
          file=sys.stderr)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say
            stream.flush()
    os._exit(code)


def settle(code: int, grace_s: float = 5.0) -> int:
    """The last step of a command: wait a little for our threads; if one is still inside
    native code, end the process here instead of finalizing under it. Returns `code`."""
    stuck = stragglers(grace_s)
    if stuck:
        log.debug("stuck at exit: %s", [t.name for t in stuck])
        exit_without_finalizing(code, stuck)
    return code
