"""The conversation view: finished messages as rendered Markdown, live replies as plain text.

Streaming: the first token is inserted at once (TTFT is what the user perceives); later
tokens are buffered and flushed in one insert per live reply at most 20 times a second, by a
single-shot timer armed only while text waits. Each insert re-lays out and repaints the
reply (about 1 ms here) and each idle tick of a free-running timer still costs a wake-up on
the GUI thread, which shares the CPU with decoding: at 25 tok/s this halves the chat view's
GUI time per token against one insert per token. 20 Hz still reads as smooth streaming.
Several replies can stream at once (N alternatives), each into its own block. When a reply
ends the view is re-rendered as Markdown.
"""

from __future__ import annotations

import contextlib
import html
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

from PySide6.QtCore import Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (
    QCursor,
    QDesktopServices,
    QGuiApplication,
    QPalette,
    QResizeEvent,
    QShowEvent,
    QTextCursor,
    QTextDocument,
)
from PySide6.QtWidgets import QMenu, QTextBrowser, QWidget

from engine.documents import split_documents
from ui.markdown import COPY_SCHEME, Theme, is_safe_link, render_markdown, render_plain
from ui.session import PromptReading
from ui.store import DONE, Message

FLUSH_INTERVAL_MS = 50  # at most 20 inserts a second per live reply
# When the model decodes on this machine's CPU, every paint takes a core from decode: at 10 Hz
# the window costs about 3% of decode speed instead of 6% at 20 Hz (benchmarks/gui_overhead.py).
CPU_FLUSH_INTERVAL_MS = 100
ACTION_SCHEME = "pw-action"  # our own links: pw-action:<action>/<message id>
LINK_TEXT = {"alternatives": "Alternatives…"}  # it asks how many first
ALTERNATIVE_CHOICES = (2, 3, 4)  # the Alternatives… link's menu (and × N's count if not here)
STATUS_LABELS = {"stopped": "stopped", "length": "hit max tokens", "error": "failed"}
WRITING = "· writing…"  # a live reply's status until its prompt is being read


def prefill_status(reading: PromptReading) -> str:
    """A live reply's status while its prompt is prefilled:
    "· Reading your prompt: 42% · 3 s left · 550 tok/s" (the time left as the session said it)."""
    event = reading.progress
    text = f"· Reading your prompt: {event.fraction:.0%}"
    if reading.left:
        text += f" · {reading.left} · {event.tok_s:.0f} tok/s"
    return text


@dataclass(frozen=True)
class Alternative:
    """A finished alternative reply waiting to be kept or discarded."""

    index: int  # its number within the set; the Keep link carries it
    label: str
    text: str
    status: str = DONE


@dataclass
class _Stream:
    cursor: QTextCursor
    status: QTextCursor  # selects the status text after the reply's label
    text: str = ""  # painted so far
    pending: str = ""  # buffered until the next flush
    indexes: list[int] = field(default_factory=list)


