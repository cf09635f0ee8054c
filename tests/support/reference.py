"""Greedy decoding the long way, the reference the decode loop and the batcher are checked
against: the whole sequence through the model for every token, no cache."""

from __future__ import annotations

import torch

from engine.runtimes.torch.loader import LoadedModel


def reference_greedy(loaded: LoadedModel, prompt: list[int], n: int,
                     penalty: float = 1.0) -> list[int]:
    """Greedy decoding the long way: the whole sequence through the model for each token, the
    CTRL repetition penalty applied by hand to every token seen so far."""
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            logits = loaded.model(input_ids=torch.tensor([ids])).logits[0, -1].clone()
            for t in set(ids):
                value = float(logits[t])
                logits[t] = value / penalty if value > 0 else value * penalty
            out.append(int(torch.argmax(logits)))
            ids.append(out[-1])
    return out
