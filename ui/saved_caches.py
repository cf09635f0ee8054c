"""The model picker's line on chats' KV snapshots: how much disk they take, and Clear."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QWidget

from engine.core.snapshots import clear_shelf, shelf_usage
from engine.tools import fit
from ui.about import confirm


class SavedCaches(QWidget):
    """"Chats saved for a fast resume: 1.2 GB (14)" and Clear…, which asks first."""

    def __init__(self, root: Path, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.root = root
        self.label = QLabel()
        self.label.setObjectName("valueLabel")
        self.label.setToolTip("Each chat's prompt, as the model read it, is kept on disk so "
                              "its next turn after a restart starts at once. Safe to clear: "
                              "a chat then reads its prompt again.")
        self.clear = QPushButton("Clear…")
        self.clear.clicked.connect(self.clear_all)
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.label, 1)
        row.addWidget(self.clear)
        self.refresh()

    def refresh(self, note: str = "") -> None:
        count, size = shelf_usage(self.root)
        text = f"Chats saved for a fast resume: {fit.size(size)} ({count})" if count else \
            "Chats saved for a fast resume: none yet"
        self.label.setText(f"{text}{note}")
        self.clear.setEnabled(count > 0)

    def clear_all(self) -> None:
        count, size = shelf_usage(self.root)
        question = (f"Remove {count} saved chat caches ({fit.size(size)})? Your chats stay; "
                    "each one's next turn reads its prompt again.")
        if not confirm(self, "Clear saved chat caches", question):
            return
        freed = clear_shelf(self.root)
        self.refresh(f" · {fit.size(freed)} freed")