class ChatView(QTextBrowser):
    """Read-only transcript of one conversation with per-message action links."""

    sig_action = Signal(str, int)
    """A message action was clicked: (action in copy|edit|regenerate|alternatives|stats,
    message id), or (keep, index of the alternative)."""
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
        self._alternatives: list[Alternative] = []
        self._streams: dict[str, _Stream] = {}
        self._last_stream = ""  # the most recently started reply
        self._last_stream_text = ""  # its text once it ended
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)  # armed by push_token, only while text waits
        self.flush_interval_ms = FLUSH_INTERVAL_MS  # push_token arms the timer to this
        self._timer.timeout.connect(self.flush)
        self._last_flush = 0.0
        # Whether the view stays at the end as the layout changes: a chat opened before the
        # window is shown (at start) or laid out again (a resize) still opens at its end,
        # unless the user scrolled up to read.
        self._follow = True
        bar = self.verticalScrollBar()
        bar.actionTriggered.connect(lambda _action: self._note_position())  # the user's
        bar.rangeChanged.connect(lambda _low, _high: self._keep_following())
        self.show_messages([])

    # ----- whole-transcript rendering -----------------------------------------------------
    def show_messages(self, messages: list[Message],
                      alternatives: list[Alternative] | None = None) -> None:
        """Render finished messages, then finished alternatives with a Keep link each (live
        streams are dropped; call begin_stream after)."""
        self._timer.stop()
        self._streams.clear()
        self._messages = list(messages)
        self._alternatives = list(alternatives or [])
        self._code_blocks.clear()
        if not messages and not self._alternatives:
            self.setHtml(self._welcome_html())
            return
        theme = self._theme()
        last_assistant = max((m.id for m in messages if m.role == "assistant"), default=-1)
        parts = [self._message_html(m, theme, m.id == last_assistant) for m in messages]
        parts += [self._alternative_html(a, theme) for a in self._alternatives]
        self.setHtml("".join(parts))
        self._follow = True
        self._scroll_to_bottom()

    def set_plain_text(self, plain: bool) -> None:
        """Toggle Markdown rendering off (exact characters) or on."""
        self.plain_text = plain
        if not self._streams:
            self.show_messages(self._messages, self._alternatives)

    def _message_html(self, message: Message, theme: Theme, last_reply: bool) -> str:
        who = "You" if message.role == "user" else "Assistant"
        documents, content = split_documents(message.content) if message.role == "user" \
            else ([], message.content)
        if self.plain_text:
            body = render_plain(content)
        else:
            rendered = render_markdown(content, message.id, theme)
            body = rendered.html
            for i, code in enumerate(rendered.code_blocks):
                self._code_blocks[(message.id, i)] = code
        body = _documents_html(documents, theme) + body
        actions = ["copy"]
        if message.role == "user":
            actions.append("edit")
        elif last_reply:
            actions += ["regenerate", "alternatives"]
        links = " &nbsp; ".join(
            f'<a href="{ACTION_SCHEME}:{a}/{message.id}">{LINK_TEXT.get(a, a.capitalize())}</a>'
            for a in actions
        )
        return self._bubble_html(who, message.role, message.status, links, body, theme,
                                 self._stats_html(message, theme))

    @staticmethod
    def _stats_html(message: Message, theme: Theme) -> str:
        """The quiet line under a reply; a click asks for its full breakdown (action stats)."""
        line = message.stats.summary() if message.stats and message.role == "assistant" else ""
        if not line:
            return ""
        return (f'<tr><td><small><a href="{ACTION_SCHEME}:stats/{message.id}" '
                f'style="color:{theme.muted}; text-decoration:none">{html.escape(line)}</a>'
                "</small></td></tr>")

    def _alternative_html(self, alt: Alternative, theme: Theme) -> str:
        body = render_plain(alt.text) if self.plain_text else \
            render_markdown(alt.text, -1 - alt.index, theme).html
        link = f'<a href="{ACTION_SCHEME}:keep/{alt.index}">Keep this one</a>'
        return self._bubble_html(html.escape(alt.label), "assistant", alt.status, link, body,
                                 theme)

    def _bubble_html(self, who: str, role: str, status: str, links: str, body: str,
                     theme: Theme, footer: str = "") -> str:
        label = STATUS_LABELS.get(status, "") if status != DONE else ""
        badge = f' &nbsp;<span style="color:{theme.muted}">· {label}</span>' if label else ""
        bg = self._bubble_colour(role)
        return (
            f'<table width="100%" border="0" cellspacing="0" cellpadding="10" '
            f'style="margin-bottom:10px; background-color:{bg}">'
            f"<tr><td><b>{who}</b>{badge}"
            f'<span style="color:{theme.muted}"> &nbsp; {links}</span></td></tr>'
            f"<tr><td>{body}</td></tr>{footer}</table>"
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

    def add_alternative(self, alt: Alternative) -> None:
        """Show a finished alternative at the end of the view, after any live reply: a set's
        alternatives are shown in their own order while some still stream."""
        if not self._messages and not self._alternatives and not self._streams:
            self.setHtml("")
        self._alternatives.append(alt)
        with self._streams_kept():
            cursor = QTextCursor(self.document())
            cursor.movePosition(QTextCursor.MoveOperation.End)
            cursor.insertHtml(self._alternative_html(alt, self._theme()))

    @contextlib.contextmanager
    def _streams_kept(self) -> Iterator[None]:
        """Live replies' cursors sit at the document's end: keep them there while something
        is added after them, else they would move along and write into it."""
        for stream in self._streams.values():
            stream.cursor.setKeepPositionOnInsert(True)
        try:
            yield
        finally:
            for stream in self._streams.values():
                stream.cursor.setKeepPositionOnInsert(False)
                stream.cursor.clearSelection()  # its anchor moved along: select nothing

    # ----- streaming ---------------------------------------------------------------------
    def begin_stream(self, request_id: str, label: str = "Assistant") -> None:
        """Start showing a live reply at the end of the view (after any other live one)."""
        if not self._messages and not self._alternatives and not self._streams:
            self.setHtml("")
        with self._streams_kept():
            cursor = QTextCursor(self.document())
            cursor.movePosition(QTextCursor.MoveOperation.End)
            if self._streams:
                cursor.insertBlock()
            cursor.insertHtml(f"<p><b>{html.escape(label)}</b> <span style=\"color:"
                              f"{self._theme().muted}\">{WRITING}</span></p>")
            cursor.insertBlock()
            status = self.document().find(WRITING, cursor, QTextDocument.FindFlag.FindBackward)
            status.setPosition(status.selectionEnd())
            _select_back(status, len(WRITING))
        self._streams[request_id] = _Stream(cursor, status)
        self._last_stream, self._last_stream_text = request_id, ""
        self._scroll_to_bottom()

    def push_token(self, request_id: str, index: int, text: str) -> None:
        """Buffer one token's text; the first one is painted immediately."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        stream.pending += text
        stream.indexes.append(index)
        if index == 0:
            self._set_status(stream, WRITING)
            self._flush_stream(request_id, stream)
        elif not self._timer.isActive():
            # Due already (the bridge hands tokens over in batches at a similar rate): paint
            # once this wake-up's events are handled, not in a wake-up of its own.
            due_ms = (self._last_flush + self.flush_interval_ms / 1000 - time.monotonic()) * 1000
            self._timer.start(max(0, math.ceil(due_ms)))

    def show_reading(self, request_id: str, reading: PromptReading) -> None:
        """While a live reply's prompt is read: "Reading your prompt: 42% · 3 s left"."""
        stream = self._streams.get(request_id)
        if stream is not None and not stream.text and not stream.indexes:
            self._set_status(stream, prefill_status(reading))

    @staticmethod
    def _set_status(stream: _Stream, text: str) -> None:
        """Replace the status after the reply's label, keeping its (muted) format."""
        if stream.status.selectedText() == text:
            return
        fmt = stream.status.charFormat()  # the status's last character's: muted
        stream.status.insertText(text, fmt)
        _select_back(stream.status, len(text))

    def status_text(self, request_id: str) -> str:
        """A live reply's status as shown after its label ("" if it is not live)."""
        stream = self._streams.get(request_id)
        return stream.status.selectedText() if stream else ""

    def push_text(self, request_id: str, text: str) -> None:
        """Text without a token (held back until the end of the reply)."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.pending += text

    def set_flush_interval(self, ms: int) -> None:
        """How often streaming text is painted (at most; the first token is painted at once)."""
        self.flush_interval_ms = ms

    def flush(self) -> None:
        """Insert every live reply's buffered text, one insert each (the timer's tick)."""
        self._last_flush = time.monotonic()
        for request_id, stream in list(self._streams.items()):
            self._flush_stream(request_id, stream)

    def _flush_stream(self, request_id: str, stream: _Stream) -> None:
        if not (stream.pending or stream.indexes):
            return
        at_bottom = self._is_at_bottom()
        if stream.pending:
            stream.cursor.insertText(stream.pending)
            self.insert_count += 1
        stream.text += stream.pending
        painted = stream.indexes
        stream.pending, stream.indexes = "", []
        if at_bottom:
            self._scroll_to_bottom()
        if painted:
            self.sig_tokens_painted.emit(request_id, painted, time.perf_counter_ns())

    def end_stream(self, request_id: str | None = None) -> None:
        """Paint what a live reply (None: every one) has buffered and stop following it."""
        ids = list(self._streams) if request_id is None else [request_id]
        for rid in ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                self._flush_stream(rid, stream)
                if rid == self._last_stream:
                    self._last_stream_text = stream.text
        if not self._streams:
            self._timer.stop()

    @property
    def streaming(self) -> bool:
        return bool(self._streams)

    def stream_text(self, request_id: str) -> str:
        """What a live reply has shown so far (buffered text included)."""
        stream = self._streams.get(request_id)
        return stream.text + stream.pending if stream else ""

    @property
    def streamed_text(self) -> str:
        """What the most recently started reply has shown (so far, or in all once ended)."""
        if self._last_stream in self._streams:
            return self.stream_text(self._last_stream)
        return self._last_stream_text

    # ----- links ---------------------------------------------------------------------------
    def alternatives_menu(self, offered: int, pick: Callable[[int], object]) -> QMenu:
        """The Alternatives… link's menu of how many, at the pointer: 2 to 4, and `offered`
        (the × N box's count) if more, `offered` first in bold; a pick calls pick(count)."""
        menu = QMenu(self)
        menu.setObjectName("alternativesMenu")
        menu.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        for count in sorted({*ALTERNATIVE_CHOICES, offered}):
            action = menu.addAction(f"{count} alternatives", partial(pick, count))
            if count == offered:
                menu.setDefaultAction(action)
                menu.setActiveAction(action)
        menu.popup(QCursor.pos())
        return menu

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

    def loadResource(self, kind: int, url: QUrl | str) -> object:
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

    def _note_position(self) -> None:
        """The user scrolled (wheel, keys, drag): follow the end only if they went there."""
        bar = self.verticalScrollBar()
        self._follow = bar.sliderPosition() >= bar.maximum() - 4

    def _keep_following(self) -> None:
        if self._follow:
            self._scroll_to_bottom()

    def resizeEvent(self, event: QResizeEvent) -> None:
        """A new width re-wraps the text (Qt keeps the old offset, not the end): stay at the
        end if the view was following it."""
        super().resizeEvent(event)
        self._keep_following()

    def showEvent(self, event: QShowEvent) -> None:
        """QTextEdit's first show makes its cursor (the document's start) visible, scrolling
        to the top when the transcript is laid out by then (a window restored at a size where
        the chat column sits at its minimum): stay at the end if the view was following it."""
        super().showEvent(event)
        self._keep_following()

    def changeEvent(self, event) -> None:
        """Re-render when the system switches between light and dark."""
        super().changeEvent(event)
        if event.type() == event.Type.PaletteChange and not self._streams:
            self.show_messages(self._messages, self._alternatives)


def _documents_html(documents: list[tuple[str, str]], theme: Theme) -> str:
    """A message's attached documents as a quiet line of names and sizes (the text the model
    read is in the message; showing it whole would bury the question)."""
    if not documents:
        return ""
    names = " &nbsp;·&nbsp; ".join(
        f"<b>{html.escape(name)}</b> ({len(text):,} characters)" for name, text in documents)
    return f'<p style="color:{theme.muted}">Attached: {names}</p>'


def _select_back(cursor: QTextCursor, count: int) -> None:
    """Select the `count` characters before the cursor, leaving it at their end (so its
    charFormat is theirs)."""
    end = cursor.position()
    cursor.setPosition(end - count)
    cursor.setPosition(end, QTextCursor.MoveMode.KeepAnchor)
