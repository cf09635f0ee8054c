"""The window's small dialogs: About (version and model), Keyboard shortcuts, and confirm."""

from __future__ import annotations

import html

from PySide6.QtCore import QCoreApplication
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QHeaderView,
    QMessageBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine import ModelInfo


def about_text(model: ModelInfo | None) -> str:
    """Version (set by the app from pyproject) and the loaded model, as rich text."""
    version = QCoreApplication.applicationVersion() or "development build"
    running = (
        f"<p>Model: {html.escape(model.name)} on {model.device} ({model.dtype})</p>"
        if model else ""
    )
    return (
        f"<h3>Phasewise {version}</h3>"
        "<p>Chat with local language models and see where the time goes: queue, "
        "prefill and decode, live.</p>" + running
    )


def show_about(parent: QWidget, model: ModelInfo | None) -> None:
    QMessageBox.about(parent, "About Phasewise", about_text(model))


def confirm(parent: QWidget, title: str, question: str, *, default_yes: bool = False) -> bool:
    """Ask before a destructive action; No is the default (Enter or Esc keep things) unless
    `default_yes`."""
    yes, no = QMessageBox.StandardButton.Yes, QMessageBox.StandardButton.No
    return QMessageBox.question(parent, title, question, yes | no,
                                yes if default_yes else no) == yes


class ShortcutsDialog(QDialog):
    """Help → Keyboard shortcuts: every shortcut the window has, as (keys, what it does)."""

    def __init__(self, rows: list[tuple[str, str]], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Keyboard shortcuts")
        self.table = QTableWidget(len(rows), 2)
        self.table.setHorizontalHeaderLabels(["Keys", "Action"])
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(
            QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        for row, (keys, action) in enumerate(rows):
            self.table.setItem(row, 0, QTableWidgetItem(keys))
            self.table.setItem(row, 1, QTableWidgetItem(action))
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(self.table)
        layout.addWidget(buttons)
        self.resize(460, 420)

    def rows(self) -> list[tuple[str, str]]:
        """What the table shows, row by row."""
        cells = [[self.table.item(r, c) for c in (0, 1)] for r in range(self.table.rowCount())]
        return [(k.text() if k else "", a.text() if a else "") for k, a in cells]
