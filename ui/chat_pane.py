"""The window's middle column and its status line, built apart from the window.

ChatPane: the chat's header (title, plain-text toggle, model button), the chat view, a
dismissable notice bar, and the composer. LoadStatus: the status bar's model, context and
loading readouts.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QStatusBar,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine import ModelInfo, ModelLoadProgress
from ui.chat_view import ChatView
from ui.composer import Composer
from ui.session import Until


class ChatPane(QWidget):
    """Header, chat view, notice bar and composer, top to bottom."""

    sig_choose_model = Signal()
    """The Model… button was pressed."""

    def __init__(self, chat: ChatView, composer: Composer, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("chatPane")
        self.title_label = QLabel("New chat")
        self.title_label.setObjectName("chatTitle")
        self.plain_toggle = QToolButton()
        self.plain_toggle.setText("Plain text")
        self.plain_toggle.setCheckable(True)
        self.plain_toggle.setToolTip("Show replies as exact text instead of Markdown")
        self.plain_toggle.toggled.connect(chat.set_plain_text)
        self.model_button = QPushButton("Model…")
        self.model_button.setObjectName("modelButton")
        self.model_button.clicked.connect(self.sig_choose_model)
        header = QFrame()
        header.setObjectName("chatHeader")
        row = QHBoxLayout(header)
        row.setContentsMargins(16, 8, 12, 8)
        row.addWidget(self.title_label, 1)
        row.addWidget(self.plain_toggle)
        row.addWidget(self.model_button)

        column = QVBoxLayout(self)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(0)
        column.addWidget(header)
        column.addWidget(chat, 1)
        column.addWidget(self._build_notice())
        column.addWidget(composer)

    def _build_notice(self) -> QFrame:
        self.notice = QFrame()
        self.notice.setObjectName("noticeBar")
        self.notice_label = QLabel()
        self.notice_label.setWordWrap(True)
        close = QToolButton()
        close.setText("✕")
        close.setAutoRaise(True)
        close.clicked.connect(self.hide_notice)
        row = QHBoxLayout(self.notice)
        row.setContentsMargins(12, 6, 6, 6)
        row.addWidget(self.notice_label, 1)
        row.addWidget(close)
        self.notice.hide()
        self._until: Until | None = None  # what makes the notice shown stale
        return self.notice

    def set_title(self, title: str) -> None:
        self.title_label.setText(title)

    def notify(self, message: str, until: Until | None = None) -> None:
        """Show a one-line message above the composer until dismissed, replaced, or (with
        `until`) that change happens."""
        self.notice_label.setText(message)
        self._until = until
        self.notice.show()

    def hide_notice(self) -> None:
        self.notice.hide()
        self._until = None

    def cause_ended(self, cause: Until) -> None:
        """What a notice was about is over: hide it if it waited for that."""
        if self._until == cause:
            self.hide_notice()


class LoadStatus:
    """The status bar's readouts: loading progress on the left; context fill and the model on
    the right."""

    def __init__(self, bar: QStatusBar) -> None:
        self.model_label = QLabel()
        self.context_label = QLabel()
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)  # busy indicator: the loader reports stages, not percent
        self.progress.setMaximumWidth(140)
        self.progress.setTextVisible(False)
        self.progress.hide()
        self.load_label = QLabel()
        bar.addWidget(self.progress)
        bar.addWidget(self.load_label)
        bar.addPermanentWidget(self.context_label)
        bar.addPermanentWidget(self.model_label)

    def loading(self, stage: str) -> None:
        self.progress.setRange(0, 0)  # busy: a stage, not a percentage
        self.progress.show()
        self.load_label.setText(stage)

    def load_progress(self, event: ModelLoadProgress) -> None:
        """A load step that counts (a GGUF converting): a bar and a percentage."""
        percent = int(100 * event.fraction)
        self.progress.setRange(0, 100)
        self.progress.setValue(percent)
        self.progress.show()
        self.load_label.setText(f"{event.stage[0].upper()}{event.stage[1:]}: {percent}%")

    def done(self, text: str = "") -> None:
        """Loading is over; text says how it ended (empty: nothing to say)."""
        self.progress.hide()
        self.load_label.setText(text)

    def show_model(self, info: ModelInfo | None) -> None:
        self.model_label.setText(
            f"{info.name}  ·  {info.engine} on {info.device}  ·  {info.dtype}" if info
            else "no model")

    def show_context(self, used: int, context_length: int) -> None:
        """Tokens the chat's last reply left in the context (nothing without a model)."""
        self.context_label.setText(
            f"context {used:,} / {context_length:,} ({100 * used / context_length:.0f}%)"
            if context_length else "")
