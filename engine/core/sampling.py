"""Token sampling. Order: repetition penalty -> temperature -> top-k -> top-p -> min-p -> draw."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.errors import SamplingError
from engine.params import SamplingParams


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator: a fixed seed reproduces a sampled reply exactly."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def apply_repetition_penalty(
    logits: torch.Tensor, previous_ids: Sequence[int], penalty: float
) -> torch.Tensor:
    """CTRL-style penalty: shrink positive logits and grow negative ones of seen tokens."""
    if penalty == 1.0 or not previous_ids:
        return logits
    ids = torch.tensor(sorted(set(previous_ids)), device=logits.device)
    seen = logits.index_select(-1, ids)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.index_copy(-1, ids, seen)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (renormalised), float32."""
    # Shift by the max first: softmax is unchanged, and a tiny temperature cannot overflow
    # finite logits to +inf (inf - inf would turn into NaN probabilities).
    shifted = logits.float() - logits.float().max(dim=-1, keepdim=True).values
    scaled = shifted / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[..., -1, None]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest set whose mass reaches top_p: drop a token if the mass before it
        # already does. The most likely token is always kept.
        drop_sorted = (cumulative - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        floor = probs.max(dim=-1, keepdim=True).values * params.min_p
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def check_logits(logits: torch.Tensor) -> None:
    """Refuse logits no token can be honestly drawn from (a numerical fault upstream)."""
    if torch.isnan(logits).any():
        raise SamplingError("the model produced NaN logits; cannot pick a token")
    if torch.isposinf(logits).any():
        raise SamplingError("the model produced infinite logits (a numerical overflow); "
                            "cannot pick a token")
    if torch.isneginf(logits).all():
        raise SamplingError("every token has probability 0 (all logits are -inf)")


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    previous_ids: Sequence[int] = (),
) -> int:
    """Pick the next token id from a 1-D logits vector."""
    check_logits(logits)
    logits = apply_repetition_penalty(logits, previous_ids, params.repetition_penalty)
    check_logits(logits)  # an extreme penalty can overflow a logit
    if params.greedy:
        return int(torch.argmax(logits))
    probs = filtered_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def sampler_view(
    logits: torch.Tensor, params: SamplingParams, k: int = 12
) -> tuple[list[tuple[int, float]], int]:
    """Top-k candidates with probabilities after temperature, and how many survive filtering.

    For greedy decoding the probabilities are the plain softmax and only the argmax survives.
    """
    shifted = logits.float() - logits.float().max(dim=-1, keepdim=True).values
    scaled = shifted / (params.temperature if params.temperature > 0 else 1.0)
    probs = torch.softmax(scaled, dim=-1)
    top = torch.topk(probs, min(k, probs.shape[-1]))
    if params.greedy:
        kept = 1
    else:
        filtered = filtered_probs(logits, params)
        kept = int((filtered.index_select(-1, top.indices) > 0).sum())
    return [(int(i), float(p)) for i, p in zip(top.indices, top.values, strict=False)], kept
