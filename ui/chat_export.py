"""Export any saved chat's per-reply stats (CSV or JSON), not only the live session's.

The window's Chat menu and the sidebar's context menu ask for it. The file dialog opens in the
folder of the last export (the HUD's and these share it), else home; the outcome is reported
by the same code as the HUD's exports: what was written, or one line saying why not.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from PySide6.QtWidgets import QFileDialog, QWidget

from ui.hud.history import saved_chat
from ui.hud.widget import ExportOutcome, HudWidget, run_write
from ui.store import ChatStore

FORMATS = {"csv": "CSV (*.csv)", "json": "JSON (*.json)"}
STATUS_MS = 8000  # how long a successful export's note stays in the status bar


def file_stem(title: str) -> str:
    """A chat title as a file name: "Trip ideas: Rome?" -> "trip-ideas-rome"."""
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:60] or "chat"


class ChatExports:
    """Writes a chat's saved replies to a file the user picks."""

    def __init__(self, store: ChatStore, hud: HudWidget, parent: QWidget,
                 done: Callable[[str], None], failed: Callable[[str], None]) -> None:
        self.store, self.hud, self.parent = store, hud, parent
        self._done, self._failed = done, failed

    def ask(self, conv_id: str | None, fmt: str) -> ExportOutcome | None:
        """Ask where to save chat `conv_id`'s stats as `fmt` ("csv" or "json"), then write
        them. None when there was nothing to export or the dialog was cancelled."""
        conv = self.store.conversation(conv_id) if conv_id else None
        if conv is None:
            self._failed("Nothing to export yet: this chat has no saved replies.")
            return None
        start = self.hud.export_dir / f"phasewise-{file_stem(conv.title)}.{fmt}"
        path, _ = QFileDialog.getSaveFileName(self.parent, f"Export “{conv.title}” as "
                                              f"{fmt.upper()}", str(start), FORMATS[fmt])
        return self.write(conv.id, path, fmt) if path else None

    def write(self, conv_id: str, path: str | Path, fmt: str) -> ExportOutcome:
        """Write chat `conv_id`'s saved replies to `path` and report the outcome."""
        conv = self.store.conversation(conv_id)
        title = conv.title if conv is not None else ""
        chat = saved_chat(conv_id, title, self.store.messages(conv_id))
        outcome = run_write(lambda: chat.export_csv(path) if fmt == "csv"
                            else chat.export_json(path))
        if outcome.written:
            self.hud.export_dir = outcome.written[0].parent
            self._done(outcome.message)
        else:
            self._failed(outcome.message)
        return outcome
