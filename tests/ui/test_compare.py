"""Compare mode: one prompt on two backends at once (the tiny local engine, `phasewise serve`
and misbehaving fake servers), overlaid plots and a table of each side's own metrics."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from PySide6.QtCore import Qt

from app.serve import ServerThread
from engine import ChatMessage, GenerationRequest, SamplingParams
from engine.backends import BackendRouter
from engine.remote import RemoteConfig, RemoteEngine
from engine.worker import Engine
from tests.support.fake_servers import PARTIAL, fake_app
from ui.compare import MISSING, TABLE_ROWS, UNKNOWN, CompareDialog, format_value

WAIT_MS = 30_000
GREEDY = SamplingParams(temperature=0, max_tokens=8)
ROLE = Qt.ItemDataRole.UserRole


@pytest.fixture
def remote_factory(qtbot, qasync_loop) -> Iterator[Callable[..., RemoteEngine]]:
    """Remote sides on the GUI's qasync loop, as the window's BackendRouter makes them."""
    made: list[RemoteEngine] = []

    def make(base_url: str, model: str | None, api_key: str | None) -> RemoteEngine:
        made.append(RemoteEngine(RemoteConfig(base_url, model=model, api_key=api_key),
                                 loop=qasync_loop))
        return made[-1]

    yield make
    for engine in made:
        engine.shutdown()  # on the loop's own thread: only scheduled
    for engine in made:
        qtbot.waitUntil(engine.closed.is_set, timeout=WAIT_MS)


def free_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


def make_dialog(qtbot, local: Engine | None, factory: Any, urls: dict[int, str],
                params: SamplingParams = GREEDY) -> CompareDialog:
    dialog = CompareDialog(local, factory, params=params, prompt="Hello, how are you?")
    qtbot.addWidget(dialog)
    dialog.show()
    for side, url in urls.items():
        dialog.pickers[side].set_kind("remote")
        dialog.pickers[side].remote.url.setText(url)
    return dialog


def run_to_end(qtbot, dialog: CompareDialog) -> None:
    with qtbot.waitSignal(dialog.sig_finished, timeout=WAIT_MS):
        assert dialog.run()


def column(dialog: CompareDialog, col: int) -> list[tuple[str, Any]]:
    items = [dialog.table.item(row, col) for row in range(len(TABLE_ROWS))]
    return [(item.text(), item.data(ROLE)) for item in items]


def test_local_and_remote_both_complete_and_the_table_shows_their_metrics(
    qtbot, tiny_engine: Engine, phasewise_server: ServerThread, remote_factory, qasync_loop
) -> None:
    dialog = make_dialog(qtbot, tiny_engine, remote_factory, {1: phasewise_server.base_url})
    run_to_end(qtbot, dialog)
    local, remote = dialog.sides
    assert local.engine is tiny_engine and remote.engine.loop is qasync_loop
    metrics = []
    for col, side in enumerate(dialog.sides):
        assert side.error is None and side.result.finish_reason in ("stop", "length")
        assert dialog.replies[col].toPlainText() == side.result.text
        m = side.result.metrics
        metrics.append(m)
        expected = [value(m) for _, value in TABLE_ROWS]
        assert column(dialog, col) == [(format_value(v), v) for v in expected]
        assert dialog.itl_curves[col].yData.tolist() == [s * 1e3 for s in m.itl_s]
        assert dialog.throughput_curves[col].name() == side.label
    a, b = metrics
    assert dialog.table.item(0, 0).data(ROLE) == a.ttft_s * 1e3
    assert dialog.table.item(5, 1).data(ROLE) == b.prompt_tokens > 0  # the server said
    assert dialog.table.item(0, 2).data(ROLE) == (b.ttft_s * 1e3) / (a.ttft_s * 1e3)
    assert dialog.ttft_bars.opts["height"] == [a.ttft_s * 1e3, b.ttft_s * 1e3]
    assert "local" in local.label and remote.result.model.name in remote.label


@pytest.mark.parametrize(("fault", "message"), [
    ("unauthorized", "the server refused the API key (HTTP 401)"),
    ("server_error", "the server answered HTTP 500: model crashed"),
    ("unreachable", "cannot reach http://127.0.0.1:"),
])
def test_one_failing_side_shows_its_error_and_the_other_completes(
    qtbot, tiny_engine: Engine, remote_factory, fault: str, message: str
) -> None:
    with contextlib.ExitStack() as stack:
        url = (free_url() if fault == "unreachable"
               else stack.enter_context(ServerThread(fake_app(fault))).base_url)
        dialog = make_dialog(qtbot, tiny_engine, remote_factory, {1: url})
        run_to_end(qtbot, dialog)
    ok, failed = dialog.sides
    assert ok.result is not None and ok.error is None
    assert dialog.replies[0].toPlainText() == ok.result.text
    assert failed.result is None and failed.error.startswith(message)
    status = dialog.reply_status[1].text()
    assert status == failed.error and "\n" not in status
    assert column(dialog, 1) == [(MISSING, None)] * len(TABLE_ROWS)
    assert column(dialog, 2) == [(MISSING, None)] * len(TABLE_ROWS)
    assert column(dialog, 0)[0] == (format_value(ok.result.metrics.ttft_s * 1e3),
                                    ok.result.metrics.ttft_s * 1e3)


def test_two_remote_backends_and_counts_a_server_does_not_report(
    qtbot, phasewise_server: ServerThread, remote_factory
) -> None:
    with ServerThread(fake_app("no_usage")) as quiet:
        dialog = make_dialog(qtbot, None, remote_factory,
                             {0: phasewise_server.base_url, 1: quiet.base_url})
        run_to_end(qtbot, dialog)
    served, fake = dialog.sides
    assert served.error is None and fake.error is None
    assert fake.result.text == "".join(PARTIAL)
    prompt_row = [name for name, _ in TABLE_ROWS].index("prompt tokens")
    assert dialog.table.item(prompt_row, 0).data(ROLE) == served.result.metrics.prompt_tokens
    assert dialog.table.item(prompt_row, 1).text() == UNKNOWN
    assert dialog.table.item(prompt_row, 2).text() == MISSING  # no ratio with an unknown
    tokens_row = [name for name, _ in TABLE_ROWS].index("output tokens")
    assert dialog.table.item(tokens_row, 1).data(ROLE) == len(PARTIAL)


class ForwardGate:
    """Holds the local model's forward passes after the first `free` ones until released,
    so a reply is provably still running when the dialog closes."""

    def __init__(self, engine: Engine, free: int) -> None:
        self.model = engine._runtime.loaded.model
        self._original = self.model.forward
        self._free = free
        self.open = threading.Event()
        self.model.forward = self._forward

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        self._free -= 1
        if self._free < 0:
            self.open.wait(WAIT_MS / 1000)
        return self._original(*args, **kwargs)

    def remove(self) -> None:
        self.open.set()
        self.model.forward = self._original


def test_closing_mid_run_cancels_both_sides(qtbot, tiny_engine: Engine, remote_factory) -> None:
    long_reply = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    gate = ForwardGate(tiny_engine, free=3)  # prefill and two decode steps, then hold
    try:
        with ServerThread(fake_app("stall")) as server:
            dialog = make_dialog(qtbot, tiny_engine, remote_factory, {1: server.base_url},
                                 long_reply)
            assert dialog.run()
            local, remote = dialog.sides
            qtbot.waitUntil(lambda: remote.text == "".join(PARTIAL) and bool(local.text),
                            timeout=WAIT_MS)
            dialog.close()
            gate.open.set()
            assert local.handle.wait(WAIT_MS / 1000).finish_reason == "cancelled"
            qtbot.waitUntil(lambda: remote.handle.result is not None, timeout=WAIT_MS)
            qtbot.waitUntil(remote.engine.closed.is_set, timeout=WAIT_MS)
    finally:
        gate.remove()
    assert local.handle.result.metrics.output_tokens < 200
    assert remote.handle.result.finish_reason == "cancelled"
    assert remote.handle.result.text == "".join(PARTIAL)
    # The local engine goes on serving (the chat's backend was never touched).
    again = tiny_engine.submit(GenerationRequest([ChatMessage("user", "Hi")], GREEDY))
    assert again.wait(WAIT_MS / 1000).finish_reason in ("stop", "length")


def test_stop_while_a_side_is_still_connecting_starts_neither(
    qtbot, tiny_engine: Engine, remote_factory
) -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        dialog = make_dialog(qtbot, tiny_engine, remote_factory, {1: url})
        assert dialog.run()
        local, remote = dialog.sides
        assert local.ready and not remote.ready  # the local side waits for the remote one
        with qtbot.waitSignal(dialog.sig_finished, timeout=WAIT_MS):
            dialog.stop()
    assert local.handle is None and remote.handle is None
    assert local.error == remote.error == "stopped before the reply started"
    assert dialog.run_button.isEnabled()


def test_the_window_menu_opens_compare_on_its_own_engine(
    qtbot, make_window, tiny_engine: Engine, phasewise_server: ServerThread,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window on a plain Engine: the local side is that engine; the remote side gets a
    loop thread of its own (no GUI loop to share); the chat is left alone."""
    monkeypatch.setenv("PHASEWISE_API_KEY", "test-key")  # keep the user's keyring out
    window = make_window()
    window.composer.set_text("What is 2 + 2?")
    action = next(a for a in window.menuBar().actions()[0].menu().actions()
                  if a.text() == "Compare backends…")
    action.trigger()
    dialog = window.findChild(CompareDialog)
    assert dialog is not None and dialog.isVisible()
    assert dialog.local is tiny_engine
    assert dialog.prompt.toPlainText() == "What is 2 + 2?"
    dialog.pickers[1].remote.url.setText(phasewise_server.base_url)
    run_to_end(qtbot, dialog)
    assert all(side.result is not None for side in dialog.sides)
    assert dialog.sides[1].engine.loop is not None and window.reply is None
    assert window.conversation_id is None or not window.store.messages(window.conversation_id)
    dialog.close()
    assert dialog.sides[1].engine.closed.is_set()  # its own loop: shutdown waits


def test_router_lends_its_loop_and_closes_lent_remotes(
    qtbot, qasync_loop, phasewise_server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHASEWISE_API_KEY", "test-key")
    router = BackendRouter(Engine(), loop=qasync_loop).start()
    remote = router.new_remote(phasewise_server.base_url).start()
    assert remote.loop is qasync_loop and remote.config.api_key == "test-key"
    remote.load_model()
    qtbot.waitUntil(lambda: remote.model_info is not None, timeout=WAIT_MS)
    router.shutdown()  # the lent remote's owner never closed it
    qtbot.waitUntil(remote.closed.is_set, timeout=WAIT_MS)
