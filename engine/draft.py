"""Draft-model speculative decoding: a cheaper model with the target's vocabulary proposes.

The draft runs k one-token greedy steps; the target checks all k in one forward pass (see
engine/speculative.py and DecodeSession._decode) and keeps the longest prefix it agrees with,
so greedy output is the target's own whatever the draft proposes. The draft keeps its own
KV cache: before each proposal it is cropped to the longest prefix it shares with the tokens
accepted so far, and only the rest is fed (usually the target's one correction token).

A good draft is the same model through a cheaper kernel (int8-dynamic on a CPU): nearly every
proposal is accepted, and its steps cost a fraction of the target's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.core.ledger import common_prefix_len
from engine.errors import ModelLoadError
from engine.loader import LoadedModel, load_model
from engine.prefix_cache import RollbackError, crop_to, new_cache
from engine.speculative import TokenProposer

VOCAB_SAMPLE = 64  # evenly spaced token ids compared between the two vocabularies
PROBE_TEXT = "The capital of France is Paris.\ndef main():\n    print('hi')  # café 😀 你好"


class VocabularyMismatchError(ModelLoadError):
    """The draft model's tokenizer does not match the target's: its tokens would mean
    something else to the target."""


def vocabulary_difference(draft: Any, target: Any) -> str | None:
    """A one-line reason why two tokenizers differ, or None if they look the same:
    size, special token ids, a sample of ids across the vocabulary, and one encoded text."""
    size = len(target)
    if len(draft) != size:
        return f"{len(draft)} tokens vs the model's {size}"
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(draft, name, None) != getattr(target, name, None):
            return f"{name} is {getattr(draft, name, None)} vs the model's " \
                   f"{getattr(target, name, None)}"
    ids = set(range(0, size, max(1, size // VOCAB_SAMPLE))) | {size - 1}
    ids |= {i for i in (*draft.all_special_ids, *target.all_special_ids) if 0 <= i < size}
    ids_sorted = sorted(ids)
    ours = draft.convert_ids_to_tokens(ids_sorted)
    theirs = target.convert_ids_to_tokens(ids_sorted)
    for token_id, a, b in zip(ids_sorted, ours, theirs, strict=True):
        if a != b:
            return f"token {token_id} is {a!r} vs the model's {b!r}"
    if draft.encode(PROBE_TEXT, add_special_tokens=False) != target.encode(
            PROBE_TEXT, add_special_tokens=False):
        return "the same text splits into different tokens"
    return None


def check_same_vocabulary(draft: LoadedModel, target: LoadedModel) -> None:
    """Raise VocabularyMismatchError (one line) unless draft can propose tokens for target."""
    reason = vocabulary_difference(draft.tokenizer, target.tokenizer)
    if reason is not None:
        raise VocabularyMismatchError(
            f"draft model {draft.info.name} does not share the vocabulary of "
            f"{target.info.name} ({reason}); pick a draft from the same model family")


class DraftModel(TokenProposer):
    """A loaded draft model and its KV cache. Only the engine thread may use it.

    `ids` mirrors the cache position by position; any sequence can be drafted for, since
    each proposal first re-syncs the cache to the longest prefix it shares with it.
    """

    def __init__(self, loaded: LoadedModel, vocab_limit: int) -> None:
        super().__init__(vocab_limit, loaded.info.context_length)
        self.loaded = loaded
        self.cache: Any = None
        self.reset()

    @property
    def name(self) -> str:
        return self.loaded.info.name

    def reset(self) -> None:
        self.cache = new_cache(self.loaded.model.config)
        self.ids = []

    def _logits_after(self, history: Sequence[int]) -> torch.Tensor:
        """Crop the cache to what it shares with history (keeping one token to feed, for
        fresh logits), feed the rest, return the last position's logits."""
        keep = min(common_prefix_len(self.ids, history), len(history) - 1)
        if len(self.ids) > keep:
            try:
                crop_to(self.cache, keep)
                del self.ids[keep:]
            except RollbackError:  # a recurrent state cannot go back: start over
                self.reset()
                keep = 0
        if keep == 0 and len(history) > 1:
            # The first position's outsized activations (an attention sink) would set an
            # int8-dynamic draft's per-pass activation scale for the whole prompt: on
            # SmolLM2 feeding it alone lifts acceptance from ~50% to ~70%.
            self._feed([history[0]])
            keep = 1
        return self._feed(list(history[keep:]))

    def _feed(self, ids: list[int]) -> torch.Tensor:
        input_ids = torch.tensor([ids], device=self.loaded.device)
        out = self.loaded.model(input_ids=input_ids, cache=self.cache, use_cache=True,
                                logits_to_keep=1)
        self.ids.extend(ids)
        logits: torch.Tensor = out.logits[0, -1]
        return logits




def load_draft(
    spec: str,
    target: LoadedModel,
    *,
    kernel: str = "auto",
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> DraftModel:
    """Load a draft model for target, by the loader's rules (offline, no remote code,
    safetensors) on the target's device; raise ModelLoadError with one line on failure."""
    from engine.kernels import select_kernel

    options = {**options, "device": target.info.device}
    loaded = load_model(spec, progress=progress, **options)
    check_same_vocabulary(loaded, target)
    loaded = select_kernel(loaded, kernel, progress=progress)
    draft = DraftModel(loaded, vocab_limit=target.model.config.vocab_size)
    draft.propose([loaded.tokenizer.eos_token_id or 0] * 4, 1)  # one-time kernel set-up
    draft.reset()
    return draft
