"""How far one forward has gone through a transformers model: a hook on each decoder layer.

transformers' decoder layers all derive from GradientCheckpointingLayer (each architecture the
tests build, tests/support/tiny_model.py, has exactly num_hidden_layers of them), so they are
found by type, whatever the model calls its layer list. On a CPU a layer's hook runs once its
ops have run (they run eagerly); on a GPU it would run when its kernels were queued, so there
it says nothing true and is not used. The hooks are on the model, which the engine thread may
be running at the same time (a prompt prefilled beside streaming rows), so they only count
calls from the thread that installed them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers, in the order a forward runs them."""
    # Imported here: the llama.cpp engine imports engine.runtimes.torch.generate, and starts without
    # transformers (tests/runtimes/test_llamacpp_startup.py).
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


class LayerProgress:
    """While entered, on_fraction((i + 1) / len(layers)) after layer i's forward in this
    thread."""

    def __init__(self, layers: list[torch.nn.Module],
                 on_fraction: Callable[[float], None]) -> None:
        self.layers = layers
        self.on_fraction = on_fraction
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._thread = 0

    def __enter__(self) -> LayerProgress:
        self._thread = threading.get_ident()
        self._handles = [layer.register_forward_hook(self._hook(i + 1))
                         for i, layer in enumerate(self.layers)]
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layers_done: int) -> Callable[..., None]:
        fraction = layers_done / len(self.layers)

        def after_layer(_module: torch.nn.Module, _args: Any, _output: Any) -> None:
            if threading.get_ident() == self._thread:
                self.on_fraction(fraction)

        return after_layer
