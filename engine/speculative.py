"""Prompt-lookup drafts for speculative decoding (no draft model needed).

Chat replies often copy spans of the prompt (names, code, quoted text) or of themselves.
The last few tokens are looked up in everything seen so far; the tokens that followed their
latest earlier occurrence are the draft. The model then checks the whole draft in one
forward pass (decode is bandwidth-bound, so a pass over several tokens costs little more
than a pass over one) and keeps the longest prefix it agrees with.

Greedy output is identical to plain decoding when a row's logits do not depend on the other
rows in the pass (fp32-eager, fp16-dynamic). int8-dynamic quantizes activations with one
scale per pass, so there a verified token can differ from the one-token step's choice.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

DRAFT_TOKENS = 6
MAX_NGRAM = 3
MIN_NGRAM = 2  # a single repeated token is too weak a cue: drafts from it are mostly rejected


class PromptLookup:
    """An incremental n-gram index over prompt + generated tokens."""

    def __init__(self, ids: Iterable[int] = (), *, max_ngram: int = MAX_NGRAM,
                 min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.history: list[int] = []
        # n-gram -> position of the token that followed its latest occurrence
        self._follower: dict[tuple[int, ...], int] = {}
        self.extend(ids)

    def extend(self, ids: Iterable[int]) -> None:
        for token in ids:
            self.append(token)

    def append(self, token: int) -> None:
        h = self.history
        for n in range(self.min_ngram, self.max_ngram + 1):
            if len(h) >= n:
                self._follower[tuple(h[-n:])] = len(h)
        h.append(token)

    def propose(self, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that followed the longest earlier match of the tail."""
        if max_tokens <= 0:
            return []
        h = self.history
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(h) < n:
                continue
            start = self._follower.get(tuple(h[-n:]))
            if start is not None:
                return h[start : start + max_tokens]
        return []


@dataclass
class SpecStats:
    """Draft tokens proposed and accepted over one reply."""

    proposed: int = 0
    accepted: int = 0
