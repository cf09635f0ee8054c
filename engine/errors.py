"""Errors the engine raises on bad input. Each carries one line a person can act on."""

from __future__ import annotations


class PhasewiseError(Exception):
    """Base class: str(error) is a complete, one-line message for the user."""


class ModelLoadError(PhasewiseError):
    """The model could not be found, read or loaded."""


class DownloadNotAllowedError(ModelLoadError):
    """The model would have to be downloaded, and the user has not allowed it."""


class InvalidRequestError(PhasewiseError):
    """A request's prompt or sampling settings are out of range."""


class ContextOverflowError(InvalidRequestError):
    """The prompt does not fit in the model's context window."""

    def __init__(self, prompt_tokens: int, context_length: int, reserve: int = 1) -> None:
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length
        self.tokens_over = prompt_tokens + reserve - context_length
        super().__init__(
            f"prompt is {prompt_tokens} tokens, {self.tokens_over} over the model's context of "
            f"{context_length} tokens (leaving room for {reserve} reply token); start a new chat "
            "or drop older turns"
        )


class SamplingError(PhasewiseError):
    """The model produced logits that cannot be sampled from (NaN, all -inf)."""


def one_line(exc: BaseException) -> str:
    """An exception's first line, or its type's name when it says nothing: what a one-line
    error message quotes of a cause."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
