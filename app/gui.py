"""Start the desktop app: QApplication, the engine thread, the window, the first model load.

The Qt event loop runs through qasync, so asyncio I/O (remote backends' HTTP streams) runs on
it, on the GUI thread; the torch decode loop keeps its own engine thread.

`--smoke-test` drives the real window: it sends one prompt through the GUI path (greedy),
waits for the reply, prints one JSON line and exits; it uses a throwaway chat database and
settings file so it never touches the user's chats.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app import __version__

if TYPE_CHECKING:
    from PySide6.QtCore import QSettings

    from engine.backends import BackendRouter
    from engine.protocol import Backend
    from engine.worker import Engine
    from ui.main_window import MainWindow
    from ui.store import ChatStore

# The instruction matters: on the bare question, the 4-bit GGUF through llama.cpp (its own
# generate() too) answers "L'Étoile, la Marseillaise..."; fp32 weights answer Paris either way.
SMOKE_PROMPT = "What is the capital of France? Answer in one sentence."
SMOKE_MAX_TOKENS = 64
SMOKE_TIMEOUT_MS = 600_000  # the first start converts the GGUF (tens of seconds)


def has_display() -> bool:
    """False on Linux with no X/Wayland display and no QT_QPA_PLATFORM (Qt would abort)."""
    if not sys.platform.startswith("linux"):
        return True
    return any(os.environ.get(v) for v in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"))


def build_backend(local: Engine | None = None,
                  loop: asyncio.AbstractEventLoop | None = None,
                  snapshot_dir: Path | None = None) -> BackendRouter:
    """What the window talks to: a router over the local engine (and, once loaded, a remote
    backend), not started. Tests pass their own engine with the tiny model loaded. Chats' KV
    snapshots live in the user cache (snapshot_dir overrides it)."""
    from engine.backends import BackendRouter
    from engine.model_files import kv_snapshot_dir
    from engine.worker import Engine

    engine = local or Engine(snapshot_dir=snapshot_dir or kv_snapshot_dir())
    return BackendRouter(engine, loop=loop)


def build_window(backend: Backend, store: ChatStore, settings: QSettings, *,
                 load_options: dict[str, Any] | None = None,
                 hud_calibrate: bool = True) -> MainWindow:
    """The chat window on a backend, wired as the app runs it (tests build it here too)."""
    from ui.main_window import MainWindow

    return MainWindow(backend, store, settings, load_options=load_options,
                      hud_calibrate=hud_calibrate)


def run_gui(
    model: str = "default",
    *,
    device: str = "auto",
    dtype: str = "auto",
    kernel: str = "auto",
    engine: str = "auto",
    allow_download: bool = False,
    smoke_test: bool = False,
    backend: str | None = None,
    backend_model: str | None = None,
) -> int:
    """Open the chat window and run until it closes; returns the process exit code."""
    if not has_display():
        print("phasewise: error: no display found (set DISPLAY, or QT_QPA_PLATFORM=offscreen "
              "to run headless)", file=sys.stderr)
        return 1
    from PySide6.QtWidgets import QApplication
    from qasync import QEventLoop  # after PySide6: qasync binds to the Qt already imported

    from engine.remote import close_async_generators_on
    from ui.theme import apply_theme

    app = QApplication.instance() or QApplication([sys.argv[0] if sys.argv else "phasewise"])
    assert isinstance(app, QApplication)
    app.setOrganizationName("Phasewise")
    app.setApplicationName("Phasewise")
    app.setApplicationVersion(__version__)
    apply_theme(app)
    loop = QEventLoop(app)
    asyncio.set_event_loop(loop)
    close_async_generators_on(loop)  # qasync leaves this to the garbage collector
    with loop:
        return _run_window(loop, model, backend, backend_model, smoke_test,
                           {"device": device, "dtype": dtype, "kernel": kernel, "engine": engine,
                            "allow_download": allow_download})


def _run_window(loop: asyncio.AbstractEventLoop, model: str, backend: str | None,
                backend_model: str | None, smoke_test: bool, load_options: dict) -> int:
    """The window on the running qasync loop; shuts the backends down before the loop closes."""
    from PySide6.QtCore import QSettings

    from engine.remote import REMOTE_SPEC
    from ui.store import ChatStore

    scratch = tempfile.TemporaryDirectory(prefix="phasewise-smoke-") if smoke_test else None
    if scratch is not None:
        store = ChatStore(Path(scratch.name) / "chats.sqlite3")
        settings = QSettings(str(Path(scratch.name) / "settings.ini"), QSettings.Format.IniFormat)
    else:
        store = ChatStore()
        settings = QSettings()
    kv = Path(scratch.name) / "kv-snapshots" if scratch is not None else None
    engine = build_backend(loop=loop, snapshot_dir=kv).start()  # local models and remotes
    try:
        window = build_window(engine, store, settings, load_options=load_options)
        window.show()
        restore_signals = close_on_signals(window)
        smoke = _SmokeTest(window) if smoke_test else None
        if backend:
            window.load_model(REMOTE_SPEC, base_url=backend, model=backend_model)
        else:
            window.load_model(model)
        code = loop.run_forever() or 0  # app.exec(), with the asyncio loop running on it
        if smoke is not None:
            code = smoke.exit_code
        window.close()
        restore_signals()
        return code
    finally:
        engine.shutdown()  # the loop has stopped: a remote's closing runs it once more
        store.close()
        if scratch is not None:
            scratch.cleanup()


def close_on_signals(window: MainWindow) -> Callable[[], None]:
    """SIGTERM (a logout, `kill`) and SIGINT (Ctrl+C in the terminal) close the window as Ctrl+Q
    does: replies kept as stopped, settings saved, every thread joined, exit code 0.

    Python runs a signal handler only when the interpreter next gets control; the Qt loop is
    C++, so the signal also writes a byte to a socket that a QSocketNotifier watches. Returns
    what puts the default handlers back."""
    import signal
    import socket

    from PySide6.QtCore import QSocketNotifier

    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno())
    notifier = QSocketNotifier(reader.fileno(), QSocketNotifier.Type.Read, window)

    def drain() -> None:
        with contextlib.suppress(OSError):
            reader.recv(64)

    notifier.activated.connect(drain)  # the handler below has run by the time this does
    previous = {number: signal.signal(number, lambda *_: window.close())
                for number in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        signal.set_wakeup_fd(-1)
        for number, handler in previous.items():
            signal.signal(number, handler)
        notifier.setEnabled(False)
        reader.close()
        writer.close()

    return restore


class _SmokeTest:
    """Sends one greedy prompt once the model is loaded; prints the result; quits the app."""

    def __init__(self, window) -> None:
        from PySide6.QtCore import QTimer

        self.window = window
        self.exit_code = 1
        window.bridge.sig_model_loaded.connect(self._send)
        window.bridge.sig_model_load_failed.connect(lambda m: self._fail(f"model load: {m}"))
        window.sig_reply_finished.connect(self._report)
        window.sig_reply_failed.connect(lambda m: self._fail(f"reply: {m}"))
        self._timeout = QTimer()
        self._timeout.setSingleShot(True)
        self._timeout.timeout.connect(lambda: self._fail("timed out waiting for the reply"))
        self._timeout.start(SMOKE_TIMEOUT_MS)

    def _send(self, _info: object) -> None:
        controls = self.window.controls
        controls.temperature.setValue(0)  # greedy: the same answer every run
        controls.max_tokens.setValue(SMOKE_MAX_TOKENS)
        self.window.composer.set_text(SMOKE_PROMPT)
        if not self.window.send(self.window.composer.text()):
            self._fail(self.window.notice_label.text())

    def _report(self, result) -> None:
        m, info = result.metrics, result.model
        ok = bool(result.text.strip())
        print(json.dumps({
            "ok": ok, "reply": result.text, "text": result.text,
            "finish_reason": result.finish_reason, "ttft_s": m.ttft_s,
            "output_tokens": m.output_tokens, "decode_tok_s": m.decode_tok_s, "e2e_s": m.e2e_s,
            "model": info.name if info else "", "device": info.device if info else "",
            "dtype": info.dtype if info else "", "engine": info.engine if info else "",
            "kernel": info.kernel if info else "",
            "painted_inserts": self.window.chat.insert_count,
        }), flush=True)
        if not ok:
            print("phasewise: smoke test failed: the reply was empty", file=sys.stderr)
        self._quit(0 if ok else 1)

    def _fail(self, message: str) -> None:
        print(f"phasewise: smoke test failed: {message}", file=sys.stderr)
        self._quit(1)

    def _quit(self, code: int) -> None:
        from PySide6.QtWidgets import QApplication

        self._timeout.stop()
        self.exit_code = code
        QApplication.exit(code)
