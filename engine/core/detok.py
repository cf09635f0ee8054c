"""Incremental detokenization that never emits half a UTF-8 character, and stop strings."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class Detokenizer(Protocol):
    """A reply's text, a token at a time."""

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        ...

    def flush(self) -> str:
        """Text still held back at the end of the reply."""
        ...


class ByteDetokenizer:
    """Streams text for a vocabulary whose tokens are byte strings (llama.cpp's pieces): each
    token's bytes go through one incremental UTF-8 decoder, which holds an incomplete character
    back until its last byte arrives. One dictionary lookup and one decode per token, where
    decoding a window of tokens twice (IncrementalDetokenizer) cost ~20 us a token in the
    decode loop."""

    def __init__(self, piece: Callable[[int], bytes]) -> None:
        """piece: a token's bytes as shown in a reply (control tokens empty)."""
        self._piece = piece
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._piece(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class IncrementalDetokenizer:
    """Streams text deltas for a growing list of token ids.

    Decodes a small window of recent tokens twice (with and without the newest ones) and
    emits the difference, so byte-level BPE pieces of one character are held back until the
    character is complete (the same scheme as TGI and vLLM).
    """

    def __init__(self, tokenizer: Decoder) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Text still held back at the end of the reply (an incomplete character, if any)."""
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.ids)
        return full[len(prefix) :] if full.startswith(prefix) else ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True) if ids else ""


class StopMatcher:
    """Holds back text that could be the start of a stop string; reports a full match.

    Only the held-back text and the new piece are looked at: a stop cannot start in the text
    already shown, as any stop's beginning at the end of the text is held back. A piece costs
    the same at the end of a long reply as at its start."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._shown: list[str] = []
        self._pending = ""
        self.stopped = False

    @property
    def emitted(self) -> str:
        """All the text shown so far."""
        if len(self._shown) > 1:
            self._shown = ["".join(self._shown)]
        return self._shown[0] if self._shown else ""

    def feed(self, delta: str) -> str:
        """Return the part of the text that is safe to show now."""
        if self.stopped:
            return ""
        if not self._stops:
            return self._show(delta)
        text = self._pending + delta
        found = ((text.find(s), s) for s in self._stops)
        # the stop the text completes first (then the earlier start): what streaming it a
        # character at a time would stop at, however the text arrives in pieces
        hits = [(i + len(s), i) for i, s in found if i >= 0]
        if hits:
            self._pending = ""
            self.stopped = True
            return self._show(text[: min(hits)[1]])
        safe_end = len(text) - self._longest_stop_prefix_suffix(text)
        self._pending = text[safe_end:]
        return self._show(text[:safe_end])

    def flush(self) -> str:
        """At the end of the reply the held-back text is not a stop string after all."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return self._show(out)

    def _show(self, text: str) -> str:
        if text:
            self._shown.append(text)
        return text

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    best = max(best, n)
                    break
        return best
