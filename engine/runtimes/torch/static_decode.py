"""Decode on a static KV cache with a step that can be compiled or captured in CUDA graphs.

The engine's default loop grows a DynamicCache, so every step has new shapes and new buffers:
fine in eager mode, but neither Inductor nor CUDA graphs can reuse a step like that. Here the
cache is preallocated (transformers' StaticCache, its length kept in a device tensor) and the
next token is written into a fixed input buffer on the device, so one step is the same graph
every time: `torch.compile(mode="reduce-overhead")` replays it as a CUDA graph on a GPU, and the
greedy choice never leaves the device until the caller asks for the tokens (no host sync per
step). On a CPU the same step compiles through Inductor; whether that wins is measured, not
assumed (benchmarks/static_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import StaticCache

COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune-no-cudagraphs")


@dataclass
class StaticRun:
    tokens: list[int]
    prefill_s: float
    decode_s: float  # from the first decode step to the last token on the host

    @property
    def decode_tok_s(self) -> float:
        steps = max(len(self.tokens) - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0


class StaticDecoder:
    """Greedy decode of one sequence on a StaticCache of max_len positions."""

    def __init__(self, model: torch.nn.Module, max_len: int, compile_mode: str = "none") -> None:
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}")
        self.model = model
        self.max_len = max_len
        self.device = next(model.parameters()).device
        self.cache = StaticCache(config=model.config,  # type: ignore[arg-type]  # nn.Module attr
                                 max_cache_len=max_len)
        self.token = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self._cuda_graphs = compile_mode == "reduce-overhead" and self.device.type == "cuda"
        if compile_mode == "none":
            self._step = self._forward_step
        else:
            self._step = torch.compile(self._forward_step, mode=compile_mode, fullgraph=True)

    def _forward_step(self, token: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=token, cache=self.cache, use_cache=True, logits_to_keep=1)
        chosen: torch.Tensor = out.logits[0, -1].argmax(-1)
        return chosen

    @torch.inference_mode()
    def reset(self) -> None:
        self.cache.reset()

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> None:
        """Eager prefill (shapes vary per prompt: not worth a graph); leaves the first token in
        the input buffer."""
        if len(prompt_ids) >= self.max_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit {self.max_len}")
        ids = torch.tensor([prompt_ids], device=self.device)
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1)
        self.token.copy_(out.logits[0, -1].argmax(-1).view(1, 1))

    @torch.inference_mode()
    def decode(self, steps: int) -> torch.Tensor:
        """Run `steps` steps after prefill; returns the steps + 1 greedy tokens on the device
        (the prefill's token first). Nothing here waits for the device."""
        out = torch.empty(steps + 1, dtype=torch.long, device=self.device)
        out[0] = self.token[0, 0]
        for i in range(steps):
            if self._cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            nxt = self._step(self.token)
            out[i + 1] = nxt  # copies out of the graph's output buffer before the next replay
            self.token.copy_(nxt.view(1, 1))
        return out

    def generate(self, prompt_ids: list[int], max_tokens: int) -> StaticRun:
        """Prefill then max_tokens - 1 decode steps; timed on the host with device syncs."""
        import time

        self.reset()
        start = time.perf_counter()
        self.prefill(prompt_ids)
        _sync(self.device)
        first = time.perf_counter()
        tokens = self.decode(max(max_tokens - 1, 0)).tolist()  # .tolist() waits for the device
        done = time.perf_counter()
        return StaticRun(tokens, first - start, done - first)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
