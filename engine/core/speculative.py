"""Drafts for speculative decoding, runtime-neutral: prompt lookup (no draft model needed),
and the draft-model side both runtimes share (TokenProposer, a draft model's proposal loop;
DraftProposer, one request's drafter). The draft models themselves are
engine/runtimes/torch/draft.py (torch) and engine/runtimes/llamacpp/draft.py.

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

import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.core.ledger import common_prefix_len
from engine.core.sampling import (
    Generator,
    apply_repetition_penalty,
    check_logits,
    draw,
    filtered_probs,
    uniform,
)
from engine.events import ModelInfo
from engine.params import GenerationRequest, SamplingParams

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

    def prepare(self, cancel: threading.Event) -> bool:
        """Nothing to feed ahead (the index is the prompt itself); False if Stop came."""
        return not cancel.is_set()

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


class Proposer(Protocol):
    """One request's drafter (PromptLookup, DraftProposer): fed each emitted token, asked for
    a draft before each step; draft_probs holds a sampled draft's distributions."""

    @property
    def draft_probs(self) -> list[torch.Tensor] | None: ...

    def prepare(self, cancel: threading.Event) -> bool:
        """Ready for the first proposal, during the target's prefill; False if Stop came."""
        ...

    def append(self, token: int) -> None: ...

    def propose(self, max_tokens: int) -> list[int]: ...


def drafter_for(request: GenerationRequest, prompt_ids: Sequence[int], can_roll_back: bool,
                draft: Drafter | None, stop_ids: Collection[int],
                generator: Generator | None) -> Proposer | None:
    """A speculative request's drafter, alone or in a batch. Greedy requests: verification
    keeps the output identical to plain decoding. Sampled requests: a draft model's sampled
    drafts pass the speculative sampling test, which keeps the output distribution the
    target's; prompt lookup decodes them plainly. None where the cache cannot take a rejected
    draft back out, or for a draft request without a draft model."""
    params = request.params
    if request.speculative is None or not can_roll_back:
        return None
    if request.speculative == "ngram":
        return PromptLookup(prompt_ids) if params.greedy else None
    if draft is None:
        return None
    return DraftProposer(draft, prompt_ids, () if params.ignore_eos else stop_ids, params,
                         generator)


@dataclass
class SpecStats:
    """Draft tokens proposed and accepted over one reply."""

    proposed: int = 0
    accepted: int = 0


def verify_sampled(logits: torch.Tensor, params: SamplingParams, previous_ids: Iterable[int],
                   drafted: int, q: torch.Tensor, generator: Generator | None) -> int:
    """The target's token for one verified row of a sampled request: its distribution p is
    built as sample_token builds it (penalty, temperature, filters), then the draft's token
    is kept or replaced by accept_or_resample."""
    check_logits(logits)
    logits = apply_repetition_penalty(logits, list(previous_ids), params.repetition_penalty)
    check_logits(logits)
    return accept_or_resample(filtered_probs(logits, params), q, drafted, generator)


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, drafted: int,
                       generator: Generator | None) -> int:
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
    u = uniform(generator)
    if q_x > 0 and u * q_x < p_x:
        return drafted
    residual = (p - q).clamp(min=0)
    total = float(residual.sum())
    if total <= 0:  # p == q up to rounding: the residual is empty, and p itself is exact
        return draw(p, generator)
    return draw(residual / total, generator)


# ----- draft models (both runtimes' draft models subclass TokenProposer) ----------------
START_DRAFT = 4
MIN_DRAFT = 1
MAX_DRAFT = 8


