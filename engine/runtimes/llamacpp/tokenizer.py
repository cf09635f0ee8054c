"""llama.cpp's vocabulary with the few methods engine/core/chat_template.py and engine/core/detok.py
use.

Template text is tokenized with special tokens recognised and message text with them split
into plain text (llama_tokenize's parse_special), so the safe-templating guarantee holds on this
engine too. The chat template comes from the GGUF's metadata and is rendered in a jinja2
sandbox, as transformers renders it.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any


class TemplateError(Exception):
    """raise_exception() called by a chat template."""


class LlamaCppTokenizer:
    def __init__(self, llama_cpp: Any, model: Any, vocab: Any) -> None:
        self._lib = llama_cpp
        self._vocab = vocab
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self._buffer = ctypes.create_string_buffer(256)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        raw = llama_cpp.llama_model_chat_template(model, None)
        self.chat_template: str | None = raw.decode("utf-8", "replace") if raw else None
        self.bos_token_id = _token_or_none(llama_cpp.llama_vocab_bos(vocab))
        self.eos_token_id = _token_or_none(llama_cpp.llama_vocab_eos(vocab))
        self.bos_token = self._text(self.bos_token_id)
        self.eos_token = self._text(self.eos_token_id)

    # ----- what engine/core/chat_template.py calls ------------------------------------------------
    def __call__(self, text: str, add_special_tokens: bool = False,
                 split_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_bos=add_special_tokens,
                                         parse_special=not split_special_tokens)}

    def apply_chat_template(self, messages: Sequence[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> str:
        """The rendered prompt text (tokenize must be False: chat_template.py tokenizes it
        piece by piece)."""
        if tokenize:
            raise ValueError("tokenize=True is not supported; tokenize the text yourself")
        source = chat_template or self.chat_template
        if source is None:
            raise ValueError("this model has no chat template")
        return str(_compile(source).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token))

    # ----- tokens ----------------------------------------------------------------------------
    def encode(self, text: str, *, add_bos: bool = False, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        if not data:
            return []
        capacity = len(data) + 8
        tokens = (self._lib.llama_token * capacity)()
        n = self._lib.llama_tokenize(self._vocab, data, len(data), tokens, capacity, add_bos,
                                     parse_special)
        if n < 0:  # more tokens than bytes + 8 (cannot happen with byte-level vocabularies)
            capacity = -n
            tokens = (self._lib.llama_token * capacity)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), tokens, capacity,
                                         add_bos, parse_special)
        return list(tokens[:n])

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (control tokens are empty unless special)."""
        key = (token, special)
        piece = self._pieces.get(key)
        if piece is None:
            n = self._lib.llama_token_to_piece(self._vocab, token, self._buffer,
                                               len(self._buffer), 0, special)
            if n < 0:  # longer than the buffer: grow it and ask again
                self._buffer = ctypes.create_string_buffer(-n)
                n = self._lib.llama_token_to_piece(self._vocab, token, self._buffer,
                                                   len(self._buffer), 0, special)
            piece = self._pieces[key] = self._buffer.raw[:n]
        return piece

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = b"".join(self.token_to_piece(int(t), not skip_special_tokens) for t in ids)
        return data.decode("utf-8", "replace")

    def is_end_of_generation(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    def end_of_generation_ids(self) -> set[int]:
        """Every token that ends a turn (EOS, EOT, <|im_end|>, ...), from the vocabulary."""
        return {t for t in range(self.n_vocab) if self.is_end_of_generation(t)}

    def _text(self, token: int | None) -> str:
        return self.token_to_piece(token, special=True).decode("utf-8", "replace") \
            if token is not None else ""


def _token_or_none(token: int) -> int | None:
    return token if token >= 0 else None


_compiled: dict[str, Any] = {}


def _compile(source: str) -> Any:
    """A chat template compiled in jinja2's immutable sandbox, with the helpers transformers
    offers templates (raise_exception, strftime_now, tojson)."""
    template = _compiled.get(source)
    if template is None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
                   sort_keys: bool = False) -> str:
            return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        template = _compiled[source] = env.from_string(source)
    return template
