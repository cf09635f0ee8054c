"""Security checks: no remote code, no pickle unless allowed, inert rendering, no network."""

from __future__ import annotations

import pickle
import re
import shutil
import socket
from pathlib import Path

import pytest
from PySide6.QtCore import QUrl

from engine.runtimes.torch.loader import load_model
from ui.chat_view import ChatView
from ui.store import Message

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("app", "engine", "ui", "packaging", "benchmarks")
HOSTILE_OUTPUT = (
    "<script>fetch('http://evil.example/x')</script><img src='http://evil.example/t.png'>\n\n"
    "![remote](http://evil.example/pic.png) ![local](file:///etc/passwd)\n\n"
    "<link rel=stylesheet href='http://evil.example/s.css'>"
    "<style>@import url(http://evil.example/i.css);</style>\n\n"
    "[js](javascript:alert(1)) [file](file:///etc/passwd) <http://evil.example/auto>\n\n"
    "RTL: \u202eevil.exe\u202c שלום עולם, zero\u200bwidth, combining e\u0301 a\u0308, 👩‍👩‍👧\n\n"
    "```\n" + "x = '<b>' * 10\n" * 5000 + "```\n"
)


class RecordingChatView(ChatView):
    """The real chat view, recording every resource Qt asks it to load."""

    def __init__(self) -> None:
        self.requested: list[str] = []
        super().__init__()

    def loadResource(self, kind: int, url: QUrl) -> object:
        self.requested.append(url.toString())
        return super().loadResource(kind, url)


def test_no_trust_remote_code_anywhere() -> None:
    """Every trust_remote_code= in the shipped code is the literal False."""
    enabled = re.compile(r"trust_remote_code\s*=(?!\s*False\b)")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in SOURCE_DIRS for path in (ROOT / folder).rglob("*.py")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if enabled.search(line)
    ]
    assert offenders == []


def test_pickle_next_to_safetensors_is_never_unpickled(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "mixed"
    shutil.copytree(tiny_model_dir, folder)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    load_model(str(folder))
    assert not marker.exists()


def test_rendering_hostile_output_makes_no_network_request(qtbot, monkeypatch) -> None:
    attempts: list[object] = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access during a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    view = RecordingChatView()
    qtbot.addWidget(view)
    view.resize(600, 400)
    view.show()
    view.show_messages([Message(1, "c", "assistant", HOSTILE_OUTPUT, "done", None, None)])
    view.begin_stream("r")
    view.push_token("r", 0, HOSTILE_OUTPUT)
    view.end_stream()
    for plain in (True, False):
        view.set_plain_text(plain)
    qtbot.waitExposed(view)
    view.repaint()

    assert attempts == []
    assert [u for u in view.requested if not u.startswith(("pw-", "data:"))] == []


def test_hostile_output_renders_its_exact_characters(qtbot) -> None:
    view = ChatView()
    qtbot.addWidget(view)
    view.show_messages([Message(1, "c", "assistant", HOSTILE_OUTPUT, "done", None, None)])
    text = view.toPlainText()
    for piece in ("<script>fetch(", "\u202eevil.exe\u202c", "zero\u200bwidth", "e\u0301 a\u0308",
                  "👩‍👩‍👧", "שלום עולם", "[image: remote]"):
        assert piece in text
    code = "x = '<b>' * 10\n" * 5000
    assert view._code_blocks[(1, 0)] == code.rstrip("\n")


@pytest.mark.parametrize("scheme", ["javascript:alert(1)", "file:///etc/passwd",
                                    "data:text/html,x", "pw-copy:9/9"])
def test_clicks_on_non_http_links_open_nothing(qtbot, monkeypatch, scheme: str) -> None:
    from PySide6.QtGui import QDesktopServices

    opened: list[str] = []
    monkeypatch.setattr(QDesktopServices, "openUrl", lambda url: opened.append(url.toString()))
    view = ChatView()
    qtbot.addWidget(view)
    view.anchorClicked.emit(QUrl(scheme))
    assert opened == []
