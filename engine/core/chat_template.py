"""Chat prompt -> token ids, where message text can never become a control token.

The tokenizer's template is rendered with a unique sentinel in place of each message's text.
The template's own parts are tokenized with special tokens recognised; each message's text is
tokenized with special tokens split into ordinary text, so a user typing `<|im_end|>` gets
the characters, not the control token.

An assistant message that carries the ids its model produced (ChatMessage.token_ids) keeps
them where they decode to its text with this tokenizer: a sampled reply may split a word in
a way that re-tokenizing its text merges, and the prefix cache holds the ids as produced.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.params import ChatMessage

# Used when a model ships no chat template (the loader says so in ModelInfo): a base model's
# plain transcript, after the BOS token where the model's own encoding starts with one
# (fallback_template).
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
# A base model has no end-of-turn token: its reply ends where it starts the next turn itself,
# anyone's (after one newline or two: both are stops, so neither newline stays in the reply),
# its own "Assistant:" included, which it otherwise repeats until max_tokens.
FALLBACK_STOPS = tuple(f"{newlines}{role}:" for role in ("User", "Assistant", "System")
                       for newlines in ("\n\n", "\n"))


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer's own encoding of text starts with BOS: a GGUF's
    `tokenizer.ggml.add_bos_token` on llama.cpp, the post-processor on a Hugging Face
    tokenizer. A chat template writes its BOS itself; the fallback has to ask."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == bos


def fallback_template(tokenizer: Any) -> str:
    """FALLBACK_TEMPLATE, opened with BOS where the model's encoding has one: a base model
    read without it (Gemma, Llama) loses the thread and answers with turn markers."""
    return ("{{ bos_token }}" if adds_bos(tokenizer) else "") + FALLBACK_TEMPLATE


def encode_chat(
    tokenizer: Any, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of the chat prompt, with message text kept inert."""
    return encode_chat_with_spans(tokenizer, messages, add_generation_prompt)[0]


def _encode(tokenizer: Any, text: str, *, split_special: bool) -> list[int]:
    if not text:
        return []
    return list(
        tokenizer(text, add_special_tokens=False, split_special_tokens=split_special)["input_ids"]
    )


# How many of a reply's ids may run past its text: the EOS token, a stop string's tokens.
MAX_IDS_PAST_TEXT = 64


@dataclass
class EncodedChat:
    ids: list[int]
    spans: list[tuple[str, int, int]]  # each message's (role, start, end) token span
    # Indices into spans of replies whose own ids no longer match their text (edited).
    edited_replies: tuple[int, ...] = ()


def encode_chat_with_spans(
    tokenizer: Any, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
    model_identity: str | None = None,
) -> tuple[list[int], list[tuple[str, int, int]]]:
    """Like encode_chat, plus each message's (role, start, end) token span in the prompt."""
    chat = encode_chat_layout(tokenizer, messages, add_generation_prompt, model_identity)
    return chat.ids, chat.spans


def reply_ids(tokenizer: Any, message: ChatMessage,
              model_identity: str | None) -> tuple[list[int], bool]:
    """An assistant message's ids as its model produced them, as far as they decode to its
    text with this tokenizer (the rest of the text, if any, encoded), and whether its text was
    edited since (it is not what its ids decode to). Ids of another model are ignored; ids are
    never trusted blindly: the model file may have changed under the same name."""
    own = message.token_ids
    text = message.content
    if not own or model_identity is None or message.token_model != model_identity:
        return _encode(tokenizer, text, split_special=True), False
    if not tokenizer.decode(own, skip_special_tokens=True).startswith(text):
        return _encode(tokenizer, text, split_special=True), True
    # The longest prefix whose text starts the message's text, walking back over what ran
    # past it (EOS, a stop string). Decoding with and without special tokens agreeing means
    # no control token is among them (message text stays inert).
    for k in range(len(own), max(len(own) - MAX_IDS_PAST_TEXT, 0), -1):
        piece = tokenizer.decode(own[:k], skip_special_tokens=False)
        if text.startswith(piece) and piece == tokenizer.decode(own[:k],
                                                                 skip_special_tokens=True):
            return list(own[:k]) + _encode(tokenizer, text[len(piece):],
                                           split_special=True), False
    return _encode(tokenizer, text, split_special=True), False


def encode_chat_layout(
    tokenizer: Any, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
    model_identity: str | None = None,
) -> EncodedChat:
    """The chat's ids and message spans; replies use their own ids where they still fit
    (`model_identity`: the model at hand, ModelInfo.identity)."""
    tag = secrets.token_hex(8)
    sentinels = [f"\x00pw{tag}{i}\x00" for i in range(len(messages))]
    rendered = tokenizer.apply_chat_template(
        [{"role": m.role, "content": s} for m, s in zip(messages, sentinels, strict=False)],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=None if has_chat_template(tokenizer) else fallback_template(tokenizer),
    )
    index = {s: i for i, s in enumerate(sentinels)}
    pattern = re.compile("|".join(re.escape(s) for s in sentinels))
    ids: list[int] = []
    spans: list[tuple[str, int, int]] = []
    edited: list[int] = []
    pos = 0
    for match in pattern.finditer(rendered):
        ids += _encode(tokenizer, rendered[pos : match.start()], split_special=False)
        message = messages[index[match.group()]]
        start = len(ids)
        if message.role == "assistant":
            text_ids, was_edited = reply_ids(tokenizer, message, model_identity)
            if was_edited:
                edited.append(len(spans))
        else:
            text_ids = _encode(tokenizer, message.content, split_special=True)
        ids += text_ids
        spans.append((message.role, start, len(ids)))
        pos = match.end()
    ids += _encode(tokenizer, rendered[pos:], split_special=False)
    return EncodedChat(ids, spans, tuple(edited))
