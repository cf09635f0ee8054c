"""Inject faults into a running engine's model: raise on the Nth forward, or script its tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.worker import Engine


class ForwardFault:
    """Wraps the engine's model forward. Armed, the `at`-th call from now raises `error`
    (call 1 is the prefill of the next request, later calls are decode steps); it fires once."""

    def __init__(self, engine: Engine) -> None:
        self.model = engine._runtime.loaded.model
        self._original: Callable[..., Any] = self.model.forward
        self._countdown = 0
        self._error: BaseException | None = None
        self.fired = 0
        self.model.forward = self._forward

    def arm(self, error: BaseException, at: int = 1) -> None:
        self._error, self._countdown = error, at

    def remove(self) -> None:
        self.model.forward = self._original

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._error is not None:
            self._countdown -= 1
            if self._countdown == 0:
                error, self._error = self._error, None
                self.fired += 1
                raise error
        return self._original(*args, **kwargs)


class ScriptedTokens:
    """Makes greedy decoding emit `ids` in order: each forward's last-row logits become a
    one-hot of the next scripted id (the prefill picks ids[0])."""

    def __init__(self, engine: Engine, ids: Sequence[int]) -> None:
        self.model = engine._runtime.loaded.model
        self._original: Callable[..., Any] = self.model.forward
        self._ids = list(ids)
        self._next = 0
        self.model.forward = self._forward

    def remove(self) -> None:
        self.model.forward = self._original

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self._original(*args, **kwargs)
        if self._next < len(self._ids):
            row = torch.full_like(out.logits[0, -1], -1e4)
            row[self._ids[self._next]] = 1e4
            out.logits[0, -1] = row
            self._next += 1
        return out
