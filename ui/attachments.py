"""Documents attached to the message being written: chips above the message box, each with
its name, size and token count; × removes one before sending."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QHBoxLayout, QToolButton, QWidget

from engine.documents import Document
from engine.tools import fit


class AttachmentChips(QWidget):
    sig_changed = Signal()
    """The list of attached documents changed (the forecast reads it again)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.documents: list[Document] = []
        self.buttons: list[QToolButton] = []  # one chip per document, in order
        self._tokens: list[int | None] = []
        self._row = QHBoxLayout(self)
        self._row.setContentsMargins(0, 0, 0, 4)
        self._row.addStretch(1)
        self.hide()

    def add(self, document: Document, tokens: int | None) -> None:
        self.documents.append(document)
        self._tokens.append(tokens)
        self._rebuild()

    def remove(self, index: int) -> None:
        del self.documents[index], self._tokens[index]
        self._rebuild()

    def clear(self) -> None:
        self.documents, self._tokens = [], []
        self._rebuild()

    def labels(self) -> list[str]:
        return [chip_label(d, t) for d, t in zip(self.documents, self._tokens, strict=True)]

    def has(self, path: Path) -> bool:
        return any(d.name == path.name for d in self.documents)

    def _rebuild(self) -> None:
        for button in self.buttons:
            self._row.removeWidget(button)
            button.deleteLater()
        self.buttons = []
        for i, label in enumerate(self.labels()):
            chip = QToolButton()
            chip.setObjectName("attachmentChip")
            chip.setText(f"{label}  ✕")
            chip.setToolTip(f"Remove {self.documents[i].name} from this message")
            chip.clicked.connect(lambda _checked=False, i=i: self.remove(i))
            self._row.insertWidget(i, chip)
            self.buttons.append(chip)
        self.setVisible(bool(self.documents))
        self.sig_changed.emit()


def chip_label(document: Document, tokens: int | None) -> str:
    """"report.pdf · 48 KB · 9,120 tokens" (no count where the model is not known)."""
    n = document.size_bytes
    parts = [document.name, fit.size(n) if n >= 1_000_000 else f"{max(1, round(n / 1000))} KB"]
    if tokens is not None:
        parts.append(f"{tokens:,} tokens")
    return " · ".join(parts)
