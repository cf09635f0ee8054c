"""Attaching documents to the message being written: read each file once, refuse in one line
what cannot be read or would not fit the model's context, and chip the rest."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.documents import Document, DocumentError, read_document
from engine.protocol import Backend, PrefixPeek
from ui.attachments import AttachmentChips

FILE_FILTER = ("Documents (*.txt *.md *.markdown *.rst *.pdf *.py *.js *.ts *.c *.h *.cpp "
               "*.rs *.go *.java *.json *.yaml *.yml *.toml *.csv *.html *.css *.sh);;"
               "All files (*)")


class DocumentAttacher:
    def __init__(self, backend: Backend, chips: AttachmentChips,
                 prompt_with: Callable[[list[Document]], PrefixPeek | None],
                 notify: Callable[[str], None]) -> None:
        """prompt_with(documents): what the message would ask with these documents attached
        (None: not known); notify(line): tells the user why a file was not attached."""
        self.backend = backend
        self.chips = chips
        self._prompt_with, self._notify = prompt_with, notify

    def attach(self, paths: list[Path]) -> None:
        for path in paths:
            if self.chips.has(path):
                continue
            try:
                document = read_document(path)
            except DocumentError as exc:
                self._notify(f"Not attached: {exc}")
                continue
            refusal = self._refusal(document)
            if refusal:
                self._notify(refusal)
                continue
            self.chips.add(document, self.backend.count_tokens(document.block()))

    def _refusal(self, document: Document) -> str:
        """Why this document cannot go with the message ("" if it can)."""
        info = self.backend.model_info
        peek = self._prompt_with([*self.chips.documents, document])
        if info is None or peek is None or peek.prompt_tokens < info.context_length:
            return ""
        return (f"Not attached: {document.name} does not fit. With it this message would be "
                f"{peek.prompt_tokens:,} tokens; the model reads at most "
                f"{info.context_length:,}.")
