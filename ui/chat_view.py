"""The conversation view: finished messages as rendered Markdown, the live reply as plain text.

Streaming: the first token is inserted at once (TTFT is what the user perceives); later
tokens are buffered and a <= 60 Hz timer flushes them in one insert, so a fast model never
floods the GUI thread. When the reply ends the whole view is re-rendered as Markdown.
"""

from __future__ import annotations

import time

from PySide6.QtCore import QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication, QPalette, QTextCursor
from PySide6.QtWidgets import QTextBrowser, QWidget

from ui.markdown import COPY_SCHEME, Theme, is_safe_link, render_markdown, render_plain
from ui.store import DONE, Message

FLUSH_INTERVAL_MS = 17  # ~59 Hz: never more than one insert per frame
ACTION_SCHEME = "pw-action"  # our own links: pw-action:<action>/<message id>
STATUS_LABELS = {"stopped": "stopped", "length": "hit max tokens", "error": "failed"}


class ChatView(QTextBrowser):
    """Read-only transcript of one conversation with per-message action links."""

    sig_action = Signal(str, int)
    """A message action was clicked: (action in copy|edit|regenerate, message id)."""
    sig_tokens_painted = Signal(str, list, object)  # object: ns stamps overflow a C int
    """Tokens reached the screen: (request id, token indexes, time.perf_counter_ns())."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("chatView")
        self.setOpenLinks(False)  # every click goes through _on_anchor; nothing auto-opens
        self.setOpenExternalLinks(False)
        self.anchorClicked.connect(self._on_anchor)
        self.plain_text = False
        self.insert_count = 0  # streaming inserts, for tests and the coalescing check
        self._messages: list[Message] = []
        self._code_blocks: dict[tuple[int, int], str] = {}
        self._stream_cursor: QTextCursor | None = None
        self._stream_request = ""
        self._stream_text = ""
        self._pending = ""
        self._pending_indexes: list[int] = []
        self._timer = QTimer(self)
        self._timer.setInterval(FLUSH_INTERVAL_MS)
        self._timer.timeout.connect(self.flush)
        self.show_messages([])

    # ----- whole-transcript rendering -----------------------------------------------------
    def show_messages(self, messages: list[Message]) -> None:
        """Render finished messages (any live stream is dropped; call begin_stream after)."""
        self._timer.stop()
        self._stream_cursor = None
        self._messages = list(messages)
        self._code_blocks.clear()
        if not messages:
            self.setHtml(self._welcome_html())
            return
        theme = self._theme()
        last_assistant = max((m.id for m in messages if m.role == "assistant"), default=-1)
        parts = [self._message_html(m, theme, m.id == last_assistant) for m in messages]
        self.setHtml("".join(parts))
        self._scroll_to_bottom()

    def set_plain_text(self, plain: bool) -> None:
        """Toggle Markdown rendering off (exact characters) or on."""
        self.plain_text = plain
        if self._stream_cursor is None:
            self.show_messages(self._messages)

    def _message_html(self, message: Message, theme: Theme, last_reply: bool) -> str:
        who = "You" if message.role == "user" else "Assistant"
        if self.plain_text:
            body = render_plain(message.content)
        else:
            rendered = render_markdown(message.content, message.id, theme)
            body = rendered.html
            for i, code in enumerate(rendered.code_blocks):
                self._code_blocks[(message.id, i)] = code
        actions = ["copy"]
        if message.role == "user":
            actions.append("edit")
        elif last_reply:
            actions.append("regenerate")
        links = " &nbsp; ".join(
            f'<a href="{ACTION_SCHEME}:{a}/{message.id}">{a.capitalize()}</a>' for a in actions
        )
        status = STATUS_LABELS.get(message.status, "") if message.status != DONE else ""
        badge = f' &nbsp;<span style="color:{theme.muted}">· {status}</span>' if status else ""
        bg = self._bubble_colour(message.role)
        return (
            f'<table width="100%" border="0" cellspacing="0" cellpadding="10" '
            f'style="margin-bottom:10px; background-color:{bg}">'
            f"<tr><td><b>{who}</b>{badge}"
            f'<span style="color:{theme.muted}"> &nbsp; {links}</span></td></tr>'
            f"<tr><td>{body}</td></tr></table>"
        )

    def _welcome_html(self) -> str:
        muted = self._theme().muted
        return (
            '<div align="center" style="margin-top:80px">'
            '<p style="font-size:20pt; font-weight:600">Phasewise</p>'
            f'<p style="color:{muted}">Chat with a local model and see where the time goes:'
            "<br>queue, prefill and decode, token by token.</p>"
            f'<p style="color:{muted}">Type below and press Enter. Shift+Enter adds a line.</p>'
            "</div>"
        )

    # ----- streaming ---------------------------------------------------------------------
    def begin_stream(self, request_id: str) -> None:
        """Start showing a live reply under the current transcript."""
        if not self._messages:
            self.setHtml("")
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertHtml(f"<p><b>Assistant</b> <span style=\"color:{self._theme().muted}\">"
                          "· writing…</span></p>")
        cursor.insertBlock()
        self._stream_cursor = cursor
        self._stream_request = request_id
        self._stream_text = ""
        self._pending = ""
        self._pending_indexes = []
        self._timer.start()
        self._scroll_to_bottom()

    def push_token(self, request_id: str, index: int, text: str) -> None:
        """Buffer one token's text; the first one is painted immediately."""
        if request_id != self._stream_request or self._stream_cursor is None:
            return
        self._pending += text
        self._pending_indexes.append(index)
        if index == 0:
            self.flush()

    def push_text(self, request_id: str, text: str) -> None:
        """Text without a token (held back until the end of the reply)."""
        if request_id == self._stream_request and self._stream_cursor is not None:
            self._pending += text

    def flush(self) -> None:
        """Insert all buffered text in one go (the timer's tick)."""
        if self._stream_cursor is None or not (self._pending or self._pending_indexes):
            return
        at_bottom = self._is_at_bottom()
        if self._pending:
            self._stream_cursor.insertText(self._pending)
            self.insert_count += 1
        self._stream_text += self._pending
        painted = self._pending_indexes
        self._pending, self._pending_indexes = "", []
        if at_bottom:
            self._scroll_to_bottom()
        if painted:
            self.sig_tokens_painted.emit(self._stream_request, painted, time.perf_counter_ns())

    def end_stream(self) -> None:
        """Paint whatever is buffered and stop the flush timer."""
        self.flush()
        self._timer.stop()
        self._stream_cursor = None
        self._stream_request = ""

    @property
    def streamed_text(self) -> str:
        """What the live reply has shown so far (buffered text included)."""
        return self._stream_text + self._pending

    # ----- links ---------------------------------------------------------------------------
    def _on_anchor(self, url: QUrl) -> None:
        scheme = url.scheme().lower()
        if scheme == ACTION_SCHEME:
            action, _, message_id = url.path().partition("/")
            if message_id.isdigit():
                self.sig_action.emit(action, int(message_id))
        elif scheme == COPY_SCHEME:
            message_id, _, index = url.path().partition("/")
            if message_id.isdigit() and index.isdigit():
                code = self._code_blocks.get((int(message_id), int(index)), "")
                QGuiApplication.clipboard().setText(code)
        elif is_safe_link(url.toString()):
            QDesktopServices.openUrl(url)

    def loadResource(self, kind: int, url: QUrl) -> object:
        """Never load anything (images, style sheets): model output must stay inert."""
        return None

    # ----- helpers -----------------------------------------------------------------------
    def _theme(self) -> Theme:
        pal = self.palette()
        dark = pal.color(QPalette.ColorRole.Base).lightness() < 128
        if dark:
            return Theme(code_bg="#1f2430", code_header_bg="#2a3040", muted="#9aa3b2",
                         link=pal.color(QPalette.ColorRole.Link).name())
        return Theme(link=pal.color(QPalette.ColorRole.Link).name())

    def _bubble_colour(self, role: str) -> str:
        base = self.palette().color(QPalette.ColorRole.Base)
        if role != "user":
            return base.name()
        accent = self.palette().color(QPalette.ColorRole.Highlight)
        # a faint tint of the accent colour over the background, readable in light and dark
        mix = 0.10
        r = round(base.red() * (1 - mix) + accent.red() * mix)
        g = round(base.green() * (1 - mix) + accent.green() * mix)
        b = round(base.blue() * (1 - mix) + accent.blue() * mix)
        return f"#{r:02x}{g:02x}{b:02x}"

    def _is_at_bottom(self) -> bool:
        bar = self.verticalScrollBar()
        return bar.value() >= bar.maximum() - 4

    def _scroll_to_bottom(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def changeEvent(self, event) -> None:
        """Re-render when the system switches between light and dark."""
        super().changeEvent(event)
        if event.type() == event.Type.PaletteChange and self._stream_cursor is None:
            self.show_messages(self._messages)

