"""A request's prompt: the chat tokenized with each message's span, fitted to the context."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.core.chat_template import FALLBACK_STOPS, encode_chat_layout
from engine.core.ledger import PromptLayout
from engine.errors import ContextOverflowError, InvalidRequestError
from engine.events import ModelInfo
from engine.params import ChatMessage, GenerationRequest


class ChatModel(Protocol):
    """What the core reads of a loaded model on any runtime."""

    @property
    def info(self) -> ModelInfo: ...

    @property
    def tokenizer(self) -> Any: ...  # a Hugging Face tokenizer or one that behaves like it


def template_stops(model: ChatModel) -> tuple[str, ...]:
    """Stop strings the chat template implies (the plain fallback template has no EOS turn)."""
    return FALLBACK_STOPS if model.info.template_fallback else ()


@dataclass
class PreparedPrompt:
    ids: list[int]
    layout: PromptLayout = field(default_factory=PromptLayout)

    @property
    def dropped_messages(self) -> int:
        return self.layout.dropped_messages


def prepare_prompt(model: ChatModel, request: GenerationRequest) -> PreparedPrompt:
    """Tokenize the request and check that it fits the context (at least one reply token)."""
    request.validate()
    context = model.info.context_length
    if request.prompt_token_ids is not None:
        ids = list(request.prompt_token_ids)
        if len(ids) + 1 > context:
            raise ContextOverflowError(len(ids), context)
        return PreparedPrompt(ids)
    messages = list(request.messages)
    prompt = _encode_messages(model, messages)
    if len(prompt.ids) + 1 <= context:
        return prompt
    droppable = [i for i, m in enumerate(messages[:-1]) if m.role != "system"]
    if request.overflow != "drop_oldest" or not droppable:
        raise ContextOverflowError(len(prompt.ids), context)
    return _drop_oldest_to_fit(model, messages, droppable, context)


def _drop_oldest_to_fit(
    model: ChatModel, messages: list[ChatMessage], droppable: list[int], context: int
) -> PreparedPrompt:
    """The prompt with the fewest oldest non-system messages dropped that fits the context.

    Dropping more never makes the prompt longer, so a binary search over the count needs
    O(log n) encodes of the history instead of one per dropped message.
    """

    def without_oldest(count: int) -> list[ChatMessage]:
        gone = set(droppable[:count])
        return [m for i, m in enumerate(messages) if i not in gone]

    fewest = _encode_messages(model, without_oldest(len(droppable)))
    if len(fewest.ids) + 1 > context:
        raise ContextOverflowError(len(fewest.ids), context)
    # Invariant: dropping `hi` messages fits (best is that prompt); dropping lo - 1 does not.
    lo, hi, best = 1, len(droppable), fewest
    while lo < hi:
        mid = (lo + hi) // 2
        candidate = _encode_messages(model, without_oldest(mid))
        if len(candidate.ids) + 1 <= context:
            hi, best = mid, candidate
        else:
            lo = mid + 1
    best.layout = dataclasses.replace(best.layout, dropped_messages=hi)
    return best


def _encode_messages(model: ChatModel, messages: list[ChatMessage]) -> PreparedPrompt:
    chat = encode_chat_layout(model.tokenizer, messages, model_identity=model.info.identity)
    if not chat.ids:
        raise InvalidRequestError("prompt is empty")
    assistant = [s for s in chat.spans if s[0] == "assistant"]
    layout = PromptLayout(
        spans=tuple(chat.spans),
        generated_span=(assistant[-1][1], assistant[-1][2]) if assistant else None,
        edited_replies=chat.edited_replies,
    )
    return PreparedPrompt(chat.ids, layout)
