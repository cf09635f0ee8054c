"""The window chatting through a remote backend: `phasewise serve` and a faulty fake server.

As in run_gui, remote backends stream on the qasync loop (the Qt event loop, GUI thread)."""

from __future__ import annotations

import threading

import pytest

from app.serve import ServerThread
from engine.backends import BackendRouter
from engine.events import TokenEmitted
from engine.remote import REMOTE_SPEC
from tests.support.fake_servers import PARTIAL, fake_app
from tests.support.window_helpers import WAIT_MS, greedy, send_and_wait
from ui.model_picker import ModelPickerDialog


def test_chat_streams_through_phasewise_serve_with_hud(
    qtbot, remote_window, phasewise_server: ServerThread, router: BackendRouter
) -> None:
    window = remote_window(phasewise_server.base_url)
    assert router.is_remote
    assert window.model_info.source == "remote"
    greedy(window, 6)
    result = send_and_wait(qtbot, window, "Hello")
    assert result.model.source == "remote" and result.error is None
    saved = window.store.messages(window.conversation_id)[-1]
    assert saved.content == result.text and saved.metrics["prompt_tokens"] > 0
    finished = window.hud.model.finished()
    assert finished and finished[-1].metrics.output_tokens == result.metrics.output_tokens
    # The second turn goes through the same backend and reuses the server's cache.
    second = send_and_wait(qtbot, window, "And again?")
    assert second.metrics.cached_tokens > 0


def test_remote_streams_on_the_gui_loop(
    qtbot, remote_window, phasewise_server: ServerThread, router: BackendRouter, qasync_loop
) -> None:
    window = remote_window(phasewise_server.base_url)
    assert router.remote.loop is qasync_loop
    threads: set[int] = set()
    router.add_listener(lambda _event: threads.add(threading.get_ident()))
    window.controls.max_tokens.setValue(16)  # the default runs to the tiny context: slow
    result = send_and_wait(qtbot, window, "Hello")
    assert result.error is None and threads == {threading.get_ident()}


def test_shutdown_on_the_gui_thread_never_waits_for_its_own_loop(
    qtbot, remote_window, router: BackendRouter
) -> None:
    """A stalled stream: shutdown() from the GUI thread returns before the loop could close
    anything (a wait there would deadlock), and the loop then cancels the reply and closes."""
    with ServerThread(fake_app("stall")) as server:
        window = remote_window(server.base_url)
        remote = router.remote
        with qtbot.waitSignal(window.bridge.sig_token, timeout=WAIT_MS,
                              check_params_cb=lambda e: isinstance(e, TokenEmitted)
                              and e.text == PARTIAL[-1]):
            assert window.send("Hello")
        with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS) as blocker:
            remote.shutdown()
            assert not remote.closed.is_set()
        qtbot.waitUntil(remote.closed.is_set, timeout=WAIT_MS)
    result = blocker.args[0]
    assert result.finish_reason == "cancelled" and result.text == "".join(PARTIAL)


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
