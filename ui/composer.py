"""The message composer: Enter sends, Shift+Enter adds a line, Esc stops (or ends an edit)."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QMimeData, Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine.params import MAX_ALTERNATIVES
from ui.attachments import AttachmentChips

ALTERNATIVES_TIP = ("Replies per message: more than one generates that many alternatives at "
                    "once (one shared prefill); keep one")
GREEDY_TIP = ("One reply at temperature 0: greedy replies are all the same. Raise the "
              "temperature for alternatives.")


class _Editor(QPlainTextEdit):
    """Plain-text editor that turns Enter / Esc into signals."""

    sig_enter = Signal()
    """Enter without Shift was pressed."""
    sig_escape = Signal()
    """Esc was pressed."""
    sig_files_dropped = Signal(list)
    """Local files were dropped on the box (list[Path]): they are attached, not pasted."""

    def canInsertFromMimeData(self, source: QMimeData) -> bool:
        return bool(_local_files(source)) or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source: QMimeData) -> None:
        files = _local_files(source)
        if files:
            self.sig_files_dropped.emit(files)
        else:
            super().insertFromMimeData(source)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        key = event.key()
        if key in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
            else:
                self.sig_enter.emit()
            return
        if key == Qt.Key.Key_Escape:
            self.sig_escape.emit()
            return
        super().keyPressEvent(event)


def _local_files(source: QMimeData) -> list[Path]:
    if not source.hasUrls():
        return []
    return [Path(url.toLocalFile()) for url in source.urls() if url.isLocalFile()]


class Composer(QWidget):
    """Text box plus a Send/Stop button; also shows the 'editing a message' banner."""

    sig_send = Signal(str)
    """The user asked to send this text (not yet validated)."""
    sig_stop = Signal()
    """The user asked to stop the running reply (Esc or the Stop button)."""
    sig_cancel_edit = Signal()
    """The user left edit mode without resending."""
    sig_attach = Signal(list)
    """Attach these files (list[Path]): dropped on the box, or chosen after the paperclip."""
    sig_attach_clicked = Signal()
    """The paperclip was clicked: the window asks which files."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("composer")
        self.editor = _Editor()
        self.editor.setObjectName("composerEditor")
        self.editor.setPlaceholderText("Message the model…  (Enter sends, Shift+Enter new line)")
        self.editor.setTabChangesFocus(True)
        self.editor.setFixedHeight(84)
        self.button = QPushButton("Send")
        self.button.setObjectName("sendButton")
        self.button.setMinimumWidth(84)
        self.button.clicked.connect(self._on_button)
        self.alternatives = QSpinBox()
        self.alternatives.setObjectName("alternativesSpin")
        self.alternatives.setRange(1, MAX_ALTERNATIVES)
        self.alternatives.setPrefix("× ")
        self.alternatives.setToolTip(ALTERNATIVES_TIP)
        self._wanted_alternatives = 1  # the count to give back when × N is allowed again
        self.edit_banner = QLabel()
        self.edit_banner.setObjectName("editBanner")
        self.edit_banner.hide()
        self.chips = AttachmentChips()
        self.attach = QToolButton()
        self.attach.setObjectName("attachButton")
        self.attach.setText("Attach…")
        self.attach.setToolTip("Attach text, Markdown, source code or PDF files (or drop "
                               "them on the message box)")
        self.attach.clicked.connect(self.sig_attach_clicked)
        self.editor.sig_files_dropped.connect(self.sig_attach)
        self.forecast = QLabel()
        self.forecast.setObjectName("forecastLabel")
        self.forecast.setAlignment(Qt.AlignmentFlag.AlignRight)
        self.forecast.setToolTip("The wait before the first token, forecast from what is "
                                 "cached and this session's measured prefill speed.")
        self.editor.sig_enter.connect(self._send)
        self.editor.sig_escape.connect(self.escape)
        self._busy = False
        self._editing = False

        row = QHBoxLayout()
        row.addWidget(self.editor, 1)
        side = QVBoxLayout()
        side.addStretch(1)
        side.addWidget(self.attach)
        side.addWidget(self.alternatives)
        side.addWidget(self.button)
        row.addLayout(side)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 6, 12, 12)
        layout.addWidget(self.edit_banner)
        layout.addWidget(self.chips)
        layout.addLayout(row)
        layout.addWidget(self.forecast)

    def text(self) -> str:
        return self.editor.toPlainText()

    def set_forecast(self, line: str) -> None:
        """The wait forecast for the text in the box ("" hides it)."""
        self.forecast.setText(line)
        self.forecast.setVisible(bool(line))

    def set_text(self, text: str) -> None:
        self.editor.setPlainText(text)
        self.editor.moveCursor(self.editor.textCursor().MoveOperation.End)

    def clear(self) -> None:
        self.editor.clear()

    def focus(self) -> None:
        """Put the keyboard focus in the editor."""
        self.editor.setFocus()

    def alternative_count(self) -> int:
        """How many replies a send asks for (1 = a plain reply)."""
        return self.alternatives.value()

    def allow_alternatives(self, allowed: bool) -> None:
        """At temperature 0 every reply would be the same: × N shows × 1, disabled, and says
        why; the count comes back when sampling does."""
        if allowed == self.alternatives.isEnabled():
            return
        if allowed:
            self.alternatives.setEnabled(True)
            self.alternatives.setValue(self._wanted_alternatives)
        else:
            self._wanted_alternatives = self.alternatives.value()
            self.alternatives.setValue(1)
            self.alternatives.setEnabled(False)
        self.alternatives.setToolTip(ALTERNATIVES_TIP if allowed else GREEDY_TIP)

    def set_busy(self, busy: bool) -> None:
        """While a reply runs the button becomes Stop; typing stays possible."""
        self._busy = busy
        self.button.setText("Stop" if busy else "Send")
        self.button.setProperty("danger", busy)
        self.button.style().unpolish(self.button)
        self.button.style().polish(self.button)

    def set_editing(self, editing: bool) -> None:
        """Show or hide the banner for edit & resend."""
        self._editing = editing
        self.edit_banner.setText("Editing a message: Enter resends from here, Esc cancels.")
        self.edit_banner.setVisible(editing)

    @property
    def editing(self) -> bool:
        return self._editing

    def _on_button(self) -> None:
        if self._busy:
            self.sig_stop.emit()
        else:
            self._send()

    def _send(self) -> None:
        self.sig_send.emit(self.text())

    def escape(self) -> None:
        """Esc: stop the running reply, else leave edit mode."""
        if self._busy:
            self.sig_stop.emit()
        elif self._editing:
            self.set_editing(False)
            self.editor.clear()
            self.sig_cancel_edit.emit()
