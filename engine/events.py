"""Events the engine thread emits. Plain dataclasses; t_ns is time.perf_counter_ns()."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from engine.metrics import RequestMetrics
from engine.params import ChatMessage

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling settings a model ships in its generation_config; None where it sets none
    (so the window can say where each value came from)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str  # "default" | "folder" | "gguf" | "hub"
    path: str
    device: str
    dtype: str
    context_length: int
    parameters: int
    weight_bytes_per_step: int
    kernel: str
    template_fallback: bool = False
    engine: str = "torch"  # the runtime that runs it: "torch" or "llama.cpp"
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    @property
    def identity(self) -> str:
        """Which model on which runtime: a reply's token ids are reused only by this one."""
        return f"{self.engine}:{self.source}:{self.path}:{self.name}"


@dataclass(frozen=True)
class ModelLoading:
    t_ns: int
    stage: str  # one human-readable line: "converting GGUF (first start only)", ...


@dataclass(frozen=True)
class ModelLoadProgress:
    """How far a long load step got (a GGUF converting for torch: tensors done of total)."""

    t_ns: int
    stage: str
    done: int
    total: int

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0


@dataclass(frozen=True)
class ModelLoaded:
    t_ns: int
    info: ModelInfo
    load_s: float


@dataclass(frozen=True)
class ModelLoadFailed:
    t_ns: int
    message: str
    draft: bool = False  # the draft model failed to load (the model itself is unchanged)


@dataclass(frozen=True)
class DraftModelChanged:
    """The draft model for speculative="draft" requests was loaded, or dropped (name None:
    dropped on request, or because a new model was loaded)."""

    t_ns: int
    name: str | None
    kernel: str | None = None


@dataclass(frozen=True)
class RequestQueued:
    request_id: str
    t_ns: int


@dataclass(frozen=True)
class PrefillStarted:
    request_id: str
    t_ns: int
    prompt_tokens: int
    cached_tokens: int
    cache_miss_reason: str


@dataclass(frozen=True)
class PrefillProgress:
    """How far a prefill has got: after each chunk, and within a long one as the model's layers
    go through it (engine.core.prefill_progress; there done_tokens counts that share of the chunk's
    tokens). done_tokens / total_tokens count the prompt tokens being computed (cached ones
    excluded); tok_s is the prefill rate so far, eta_s the time left (later tokens cost more:
    engine.core.prefill_eta), None until enough of the prompt is read to say it."""

    request_id: str
    t_ns: int
    done_tokens: int
    total_tokens: int
    tok_s: float
    eta_s: float | None

    @property
    def fraction(self) -> float:
        return self.done_tokens / self.total_tokens if self.total_tokens else 1.0


@dataclass(frozen=True)
class TokenEmitted:
    """One sampled token. text is the printable delta (may be empty while a UTF-8 char is split)."""

    request_id: str
    t_ns: int
    index: int
    token_id: int
    text: str


@dataclass(frozen=True)
class SamplerSnapshot:
    """What the sampler saw for one token (emitted at most ~10 times a second).

    candidates: the top tokens as (token_id, text, probability after temperature), most likely
    first; kept: how many of them survive top-k / top-p / min-p; chosen_id: the token drawn.
    """

    request_id: str
    t_ns: int
    index: int
    temperature: float
    top_p: float
    candidates: tuple[tuple[int, str, float], ...]
    kept: int
    chosen_id: int


@dataclass(frozen=True)
class TextFlushed:
    """Text held back until the reply ended (a partial stop string or character)."""

    request_id: str
    t_ns: int
    text: str


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    text: str
    finish_reason: FinishReason
    token_ids: list[int]
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    model: ModelInfo | None = None
    error: str | None = None
    notice: str | None = None  # one line for the user that is not an error (remote backends)
    speculative: str | None = None  # the draft method that ran, None for plain decoding
    spec_proposed: int = 0  # draft tokens proposed
    spec_accepted: int = 0  # draft tokens the model confirmed
    # Oldest messages left out so the prompt fit the context (overflow="drop_oldest").
    dropped_messages: int = 0

    @property
    def spec_accept_rate(self) -> float:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0

    def as_message(self) -> ChatMessage:
        """This reply as the next turn's assistant message, with the ids its model produced
        (so the next prompt holds the reply exactly as the prefix cache does)."""
        if not self.token_ids or self.model is None:
            return ChatMessage("assistant", self.text)
        return ChatMessage("assistant", self.text, tuple(self.token_ids), self.model.identity)

    def to_json_dict(self) -> dict[str, Any]:
        """The `ask --json` object: text, finish reason, metrics and model fields, flat."""
        out: dict[str, Any] = {"text": self.text, "finish_reason": self.finish_reason}
        out.update(self.metrics.to_dict())
        out["prompt_token_ids"] = self.prompt_token_ids
        out["output_token_ids"] = self.token_ids
        out.update(speculative=self.speculative, spec_proposed=self.spec_proposed,
                   spec_accepted=self.spec_accepted, spec_accept_rate=self.spec_accept_rate,
                   dropped_messages=self.dropped_messages)
        if self.model is not None:
            out.update(
                model=self.model.name,
                device=self.model.device,
                dtype=self.model.dtype,
                kernel=self.model.kernel,
                context_length=self.model.context_length,
                engine=self.model.engine,
            )
        if self.error:
            out["error"] = self.error
        if self.notice:
            out["notice"] = self.notice
        return out


@dataclass(frozen=True)
class RequestFinished:
    request_id: str
    t_ns: int
    result: GenerationResult = field(repr=False)


@dataclass(frozen=True)
class RequestFailed:
    """The request could not run (bad input, overflow) or crashed; message is one line."""

    request_id: str
    t_ns: int
    message: str
    context_overflow: bool = False  # the prompt did not fit the context (ContextOverflowError)


EngineEvent = (
    ModelLoading
    | ModelLoadProgress
    | ModelLoaded
    | ModelLoadFailed
    | DraftModelChanged
    | RequestQueued
    | PrefillStarted
    | PrefillProgress
    | TokenEmitted
    | SamplerSnapshot
    | TextFlushed
    | RequestFinished
    | RequestFailed
)
TERMINAL_EVENTS = (RequestFinished, RequestFailed)
