"""Draft-model speculation on llama.cpp: a second GGUF in a second context, same thread.

The draft proposes k tokens one llama_decode at a time on its own KV sequence; the target
verifies them all in one llama_decode (engine/runtimes/llamacpp/session.py). Before each proposal
the draft's sequence is cut back (seq_rm) to the longest prefix it shares with the tokens accepted
so far, so only the target's correction token (or, after a fully accepted draft, the last
draft token and the bonus token) is fed. Acceptance rules, adaptive draft length and the
speculative sampling rule are the torch engine's (engine/runtimes/torch/draft.py's DraftProposer,
engine/core/speculative.py's verify_sampled): only proposing runs here.

A good pair is one model in two quantizations: a bigger file as the target, a 4-bit one as
the draft. The draft must share the target's vocabulary; it is checked at load.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.core.ledger import common_prefix_len
from engine.core.speculative import TokenProposer
from engine.core.vocab import (
    VocabularyFacts,
    VocabularyMismatchError,
    check_same_vocabulary,
)
from engine.events import ModelInfo
from engine.runtimes.llamacpp.model import LlamaCppModel, Progress, load_gguf, warm_up_llama

SEQ = 0  # the draft context's only sequence


class LlamaDraftModel(TokenProposer):
    """A draft GGUF in its own llama.cpp context. `ids` mirrors the sequence position by
    position. Only the engine thread may use it (engine/runtimes/torch/draft.py's Drafter)."""

    def __init__(self, loaded: LlamaCppModel, vocab_limit: int) -> None:
        super().__init__(vocab_limit, loaded.info.context_length)
        self.loaded = loaded
        self._lib = loaded.llama_cpp
        self._writer = _Writer(loaded)

    @property
    def info(self) -> ModelInfo:
        return self.loaded.info

    def reset(self) -> None:
        self._lib.llama_memory_clear(self.loaded.memory, False)
        self.ids = []

    def close(self) -> None:
        self.loaded.close()

    def prefill(self, prompt_ids: Sequence[int], cancel: threading.Event) -> bool:
        """Bring the sequence up to prompt_ids (all but the last token, which the first
        proposal feeds) during the target's prefill, so the draft's share of the prompt counts
        as prefill, not decode. False if cancel was set between two batches."""
        keep = common_prefix_len(self.ids, prompt_ids[:-1])
        if len(self.ids) > keep:
            self._lib.llama_memory_seq_rm(self.loaded.memory, SEQ, keep, -1)
            del self.ids[keep:]
        rest = list(prompt_ids[keep:-1])
        step = self.loaded.n_batch
        for begin in range(0, len(rest), step):
            if cancel.is_set():
                return False
            chunk = rest[begin : begin + step]
            self._writer.decode(chunk, len(self.ids), logits_last=False)
            self.ids.extend(chunk)
        return True

    def _logits_after(self, history: Sequence[int]) -> torch.Tensor:
        """Cut the sequence to what it shares with history (keeping one token to feed, for
        fresh logits), feed the rest, return the last position's logits."""
        keep = min(common_prefix_len(self.ids, history), len(history) - 1)
        if len(self.ids) > keep:
            self._lib.llama_memory_seq_rm(self.loaded.memory, SEQ, keep, -1)
            del self.ids[keep:]
        return self._feed(list(history[keep:]))

    def _feed(self, ids: list[int]) -> torch.Tensor:
        """Append ids to the sequence in batches; the last position's logits (a view valid
        until the next decode)."""
        step = self.loaded.n_batch
        for begin in range(0, len(ids), step):
            chunk = ids[begin : begin + step]
            start = len(self.ids)
            last = begin + len(chunk) == len(ids)
            self._writer.decode(chunk, start, last)
            self.ids.extend(chunk)
        return self.loaded.logits(1)[0]


class _Writer:
    """One sequence's rows into the draft's llama_batch (logits for the last row only)."""

    def __init__(self, loaded: LlamaCppModel) -> None:
        from engine.runtimes.llamacpp.decode import writer_for

        self.loaded = loaded
        self.batch = writer_for(loaded)

    def decode(self, tokens: list[int], start: int, logits_last: bool) -> None:
        n = len(tokens)
        outputs = [logits_last and i == n - 1 for i in range(n)]
        self.batch.fill(tokens, range(start, start + n), [SEQ] * n, outputs)
        code = self.loaded.llama_cpp.llama_decode(self.loaded.ctx, self.loaded.batch)
        if code != 0:
            raise RuntimeError(f"llama.cpp failed to decode a draft batch (code {code})")




def gguf_facts(loaded: LlamaCppModel) -> VocabularyFacts:
    """What the vocabulary comparison reads of a GGUF's vocabulary."""
    tokenizer = loaded.tokenizer
    eog = tuple(sorted(loaded.eog_ids or tokenizer.end_of_generation_ids()))
    special = (("BOS", tokenizer.bos_token_id), ("EOS", tokenizer.eos_token_id),
               ("the end-of-generation tokens", eog))
    return VocabularyFacts(
        size=loaded.n_vocab, special=special,
        piece=lambda i: tokenizer.token_to_piece(i, True).decode("utf-8", "replace"),
        encode=lambda text: list(tokenizer.encode(text)))


def load_llama_draft(path: Path, target: LlamaCppModel, *, name: str, source: str,
                     progress: Progress | None = None) -> LlamaDraftModel:
    """Load a draft GGUF for target into a second context (the target's context length and
    threads), check its vocabulary, warm it up; ModelLoadError in one line on failure."""
    loaded = load_gguf(path, name=name, source=source,
                       context_length=target.info.context_length,
                       n_threads=target.n_threads, progress=progress)
    try:
        check_same_vocabulary(name, gguf_facts(loaded), target.info.name, gguf_facts(target))
    except VocabularyMismatchError:
        loaded.close()
        raise
    warm_up_llama(loaded)
    return LlamaDraftModel(loaded, vocab_limit=target.n_vocab)
