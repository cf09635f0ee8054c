"""Incremental detokenization that never emits half a UTF-8 character, and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


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
    """Holds back text that could be the start of a stop string; reports a full match."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._pending = ""
        self.emitted = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Return the part of the text that is safe to show now."""
        if self.stopped:
            return ""
        if not self._stops:
            self.emitted += delta
            return delta
        self._pending += delta
        text = self.emitted + self._pending
        found = ((text.find(s, max(0, len(self.emitted) - len(s))), s) for s in self._stops)
        # the stop the text completes first (then the earlier start): what streaming it a
        # character at a time would stop at, however the text arrives in pieces
        hits = [(i + len(s), i) for i, s in found if i >= 0]
        if hits:
            cut = min(hits)[1]
            out = text[len(self.emitted) : cut]
            self.emitted = text[:cut]
            self._pending = ""
            self.stopped = True
            return out
        hold = self._longest_stop_prefix_suffix(text)
        safe_end = len(text) - hold
        out = text[len(self.emitted) : safe_end]
        self.emitted = text[:safe_end]
        self._pending = text[safe_end:]
        return out

    def flush(self) -> str:
        """At the end of the reply the held-back text is not a stop string after all."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        self.emitted += out
        return out

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    best = max(best, n)
                    break
        return best
