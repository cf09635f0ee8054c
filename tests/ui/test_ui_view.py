"""Chat view streaming and hostile Markdown, without an engine."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QUrl
from PySide6.QtGui import QDesktopServices, QGuiApplication, QTextFormat

from ui.chat_view import ChatView
from ui.markdown import render_markdown
from ui.store import Message

HOSTILE = (
    "Look: <img src=http://evil.example/track.png> <script>alert(1)</script>\n\n"
    "[click](javascript:alert(1)) [file](file:///etc/passwd) [data](data:text/html,hi) "
    "![pic](http://evil.example/pic.png) <javascript:alert(2)> [ok](https://example.org)\n\n"
    "<iframe src='http://evil.example'></iframe>\n\n"
    "```python\nprint('<b>hi</b>')\n```\n"
)


def message(content: str, role: str = "assistant", id_: int = 1) -> Message:
    return Message(id_, "c", role, content, "done", None, None)


def anchors(view: ChatView) -> list[str]:
    """Every link target in the rendered document."""
    found = []
    block = view.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fmt = it.fragment().charFormat()
            if fmt.isAnchor():
                found.append(fmt.anchorHref())
            it += 1
        block = block.next()
    return found


def images(view: ChatView) -> int:
    count = 0
    block = view.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            if it.fragment().charFormat().objectType() == QTextFormat.ObjectTypes.ImageObject:
                count += 1
            it += 1
        block = block.next()
    return count


def test_first_token_painted_at_once_then_coalesced(qtbot) -> None:
    view = ChatView()
    qtbot.addWidget(view)
    painted: list[int] = []
    view.sig_tokens_painted.connect(lambda _rid, idx, _ns: painted.extend(idx))
    view.begin_stream("r1")

    view.push_token("r1", 0, "Hello")
    assert view.insert_count == 1 and painted == [0]  # synchronously, no timer wait

    for i in range(1, 100):
        view.push_token("r1", i, f" w{i}")
    assert view.insert_count == 1  # buffered until the next tick
    qtbot.waitUntil(lambda: view.insert_count == 2, timeout=2000)
    assert painted == list(range(100))  # 99 tokens, one insert
    view.push_token("other", 100, " ignored")
    view.end_stream()
    expected = "Hello" + "".join(f" w{i}" for i in range(1, 100))
    assert view.streamed_text == expected
    assert view.toPlainText().endswith(expected)


def test_hostile_markdown_is_inert() -> None:
    rendered = render_markdown(HOSTILE, 1)
    body = rendered.html.lower()
    assert "<script" not in body and "<img" not in body and "<iframe" not in body
    assert 'href="javascript' not in body and 'href="file' not in body
    assert 'href="data' not in body and "http://evil.example/pic.png" not in body
    assert "&lt;script&gt;" in body
    assert 'href="https://example.org"' in body
    assert rendered.code_blocks == ["print('<b>hi</b>')"]


def test_view_has_only_safe_links_and_no_images(qtbot) -> None:
    view = ChatView()
    qtbot.addWidget(view)
    view.show_messages([message(HOSTILE)])
    hrefs = anchors(view)
    schemes = {QUrl(h).scheme() for h in hrefs}
    assert schemes <= {"https", "http", "pw-action", "pw-copy"}
    assert "https://example.org" in hrefs
    assert images(view) == 0
    assert view.loadResource(0, QUrl("http://evil.example/pic.png")) is None


def test_links_open_only_on_click_and_only_http(qtbot, monkeypatch) -> None:
    opened: list[str] = []
    monkeypatch.setattr(QDesktopServices, "openUrl", lambda url: opened.append(url.toString()))
    view = ChatView()
    qtbot.addWidget(view)
    view.show_messages([message(HOSTILE)])
    assert opened == []
    for url in ("javascript:alert(1)", "file:///etc/passwd", "data:text/html,hi",
                "https://example.org"):
        view.anchorClicked.emit(QUrl(url))
    assert opened == ["https://example.org"]


def test_code_copy_and_message_actions(qtbot) -> None:
    view = ChatView()
    qtbot.addWidget(view)
    view.show_messages([message("hi", "user", 1), message(HOSTILE, "assistant", 2)])
    assert "pw-copy:2/0" in anchors(view)
    assert {"pw-action:edit/1", "pw-action:regenerate/2", "pw-action:copy/2"} <= set(anchors(view))
    view.anchorClicked.emit(QUrl("pw-copy:2/0"))
    assert QGuiApplication.clipboard().text() == "print('<b>hi</b>')"
    with qtbot.waitSignal(view.sig_action) as blocker:
        view.anchorClicked.emit(QUrl("pw-action:regenerate/2"))
    assert blocker.args == ["regenerate", 2]


@pytest.mark.parametrize("plain", [True, False])
def test_plain_text_toggle(qtbot, plain: bool) -> None:
    view = ChatView()
    qtbot.addWidget(view)
    view.show_messages([message("**bold** <script>x</script>")])
    view.set_plain_text(plain)
    text = view.toPlainText()
    assert "<script>x</script>" in text
    assert ("**bold**" in text) is plain


def test_a_poem_keeps_its_line_breaks_on_screen(qtbot, make_window) -> None:
    """Issue 31 item 10: single newlines were joined into one line (CommonMark soft breaks);
    Copy kept them. Shown as a chat app does: each on its own line, paragraphs still apart."""
    window = make_window()
    store = window.store
    chat = store.create_conversation("Poem")
    store.add_message(chat, "user", "A poem, please")
    poem = "Roses are red,\nviolets are blue,\n\nsugar is sweet,\nand so are you."
    store.add_message(chat, "assistant", poem)
    window.open_conversation(chat)
    shown = window.chat.toPlainText()
    assert "Roses are red,\nviolets are blue,\n" in shown
    assert "sugar is sweet,\nand so are you." in shown
    assert "red, violets" not in shown
