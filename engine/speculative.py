"""Prompt-lookup drafts for speculative decoding (no draft model needed; engine/draft.py
holds the draft-model drafter, with the same append/propose interface).

Chat replies often copy spans of the prompt (names, code, quoted text) or of themselves.
The last few tokens are looked up in everything seen so far; the tokens that followed their
latest earlier occurrence are the draft. The model then checks the whole draft in one
forward pass (decode is bandwidth-bound, so a pass over several tokens costs little more
than a pass over one) and keeps the longest prefix it agrees with.

Greedy output is identical to plain decoding when a row's logits do not depend on the other
rows in the pass (fp32-eager, fp16-dynamic). int8-dynamic quantizes activations with one
scale per pass, so there a verified token can differ from the one-token step's choice.

Sampled requests with a draft model use the speculative sampling rule (accept_or_resample):
the output is distributed as plain sampling's, though not the same sequence for a seed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.params import SamplingParams
from engine.sampling import apply_repetition_penalty, check_logits, filtered_probs

DRAFT_TOKENS = 6
MAX_NGRAM = 3
MIN_NGRAM = 2  # a single repeated token is too weak a cue: drafts from it are mostly rejected


class PromptLookup:
    """An incremental n-gram index over prompt + generated tokens."""

    draft_probs = None  # its drafts are not sampled: greedy requests only

    def __init__(self, ids: Iterable[int] = (), *, max_ngram: int = MAX_NGRAM,
                 min_ngram: int = MIN_NGRAM, draft_tokens: int = DRAFT_TOKENS) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.draft_tokens = draft_tokens
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
        """Up to max_tokens (at most draft_tokens) tokens that followed the longest earlier
        match of the tail."""
        max_tokens = min(max_tokens, self.draft_tokens)
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


def verify_sampled(logits: torch.Tensor, params: SamplingParams, previous_ids: Iterable[int],
                   drafted: int, q: torch.Tensor, generator: torch.Generator | None) -> int:
    """The target's token for one verified row of a sampled request: its distribution p is
    built as sample_token builds it (penalty, temperature, filters), then the draft's token
    is kept or replaced by accept_or_resample."""
    check_logits(logits)
    logits = apply_repetition_penalty(logits, list(previous_ids), params.repetition_penalty)
    check_logits(logits)
    return accept_or_resample(filtered_probs(logits, params), q, drafted, generator)


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, drafted: int,
                       generator: torch.Generator | None) -> int:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): keep the drafted token
    with probability min(1, p/q), else draw from the residual max(0, p - q), renormalised.

    p is the target's distribution, q the one the draft drew `drafted` from (zero-padded if
    narrower). The result is distributed exactly as p, whatever q is. A rejected token has
    residual 0, so the result differs from `drafted` exactly when it was rejected.
    """
    if q.shape[-1] < p.shape[-1]:
        q = torch.nn.functional.pad(q, (0, p.shape[-1] - q.shape[-1]))
    q = q[: p.shape[-1]].to(p.device, p.dtype)
    p_x, q_x = float(p[drafted]), float(q[drafted])
    u = float(torch.rand((), generator=generator, device=p.device))
    if q_x > 0 and u * q_x < p_x:
        return drafted
    residual = (p - q).clamp(min=0)
    total = float(residual.sum())
    if total <= 0:  # p == q up to rounding: the residual is empty, and p itself is exact
        return int(torch.multinomial(p, 1, generator=generator))
    return int(torch.multinomial(residual / total, 1, generator=generator))
