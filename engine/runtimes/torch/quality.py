"""Quality checks for fast decode paths: perplexity on a fixed text, greedy continuations.

A fast path (e.g. int8 weights) is acceptable when its greedy output matches the fp32
reference, or when its perplexity on a fixed text stays within a small relative tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

PERPLEXITY_TOLERANCE = 0.02  # a fast path may raise perplexity by at most 2% over fp32

REFERENCE_TEXT = (
    "The river rises in the hills to the north and runs south for two hundred miles before it "
    "reaches the sea. For most of its length it is slow and wide, and the towns along its banks "
    "grew up around the bridges and the mills. In the nineteenth century the railway followed "
    "the valley, and the old trade in wool and grain moved from the barges to the trains. Today "
    "the river is used mostly for fishing and boating, and a footpath runs beside it from the "
    "source to the estuary, passing farms, woods, villages and the ruins of a castle."
)


def reference_ids(tokenizer: Any, max_tokens: int = 256) -> list[int]:
    """The fixed reference text as token ids (no special tokens), at most max_tokens long."""
    return list(tokenizer(REFERENCE_TEXT, add_special_tokens=False)["input_ids"][:max_tokens])


@torch.inference_mode()
def perplexity(model: Any, ids: Sequence[int], device: torch.device | str = "cpu") -> float:
    """exp(mean next-token negative log-likelihood) of ids under model, one forward pass."""
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    input_ids = torch.tensor([list(ids)], device=device)
    logits = model(input_ids=input_ids, use_cache=False).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, input_ids[0, 1:], reduction="mean")
    return math.exp(nll.item())


def within_tolerance(candidate_ppl: float, reference_ppl: float,
                     tolerance: float = PERPLEXITY_TOLERANCE) -> bool:
    """True when the candidate's perplexity is at most `tolerance` (relative) above the
    reference's; a lower perplexity always passes."""
    return candidate_ppl <= reference_ppl * (1 + tolerance)


@torch.inference_mode()
def greedy_continuation(model: Any, prompt_ids: Sequence[int], new_tokens: int,
                        device: torch.device | str = "cpu") -> list[int]:
    """new_tokens greedy tokens after prompt_ids, through a plain DynamicCache loop."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    step = torch.tensor([list(prompt_ids)], device=device)
    out: list[int] = []
    for _ in range(new_tokens):
        logits = model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
        out.append(token)
        step = torch.tensor([[token]], device=device)
    return out