class TokenProposer(ABC):
    """What both engines' draft models share: propose k tokens one step at a time on a
    sequence kept in step with the accepted tokens. Subclasses own the KV state: reset,
    _logits_after (re-sync to history, feed the rest) and _feed (append, return the last
    position's logits)."""

    def __init__(self, vocab_limit: int, context: int) -> None:
        self.vocab_limit = vocab_limit  # ids the target can embed: never propose beyond them
        self.context = context  # positions the draft model takes
        self.ids: list[int] = []  # mirrors the draft's KV position by position
        self.last_probs: list[torch.Tensor] = []  # what each sampled draft token was drawn from

    @property
    @abstractmethod
    def info(self) -> ModelInfo:
        """The draft model's name, kernel and context, as the window shows it."""

    @property
    def name(self) -> str:
        return self.info.name

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def _logits_after(self, history: Sequence[int]) -> torch.Tensor: ...

    @abstractmethod
    def _feed(self, ids: list[int]) -> torch.Tensor: ...

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int], cancel: threading.Event) -> bool:
        """Bring the draft up to the prompt during the target's prefill, so the draft's share
        of the prompt counts as prefill, not decode (its first proposal then feeds only the
        target's first token). False if cancel was set first."""
        if cancel.is_set():
            return False
        try:
            self._logits_after(prompt_ids)
        except BaseException:
            self.reset()
            raise
        return True

    @torch.inference_mode()
    def propose(self, history: Sequence[int], k: int, stop_ids: Collection[int] = (),
                params: SamplingParams | None = None,
                generator: Generator | None = None) -> list[int]:
        """Up to k tokens continuing history, ending early at a stop id: greedy, or drawn
        with params' temperature and filters (no repetition penalty), keeping each token's
        distribution in last_probs for the target's acceptance test."""
        self.last_probs = []
        if k <= 0 or not history:
            return []
        try:
            logits = self._logits_after(history)
            drafts: list[int] = []
            while True:
                token = self._pick(logits[: self.vocab_limit], params, generator)
                drafts.append(token)
                if len(drafts) >= k or token in stop_ids:
                    return drafts
                logits = self._feed([token])
        except BaseException:
            self.reset()  # a failed step leaves the KV state unknown
            raise

    def _pick(self, logits: torch.Tensor, params: SamplingParams | None,
              generator: Generator | None) -> int:
        if params is None or params.greedy:
            return int(logits.argmax())
        probs = filtered_probs(logits, params)  # a copy: a logits view may die at the next step
        self.last_probs.append(probs)
        return draw(probs, generator)


class Drafter(Protocol):
    """What DraftProposer needs of a loaded draft: DraftModel (torch) or
    engine/runtimes/llamacpp/draft.py's LlamaDraftModel."""

    context: int
    last_probs: list[torch.Tensor]

    def prefill(self, prompt_ids: Sequence[int], cancel: threading.Event) -> bool: ...

    def propose(self, history: Sequence[int], k: int, stop_ids: Collection[int] = (),
                params: SamplingParams | None = None,
                generator: Generator | None = None) -> list[int]: ...


class DraftProposer:
    """One request's drafter: what has been accepted so far, and a draft length k that grows
    while whole drafts are accepted and shrinks after a rejection.

    Same interface as PromptLookup: append() each emitted token, propose(max_tokens). With
    sampling params, drafts are sampled and draft_probs holds their distributions.
    """

    def __init__(self, draft: Drafter, prompt_ids: Sequence[int],
                 stop_ids: Collection[int] = (), params: SamplingParams | None = None,
                 generator: Generator | None = None) -> None:
        self.draft = draft
        self.history = list(prompt_ids)
        self.stop_ids = frozenset(stop_ids)
        self.params = params
        self.generator = generator
        self.draft_probs: list[torch.Tensor] | None = None
        self.k = START_DRAFT
        self._last: list[int] = []
        self._last_at = 0  # len(history) when _last was proposed

    def prepare(self, cancel: threading.Event) -> bool:
        """Feed the prompt to the draft during the target's prefill; False if Stop came."""
        return self.draft.prefill(self.history, cancel)

    def append(self, token: int) -> None:
        self.history.append(token)

    def propose(self, max_tokens: int) -> list[int]:
        self._adapt()
        room = self.draft.context - len(self.history)  # the draft's own position limit
        k = min(self.k, max_tokens, room)
        self._last = self.draft.propose(self.history, k, self.stop_ids, self.params,
                                        self.generator)
        self._last_at = len(self.history)
        sampled = self.params is not None and not self.params.greedy
        self.draft_probs = self.draft.last_probs if sampled else None
        return self._last

    def _adapt(self) -> None:
        """Judge the previous draft by what was appended since it was proposed."""
        if not self._last:
            return
        emitted = self.history[self._last_at : self._last_at + len(self._last)]
        accepted = common_prefix_len(emitted, self._last)
        if accepted == len(self._last):
            self.k = min(self.k + 1, MAX_DRAFT)
        else:
            self.k = max(self.k - 1, MIN_DRAFT)
