"""Chat prompt -> token ids, where message text can never become a control token.

The tokenizer's template is rendered with a unique sentinel in place of each message's text.
The template's own parts are tokenized with special tokens recognised; each message's text is
tokenized with special tokens split into ordinary text, so a user typing `<|im_end|>` gets
the characters, not the control token.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from typing import Any

from engine.params import ChatMessage

# Used when a model ships no chat template (the loader says so in ModelInfo).
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
FALLBACK_STOPS = ("\n\nUser:", "\n\nSystem:")


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


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


def encode_chat_with_spans(
    tokenizer: Any, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
) -> tuple[list[int], list[tuple[str, int, int]]]:
    """Like encode_chat, plus each message's (role, start, end) token span in the prompt."""
    tag = secrets.token_hex(8)
    sentinels = [f"\x00pw{tag}{i}\x00" for i in range(len(messages))]
    rendered = tokenizer.apply_chat_template(
        [{"role": m.role, "content": s} for m, s in zip(messages, sentinels, strict=False)],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=None if has_chat_template(tokenizer) else FALLBACK_TEMPLATE,
    )
    index = {s: i for i, s in enumerate(sentinels)}
    pattern = re.compile("|".join(re.escape(s) for s in sentinels))
    ids: list[int] = []
    spans: list[tuple[str, int, int]] = []
    pos = 0
    for match in pattern.finditer(rendered):
        ids += _encode(tokenizer, rendered[pos : match.start()], split_special=False)
        message = messages[index[match.group()]]
        start = len(ids)
        ids += _encode(tokenizer, message.content, split_special=True)
        spans.append((message.role, start, len(ids)))
        pos = match.end()
    ids += _encode(tokenizer, rendered[pos:], split_special=False)
    return ids, spans
