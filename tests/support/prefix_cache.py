"""Prefix-cache helpers: what a prefill does to a lease (feed), and a model's logits computed on
a cached prefix against the same logits computed cold."""

from __future__ import annotations

from typing import Any

import torch

from engine.runtimes.torch.prefix_cache import PrefixCache


def feed(lease: Any, ids: list[int]) -> None:
    """What a prefill does to a lease: the tokens go into its cache and its ids."""
    values = torch.tensor(ids, dtype=torch.float32).reshape(1, 1, len(ids), 1)
    lease.cache.update(values, values.clone(), 0)
    lease.ids.extend(ids)


def cold_logits(model: Any, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1]


def cached_logits(model: Any, pool: PrefixCache, conv: str,
                  ids: list[int]) -> tuple[torch.Tensor, int]:
    """Logits of ids computed on top of whatever prefix the pool can lend; returns them and
    how many tokens came from cache. The computed cache goes back to the pool."""
    lease = pool.acquire(conv, ids)
    rest = ids[lease.cached_tokens :]
    out = model(input_ids=torch.tensor([rest]), cache=lease.cache, use_cache=True,
                logits_to_keep=1)
    lease.ids.extend(rest)
    pool.release(lease)
    return out.logits[0, -1], lease.cached_tokens


def assert_cached_matches_cold(loaded: Any, prompt: list[int], cut: int) -> None:
    model = loaded.model
    pool = PrefixCache(model.config, budget_bytes=1 << 34)
    other = prompt[:cut] + prompt[cut + 1 :][::-1]
    with torch.inference_mode():
        _, cached = cached_logits(model, pool, "a", prompt)
        assert cached == 0
        # regenerate: everything but the last token comes from cache
        warm, cached = cached_logits(model, pool, "a", prompt)
        assert cached == len(prompt) - 1
        assert torch.allclose(warm, cold_logits(model, prompt), atol=1e-4)
        # another chat sharing `cut` tokens: a cropped copy of chat a's cache
        warm, cached = cached_logits(model, pool, "b", other)
        assert cached == cut
        assert torch.allclose(warm, cold_logits(model, other), atol=1e-4)
