"""The engine thread does a runtime's idle work (huge pages for a llama.cpp model) only while
nothing waits, and a request never waits for more than one piece of it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import engine.runtimes as runtimes
from engine import ChatMessage, GenerationRequest, RequestFinished, SamplingParams
from engine.events import PrefillStarted
from engine.metrics import now_ns
from engine.worker import Engine


class IdleWork:
    """A runtime's idle_work: `pieces` pieces (None: endless), each call stamped."""

    def __init__(self, pieces: int | None) -> None:
        self.left = pieces
        self.calls: list[int] = []
        self.finished = threading.Event()

    def __call__(self) -> bool:
        self.calls.append(now_ns())
        time.sleep(0.001)
        if self.left is None:
            return True
        self.left = max(self.left - 1, 0)
        if not self.left:
            self.finished.set()
        return bool(self.left)


@contextmanager
def engine_with(work: IdleWork, model_dir: Path, monkeypatch: pytest.MonkeyPatch
                ) -> Iterator[Engine]:
    load = runtimes.load

    def load_with_work(*args: Any, **kwargs: Any) -> Any:
        runtime = load(*args, **kwargs)
        runtime.idle_work = work  # type: ignore[method-assign]
        return runtime

    monkeypatch.setattr(runtimes, "load", load_with_work)
    with Engine(cache_budget_bytes=64 << 20) as engine:
        engine.load_model_sync(str(model_dir), kernel="fp32-eager")
        yield engine


def ask() -> GenerationRequest:
    return GenerationRequest([ChatMessage("user", "Hello")],
                             SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))


def test_idle_work_is_done_after_a_load_and_never_inside_a_request(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = IdleWork(pieces=5)
    with engine_with(work, tiny_model_dir, monkeypatch) as engine:
        assert work.finished.wait(30), "the engine did its idle work while nothing waited"
        assert len(work.calls) == 5
        handle = engine.submit(ask())
        events = list(handle.events(timeout=60))
        start = next(e.t_ns for e in events if isinstance(e, PrefillStarted))
        end = next(e.t_ns for e in events if isinstance(e, RequestFinished))
        assert not [t for t in work.calls if start <= t <= end]
        assert handle.wait().metrics.output_tokens == 8


def test_a_request_is_served_while_idle_work_is_left(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = IdleWork(pieces=None)  # never done
    with engine_with(work, tiny_model_dir, monkeypatch) as engine:
        deadline = time.monotonic() + 30
        while len(work.calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(work.calls) >= 3
        result = engine.submit(ask()).wait(60)
        assert result.finish_reason == "length" and result.metrics.output_tokens == 8
