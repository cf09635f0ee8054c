"""The window chatting through a remote backend: `phasewise serve` and a faulty fake server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings

from app.serve import ServerThread
from engine import Engine
from engine.backends import BackendRouter
from engine.remote import REMOTE_SPEC
from tests.fake_servers import PARTIAL, fake_app
from tests.serving import phasewise_server, served_engine
from ui.main_window import MainWindow
from ui.model_picker import ModelPickerDialog
from ui.store import ChatStore

__all__ = ["phasewise_server", "served_engine"]  # fixtures used below
WAIT_MS = 30_000


@pytest.fixture
def router(monkeypatch: pytest.MonkeyPatch) -> Iterator[BackendRouter]:
    """A window's engine front with no local model loaded (the remote does the work)."""
    monkeypatch.setenv("PHASEWISE_API_KEY", "test-key")  # keep the user's keyring out
    with BackendRouter(Engine()) as backends:
        yield backends


@pytest.fixture
def remote_window(qtbot, router: BackendRouter,
                  tmp_path: Path) -> Iterator[Callable[[str], MainWindow]]:
    stores: list[ChatStore] = []

    def connect(base_url: str) -> MainWindow:
        store = ChatStore(tmp_path / "chats.sqlite3")
        stores.append(store)
        settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
        window = MainWindow(router, store, settings, hud_calibrate=False)
        qtbot.addWidget(window)
        with qtbot.waitSignal(window.bridge.sig_model_loaded, timeout=WAIT_MS):
            window.load_model(REMOTE_SPEC, base_url=base_url)
        return window

    yield connect
    for store in stores:
        store.close()


def send_and_wait(qtbot, window: MainWindow, text: str):
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS) as blocker:
        assert window.send(text)
    return blocker.args[0]


def test_chat_streams_through_phasewise_serve_with_hud(
    qtbot, remote_window, phasewise_server: ServerThread, router: BackendRouter
) -> None:
    window = remote_window(phasewise_server.base_url)
    assert router.is_remote
    assert window.model_info.source == "remote"
    window.controls.temperature.setValue(0)
    window.controls.max_tokens.setValue(6)
    result = send_and_wait(qtbot, window, "Hello")
    assert result.model.source == "remote" and result.error is None
    saved = window.store.messages(window.conversation_id)[-1]
    assert saved.content == result.text and saved.metrics["prompt_tokens"] > 0
    finished = window.hud.model.finished()
    assert finished and finished[-1].metrics.output_tokens == result.metrics.output_tokens
    # The second turn goes through the same backend and reuses the server's cache.
    second = send_and_wait(qtbot, window, "And again?")
    assert second.metrics.cached_tokens > 0


def test_broken_stream_keeps_the_partial_reply_and_says_why(qtbot, remote_window) -> None:
    with ServerThread(fake_app("error_mid_stream")) as server:
        window = remote_window(server.base_url)
        result = send_and_wait(qtbot, window, "Hello")
    assert result.finish_reason == "error"
    saved = window.store.messages(window.conversation_id)[-1]
    assert saved.content == "".join(PARTIAL)
    assert "CUDA out of memory" in window.notice_label.text()
    assert "partial reply was kept" in window.notice_label.text()
    assert window.reply is None  # the window is ready for the next message


def test_picker_offers_a_remote_backend(qtbot) -> None:
    dialog = ModelPickerDialog()
    qtbot.addWidget(dialog)
    dialog.remote_url.setText("http://gpu-box:8000")
    dialog.remote_url.textEdited.emit("http://gpu-box:8000")
    dialog.remote_model.setText("meta-llama/Llama-3.1-70B-Instruct")
    choice = dialog.choice()
    assert choice.spec == REMOTE_SPEC
    assert choice.options == {"base_url": "http://gpu-box:8000/v1",
                              "model": "meta-llama/Llama-3.1-70B-Instruct"}
    dialog.remote_url.setText("gpu-box:8000")
    with pytest.raises(ValueError, match="http:// or https://"):
        dialog.choice()
