"""Documents attached to a message: read once, placed so they are a cached prefix.

A document's text goes into the user's message in a delimited block, before what the user
typed. The message is encoded as text (special tokens are never parsed from message text), so
nothing inside a document can become a control token. Documents come first so that asking
about the same document again, in the same chat or in a new chat with the same system prompt,
shares the prompt up to the document's end: the prefix cache (and its snapshots on disk) then
holds the document, read once.

Text, Markdown and source code are read as UTF-8; PDF text is extracted with pypdf. A scanned
PDF with no text layer, a binary file, an unreadable or oversized one: one-line
DocumentError.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from engine.errors import PhasewiseError, one_line

MAX_FILE_BYTES = 64 << 20  # larger files are not read (no model here has the context for one)
OPEN_TAG = '<document name="{name}">'
CLOSE_TAG = "</document>"
_BLOCK = re.compile(r'<document name="([^"]*)">\n(.*?)\n</document>\n\n', re.DOTALL)
PDF_SUFFIXES = {".pdf"}


class DocumentError(PhasewiseError):
    """A file that cannot be attached; str() is one line."""


@dataclass(frozen=True)
class Document:
    name: str
    size_bytes: int
    text: str

    def block(self) -> str:
        """The document as it goes into a message (ends with a blank line)."""
        text = self.text.replace(CLOSE_TAG, "<\\/document>")  # one way to end a block
        return f"{OPEN_TAG.format(name=_safe_name(self.name))}\n{text}\n{CLOSE_TAG}\n\n"


def read_document(path: Path) -> Document:
    """A file's text, or DocumentError saying in one line why it cannot be attached."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise DocumentError(f"{path.name} is {size / 1e6:.0f} MB: documents up to "
                                f"{MAX_FILE_BYTES >> 20} MB can be attached")
        data = path.read_bytes()
    except OSError as exc:
        raise DocumentError(f"cannot read {path.name}: {exc.strerror or exc}") from exc
    text = _pdf_text(path.name, data) if path.suffix.lower() in PDF_SUFFIXES \
        else _plain_text(path.name, data)
    if not text.strip():
        raise DocumentError(f"{path.name} has no text to attach")
    return Document(path.name, size, text)


def with_documents(text: str, documents: list[Document]) -> str:
    """A message's content: the documents' blocks first (a shared prefix), then the text."""
    return "".join(d.block() for d in documents) + text


def split_documents(content: str) -> tuple[list[tuple[str, str]], str]:
    """A message's content back into its documents' (name, text) and what the user typed."""
    found, rest = [], content
    while (match := _BLOCK.match(rest)) is not None:
        found.append((match.group(1), match.group(2)))
        rest = rest[match.end():]
    return found, rest


def _plain_text(name: str, data: bytes) -> str:
    if b"\0" in data[:8192]:
        raise DocumentError(f"{name} is a binary file, not text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DocumentError(f"{name} is not UTF-8 text (byte {exc.start})") from exc


def _pdf_text(name: str, data: bytes) -> str:
    import io

    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            raise DocumentError(f"{name} is an encrypted PDF")
        pages = [page.extract_text() or "" for page in reader.pages]
    except (PyPdfError, ValueError, KeyError, OSError) as exc:
        raise DocumentError(f"{name} is not a readable PDF: {one_line(exc)}") from exc
    text = "\n\n".join(p.strip() for p in pages if p.strip())
    if not text:
        raise DocumentError(f"{name} has no text layer (a scanned PDF?): nothing to read")
    return text


def _safe_name(name: str) -> str:
    """A file name that cannot end the block's tag early."""
    return name.replace('"', "'").replace("\n", " ")
