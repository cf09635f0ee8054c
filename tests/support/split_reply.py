"""Sampled replies whose text re-tokenizes to other ids than the model produced (a BPE merge
the model split), the case that made a next turn's prompt part from the cached reply."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.events import GenerationResult

# Seeds searched for a split reply: on the tiny random model about 1 sampled 6-token reply in
# 500-1,600 is printable and re-tokenizes differently within what the cache holds. With numpy's
# generator the first such seed is 523 on the torch tiny model; the search starts near it (each
# reply is checked, not assumed, so a sampler change only moves the seed found).
SPLIT_SEEDS = range(500, 8500)


def reply_body(result: GenerationResult, end_ids: set[int]) -> list[int]:
    """The reply's ids less a final end-of-turn token (it is the template's, not the text's)."""
    ids = list(result.token_ids)
    return ids[:-1] if ids and ids[-1] in end_ids else ids


def splits_on_retokenizing(tokenizer: Any, result: GenerationResult, end_ids: set[int]) -> bool:
    """The reply's ids decode to exactly its text, and re-tokenizing that text gives other ids
    (plain readable text, so the split is a merge, not a broken UTF-8 byte)."""
    body = reply_body(result, end_ids)
    text = result.text
    if not body or "\ufffd" in text or not text.isprintable():
        return False
    retokenized = list(tokenizer(text, add_special_tokens=False,
                                 split_special_tokens=True)["input_ids"])
    # the ids part before the body's last token: the cache holds them (the last one a reply
    # emits is never fed), so the next turn's prompt parts from what is cached
    return tokenizer.decode(body, skip_special_tokens=False) == text and \
        retokenized[:len(body) - 1] != body[:-1]


def first_split_reply(sample: Callable[[int], GenerationResult], tokenizer: Any,
                      end_ids: set[int], seeds: range) -> tuple[int, GenerationResult]:
    """The first seed in `seeds` whose sampled reply splits on re-tokenizing (deterministic:
    the same seed samples the same reply); AssertionError if none does."""
    for seed in seeds:
        result = sample(seed)
        if splits_on_retokenizing(tokenizer, result, end_ids):
            return seed, result
    raise AssertionError(f"no seed in {seeds} samples a reply that re-tokenizes differently")
