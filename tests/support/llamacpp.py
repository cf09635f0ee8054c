"""Helpers for the bodies that run llama.cpp in a child process (tests/support/child.py): the
bundled GGUF loaded, a chat's token ids, a prompt decoded alone with its logit margins."""

from __future__ import annotations

from typing import Any

from engine.runtimes import LLAMA_CPP


def load_default() -> Any:
    """The bundled default GGUF on llama.cpp (in the child)."""
    from engine.runtimes import load

    return load("default", LLAMA_CPP)


def chat_ids(loaded: Any, text: str) -> list[int]:
    from engine.core.chat_template import encode_chat
    from engine.params import ChatMessage

    return encode_chat(loaded.tokenizer, [ChatMessage("user", text)])


NEAR_TIE = 0.05  # logits: closer than this, summation order alone can pick either token


def alone_with_margins(loaded: Any, pool: Any, ids: list[int], n: int) -> tuple[list, list]:
    """Greedy tokens of one prompt decoded alone, and each step's top-2 logit margin."""
    import torch

    from engine.runtimes.llamacpp.decode import feed

    lease = pool.cold_lease(None)
    tokens, margins = [], []
    feed(loaded, pool, lease, ids)
    for _ in range(n):
        top = torch.topk(loaded.logits(1)[0], 2)
        tokens.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        feed(loaded, pool, lease, [tokens[-1]])
    pool.discard(lease)
    return tokens, margins


def agree_until_near_tie(batched: list[int], alone: list[int], margins: list[float]) -> bool:
    """Batched output equals alone up to the first near-tie (after it, either is right)."""
    for got, want, margin in zip(batched, alone, margins, strict=True):
        if margin < NEAR_TIE:
            return True
        if got != want:
            return False
    return True
