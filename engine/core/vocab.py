"""Whether a draft model's vocabulary is its target's: one comparison for every runtime.

A draft proposes token ids the target verifies; if an id meant another piece to the target,
every proposal would be wrong (and accepted at random where pieces happen to agree). Each
runtime states what it knows of a vocabulary as `VocabularyFacts`; the comparison is here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import ModelLoadError

VOCAB_SAMPLE = 64  # evenly spaced token ids compared between the two vocabularies
PROBE_TEXT = "The capital of France is Paris.\ndef main():\n    print('hi')  # café 😀 你好"


class VocabularyMismatchError(ModelLoadError):
    """The draft model's tokenizer does not match the target's: its tokens would mean
    something else to the target."""


@dataclass(frozen=True)
class VocabularyFacts:
    size: int
    special: tuple[tuple[str, object], ...]  # ("bos_token_id", 1), ...: compared in order
    piece: Callable[[int], str]  # a token id's text
    encode: Callable[[str], list[int]]  # text to ids, no special tokens added
    special_ids: frozenset[int] = field(default_factory=frozenset)  # their pieces compared too


def vocabulary_difference(draft: VocabularyFacts, target: VocabularyFacts) -> str | None:
    """A one-line reason why two vocabularies differ, or None if they look the same: size,
    special tokens, a sample of pieces across the vocabulary, and one encoded text."""
    size = target.size
    if draft.size != size:
        return f"{draft.size} tokens vs the model's {size}"
    for (name, ours), (_, theirs) in zip(draft.special, target.special, strict=True):
        if ours != theirs:
            return f"{name} is {ours} vs the model's {theirs}"
    ids = set(range(0, size, max(1, size // VOCAB_SAMPLE))) | {size - 1}
    ids |= {i for i in draft.special_ids | target.special_ids if 0 <= i < size}
    for token_id in sorted(ids):
        a, b = draft.piece(token_id), target.piece(token_id)
        if a != b:
            return f"token {token_id} is {a!r} vs the model's {b!r}"
    if draft.encode(PROBE_TEXT) != target.encode(PROBE_TEXT):
        return "the same text splits into different tokens"
    return None


def check_same_vocabulary(draft_name: str, draft: VocabularyFacts, target_name: str,
                          target: VocabularyFacts) -> None:
    """Raise VocabularyMismatchError (one line) unless draft can propose tokens for target."""
    reason = vocabulary_difference(draft, target)
    if reason is not None:
        raise VocabularyMismatchError(
            f"draft model {draft_name} does not share the vocabulary of {target_name} "
            f"({reason}); pick a draft from the same model family")
