"""Shared fixtures: a tiny random model (most tests) and the real default model (a few)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from tests.support import isolation

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Before anything computes a path: the run's caches, data, config and keyring live in one
# temporary folder (tests/support/isolation.py), also for the child processes tests spawn.
ISOLATED_ROOT = isolation.isolate()

from engine.worker import Engine  # noqa: E402  (after the isolation above)
from tests.support.serving import TOKEN  # noqa: E402
from tests.support.tiny_model import build_tiny_model  # noqa: E402

REMOTE_WAIT_MS = 30_000

# Fuzz tests: modest and repeatable in CI; HYPOTHESIS_PROFILE=deep digs further by hand.
settings.register_profile(
    "ci", max_examples=40, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("deep", max_examples=2000, deadline=None, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run is over: its temporary home goes (converted model, probes, databases)."""
    isolation.remove(ISOLATED_ROOT)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama model folder (tokenizer + ChatML template included)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_model_no_template_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-no-template"), chat_template=False)


@pytest.fixture
def tiny_engine(tiny_model_dir: Path) -> Iterator[Engine]:
    """A started engine with the tiny model loaded (fp32-eager: the same path every run,
    and no timing probe; tests/runtimes/test_kernels.py covers kernel="auto")."""
    with Engine(cache_budget_bytes=64 << 20) as engine:
        engine.load_model_sync(str(tiny_model_dir), kernel="fp32-eager")
        yield engine


@pytest.fixture(scope="session")
def real_engine() -> Iterator[Engine]:
    """The bundled default model, shared by the session, on the torch engine
    (tests/runtimes/test_llamacpp_engine.py runs it on llama.cpp, in a child). Its conversion is
    cached in the run's own cache dir: done once per run, however many tests use it."""
    with Engine() as engine:
        engine.load_model_sync("default", engine="torch")
        yield engine


@pytest.fixture
def make_window(qtbot, tiny_engine: Engine, tmp_path: Path) -> Iterator[Callable[[], Any]]:
    """Build windows as the app does (app.gui's factories: a BackendRouter over the local
    engine, here the tiny one) that share one chat database and one settings file (a
    'restart')."""
    from PySide6.QtCore import QSettings

    from app.gui import build_backend, build_window
    from ui.store import ChatStore

    stores: list[ChatStore] = []
    router = build_backend(tiny_engine)  # tiny_engine is started and loaded already

    def make() -> Any:
        store = ChatStore(tmp_path / "chats.sqlite3")
        stores.append(store)
        settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
        window = build_window(router, store, settings, hud_calibrate=False)
        qtbot.addWidget(window)
        return window

    yield make
    for store in stores:
        store.close()


@pytest.fixture
def hud(qtbot) -> Any:
    """A HUD widget on its own (tests.support.window_helpers.new_hud) that has seen a model load;
    test_hud_widget.py overrides it with one that has device peaks instead."""
    from tests.support.hud_events import loaded_event
    from tests.support.window_helpers import new_hud

    widget = new_hud(qtbot)
    widget.on_engine_event(loaded_event())
    return widget


@pytest.fixture(scope="session")
def _qasync_session_loop(qapp: Any) -> Iterator[Any]:
    """One qasync loop on the test QApplication for the whole session: stopping a qasync
    loop quits the app, after which qtbot's waits would return at once."""
    import asyncio

    import qasync

    loop = qasync.QEventLoop(qapp, already_running=True)
    asyncio._set_running_loop(None)  # running only inside tests that ask for qasync_loop
    yield loop
    loop.stop()
    loop.close()


@pytest.fixture
def qasync_loop(_qasync_session_loop: Any) -> Iterator[Any]:
    """The GUI's asyncio loop, as in run_gui: qasync on the Qt event loop, so coroutines run
    on the GUI thread whenever Qt spins (qtbot's waits included)."""
    import asyncio

    from engine.remote import close_async_generators_on

    asyncio._set_running_loop(_qasync_session_loop)
    restore = close_async_generators_on(_qasync_session_loop)  # as run_gui does
    yield _qasync_session_loop
    restore()
    asyncio._set_running_loop(None)


# ----- servers on loopback, and windows chatting through them ------------------------------------
@pytest.fixture(scope="module")
def served_engine(tiny_model_dir: Path) -> Iterator[Engine]:
    with Engine(cache_budget_bytes=64 << 20) as engine:
        engine.load_model_sync(str(tiny_model_dir), kernel="fp32-eager")
        yield engine


@pytest.fixture(scope="module")
def phasewise_server(served_engine: Engine) -> Iterator[Any]:
    """`phasewise serve` on a free loopback port, no token."""
    from app.serve import ServerThread, create_app

    with ServerThread(create_app(served_engine)) as server:
        yield server


@pytest.fixture(scope="module")
def token_server(served_engine: Engine) -> Iterator[Any]:
    """The same engine served again, this time requiring a bearer token
    (tests.support.serving.TOKEN)."""
    from app.serve import ServerThread, create_app

    with ServerThread(create_app(served_engine, token=TOKEN)) as server:
        yield server


@pytest.fixture
def router(qtbot, qasync_loop, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The app's backend (app.gui.build_backend) on the GUI's qasync loop, no local model."""
    from app.gui import build_backend

    monkeypatch.setenv("PHASEWISE_API_KEY", "test-key")  # keep the user's keyring out
    backends = build_backend(loop=qasync_loop).start()
    yield backends
    remote = backends.remote
    backends.shutdown()  # on the loop's thread: the remote's closing is only scheduled
    if remote is not None:
        qtbot.waitUntil(remote.closed.is_set, timeout=REMOTE_WAIT_MS)


@pytest.fixture
def remote_window(qtbot, router: Any, tmp_path: Path) -> Iterator[Callable[[str], Any]]:
    """Windows (app.gui.build_window on `router`) connected to a server at a base URL."""
    from PySide6.QtCore import QSettings

    from app.gui import build_window
    from engine.remote import REMOTE_SPEC
    from ui.store import ChatStore

    stores: list[ChatStore] = []

    def connect(base_url: str) -> Any:
        store = ChatStore(tmp_path / "chats.sqlite3")
        stores.append(store)
        settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
        window = build_window(router, store, settings, hud_calibrate=False)
        qtbot.addWidget(window)
        with qtbot.waitSignal(window.bridge.sig_model_loaded, timeout=REMOTE_WAIT_MS):
            window.load_model(REMOTE_SPEC, base_url=base_url)
        return window

    yield connect
    for store in stores:
        store.close()
