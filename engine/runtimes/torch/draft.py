"""Draft-model speculative decoding: a cheaper model with the target's vocabulary proposes.

The draft runs k one-token greedy steps; the target checks all k in one forward pass (see
engine/core/speculative.py and DecodeSession._decode) and keeps the longest prefix it agrees with,
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
from engine.core.speculative import TokenProposer
from engine.core.vocab import VocabularyFacts
from engine.core.vocab import check_same_vocabulary as check_vocabularies
from engine.events import ModelInfo
from engine.runtimes.torch.loader import LoadedModel, load_model
from engine.runtimes.torch.prefix_cache import RollbackError, crop_to, new_cache


def tokenizer_facts(tokenizer: Any) -> VocabularyFacts:
    """What the vocabulary comparison reads of a Hugging Face tokenizer."""
    special = tuple((name, getattr(tokenizer, name, None)) for name in
                    ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"))
    return VocabularyFacts(
        size=len(tokenizer), special=special,
        piece=lambda i: str(tokenizer.convert_ids_to_tokens(i)),
        encode=lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
        special_ids=frozenset(tokenizer.all_special_ids))


def check_same_vocabulary(draft: LoadedModel, target: LoadedModel) -> None:
    """Raise VocabularyMismatchError (one line) unless draft can propose tokens for target."""
    check_vocabularies(draft.info.name, tokenizer_facts(draft.tokenizer), target.info.name,
                       tokenizer_facts(target.tokenizer))


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
    def info(self) -> ModelInfo:
        return self.loaded.info

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
    from engine.runtimes.torch.kernels import select_kernel

    options = {**options, "device": target.info.device}
    loaded = load_model(spec, progress=progress, **options)
    check_same_vocabulary(loaded, target)
    loaded = select_kernel(loaded, kernel, progress=progress)
    draft = DraftModel(loaded, vocab_limit=target.model.config.vocab_size)
    draft.propose([loaded.tokenizer.eos_token_id or 0] * 4, 1)  # one-time kernel set-up
    draft.reset()
    return draft
