"""Progress and Stop from inside one llama_decode, node by node of its graph.

ggml's CPU backend calls the context's abort callback (llama_set_abort_callback) on compute
thread 0, which is the thread that called llama_decode, after each node of the graph
(ggml_graph_compute_thread), and stops the graph when it returns true: llama_decode then returns
2 and removes that ubatch's positions from the KV memory (the ones before it stay). A chunk's
graph runs the same nodes layer after layer, so nodes done / nodes in the graph is how far the
chunk has gone through the model. The graph's node count is learned from the first whole decode
under a meter and kept on the model (the SmolLM2 GGUF: 515).

Each node costs a call into Python (a few microseconds). Against a prefill chunk that is
nothing (a lone 4,000-token prompt in 512-token chunks, Xeon VM: 149 and 165 tok/s with the
meter against 139 and 142 without, alternating in one process), but a decode step is ~10 ms, so
a meter is installed only around a prefill chunk's decode and taken off after it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from engine.runtimes.llamacpp.model import LlamaCppModel


class GraphMeter:
    """Runs llama_decode on ctx with on_fraction(share of the graph done) after each node,
    aborting it (code 2) once should_stop() says so. Use it from the thread that calls
    llama_decode on ctx (the callback runs there)."""

    def __init__(self, loaded: LlamaCppModel, ctx: Any, on_fraction: Callable[[float], None],
                 should_stop: Callable[[], bool]) -> None:
        self.loaded = loaded
        self.ctx = ctx
        self.on_fraction = on_fraction
        self.should_stop = should_stop
        self._error: BaseException | None = None  # raised in the callback; the decode aborted
        self._interrupted = False  # Ctrl+C came during the graph: stop it, then raise
        self._nodes = 0
        self._callback = loaded.llama_cpp.ggml_abort_callback(self._after_node)

    def decode(self, batch: Any) -> int:
        """llama_decode(ctx, batch) under the meter: its return code (ABORTED when stopped);
        what the callback raised is raised here."""
        lib = self.loaded.llama_cpp
        self._nodes, self._error, self._interrupted = 0, None, False
        lib.llama_set_abort_callback(self.ctx, self._callback, None)
        try:
            with self._ctrl_c_deferred():
                code = int(lib.llama_decode(self.ctx, batch))
        finally:
            lib.llama_set_abort_callback(self.ctx, lib.ggml_abort_callback(), None)
        if self._interrupted:
            raise KeyboardInterrupt
        if self._error is not None:
            raise self._error
        if code == 0:
            self.loaded.graph_nodes = max(self.loaded.graph_nodes, self._nodes)
        return code

    @contextlib.contextmanager
    def _ctrl_c_deferred(self) -> Iterator[None]:
        """On the main thread (`phasewise bench` decodes there), Python runs a SIGINT handler
        at the next bytecode, which is inside the callback: a KeyboardInterrupt raised there,
        even before its try, is printed and dropped by ctypes and the graph runs on. So while
        the graph runs, Ctrl+C only marks the meter; the graph stops at the next node and
        decode() raises KeyboardInterrupt. A handler someone else installed stays as it is."""
        if (threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
            yield
            return
        signal.signal(signal.SIGINT, self._mark_interrupted)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _mark_interrupted(self, _signum: int, _frame: object) -> None:
        self._interrupted = True

    def _after_node(self, _data: Any) -> bool:
        # An exception must not cross into C: it stops the graph and waits in self._error.
        if self._interrupted:
            return True
        try:
            self._nodes += 1
            if self.loaded.graph_nodes:
                self.on_fraction(self._nodes / self.loaded.graph_nodes)
            return self.should_stop()
        except BaseException as exc:
            self._error = exc
            return True
