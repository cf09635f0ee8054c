"""Drafts: a chat's unsent composer text stays with it, across switches and restarts.

The window owns one Drafts; it says which chat the composer shows and when a message was
sent, and the drafts are kept in QSettings by chat id ("new": the chat not saved yet).
"""

from __future__ import annotations

from PySide6.QtCore import QSettings

from ui.composer import Composer

DRAFTS_GROUP = "drafts"  # QSettings: unsent composer text by chat id ("new": the unsaved chat)


class Drafts:
    """The composer's text as each chat's draft."""

    def __init__(self, settings: QSettings, composer: Composer) -> None:
        self.settings = settings
        self.composer = composer
        self.key: str | None = None  # whose draft the composer holds (None: nobody's)

    def _path(self, key: str) -> str:
        return f"{DRAFTS_GROUP}/{key}"

    def stash(self) -> None:
        """Keep the composer's text as the shown chat's draft (an edit in progress is not a
        draft: leaving the chat cancels it)."""
        if self.key is None:
            return
        text = "" if self.composer.editing else self.composer.text()
        if text.strip():
            self.settings.setValue(self._path(self.key), text)
        else:
            self.settings.remove(self._path(self.key))

    def take(self, conv_id: str | None) -> None:
        """Put chat `conv_id`'s draft (None: the new chat's) in the composer."""
        self.key = conv_id or "new"
        self.composer.set_text(str(self.settings.value(self._path(self.key), "") or ""))

    def created(self, conv_id: str) -> None:
        """The new chat was saved: its draft became its first message."""
        self.settings.remove(self._path("new"))
        self.key = conv_id

    def sent(self) -> None:
        """The shown chat's draft was sent."""
        if self.key is not None:
            self.settings.remove(self._path(self.key))

    def deleted(self, conv_id: str) -> None:
        """A chat was deleted; its draft goes with it."""
        self.settings.remove(self._path(conv_id))
        if conv_id == self.key:
            self.key = None
