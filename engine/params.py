"""Request types: sampling settings and chat messages."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Literal

from engine.errors import InvalidRequestError

Role = Literal["system", "user", "assistant"]
Speculative = Literal["ngram", "draft"]  # a speculative decoding method
Overflow = Literal["refuse", "drop_oldest"]  # what a prompt over the context gets
_request_ids = itertools.count(1)
MAX_ALTERNATIVES = 8  # one decode batch
# Seeds are 0 <= seed < 2**63: what the sampler's generator and a signed 64-bit field on a
# remote server both accept. Alternatives use (seed + i) mod SEED_LIMIT, staying in range.
SEED_LIMIT = 2**63


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    content: str
    # An assistant reply's token ids as its model produced them (GenerationResult.token_ids)
    # and that model's identity (ModelInfo.identity). The prompt uses them for this message's
    # span where they decode to `content` with the model at hand: re-tokenizing a sampled
    # reply's text can merge a split the model made, and the prefix cache would then read the
    # reply again. A cache hint only: equal messages compare equal without them, and remote
    # servers never see them.
    token_ids: tuple[int, ...] | None = field(default=None, compare=False, repr=False)
    token_model: str | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token. temperature == 0 means greedy (argmax, no randomness)."""

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    max_tokens: int = 512
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: always produce max_tokens tokens

    def validate(self) -> None:
        """Raise InvalidRequestError with a one-line reason if any value is out of range."""
        if not self.temperature >= 0:
            raise InvalidRequestError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top-p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise InvalidRequestError(f"top-k must be >= 0 (got {self.top_k})")
        if not 0 <= self.min_p < 1:
            raise InvalidRequestError(f"min-p must be in [0, 1) (got {self.min_p})")
        if not self.repetition_penalty > 0:
            raise InvalidRequestError(
                f"repetition penalty must be > 0 (got {self.repetition_penalty})"
            )
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max tokens must be >= 1 (got {self.max_tokens})")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")
        self._validate_seed()

    def _validate_seed(self) -> None:
        seed = self.seed
        if seed is None:
            return
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidRequestError(f"seed must be a whole number (got {seed!r})")
        if not 0 <= seed < SEED_LIMIT:
            raise InvalidRequestError(f"seed must be from 0 to 2**63 - 1 (got {seed})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerationRequest:
    """One reply to generate. conversation_id keys the per-conversation prefix cache."""

    messages: list[ChatMessage]
    params: SamplingParams = field(default_factory=SamplingParams)
    conversation_id: str | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_request_ids)}")
    # Precomputed prompt (benchmarks): skips the chat template when set.
    prompt_token_ids: list[int] | None = None
    # A prompt over the context is refused; "drop_oldest" drops the oldest turns instead,
    # keeping the system prompt and the last user message.
    overflow: Overflow = "refuse"
    # False computes the whole prompt cold (benchmarks, cached-vs-cold checks).
    reuse_cache: bool = True
    # Speculative decoding: "ngram" drafts by prompt lookup (greedy requests only), "draft" with
    # the engine's draft model (Engine.load_draft_sync). Greedy output is identical to plain
    # decoding; sampled drafts pass the speculative sampling test (same distribution).
    # None decodes one token per step.
    speculative: Speculative | None = None

    def validate(self) -> None:
        self.params.validate()
        if self.speculative not in (None, "ngram", "draft"):
            raise InvalidRequestError(
                f"unknown speculative method {self.speculative!r} (use 'ngram' or 'draft')")
        if self.prompt_token_ids is not None:
            if not self.prompt_token_ids:
                raise InvalidRequestError("prompt is empty")
            return
        if not self.messages:
            raise InvalidRequestError("no messages to answer")
        last = self.messages[-1]
        if last.role != "user" or not last.content.strip():
            raise InvalidRequestError("prompt is empty: type a message first")

    def alternatives(self, n: int) -> list[GenerationRequest]:
        """N sampled replies to this prompt, each with its own request id and seed (seed + i
        when a seed is set, so the set is reproducible). They decode plainly, in one batch."""
        if not 1 <= n <= MAX_ALTERNATIVES:
            raise InvalidRequestError(f"alternatives must be 1 to {MAX_ALTERNATIVES} (got {n})")
        seed = self.params.seed
        return [
            dataclasses.replace(
                self,
                request_id=f"{self.request_id}.{i}",
                params=dataclasses.replace(self.params,
                                           seed=None if seed is None
                                           else (seed + i) % SEED_LIMIT),
                speculative=None,
            )
            for i in range(n)
        ]
