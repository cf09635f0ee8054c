"""Per-request metrics, exactly as defined in docs/architecture.md ("Metric definitions").

Every input is a time.perf_counter_ns() stamp taken in the engine thread (the submit stamp is
taken by the caller, on the same monotonic clock). Nothing here reads a clock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.core.snapshots import Restored

NS = 1e-9


def now_ns() -> int:
    """The engine's clock: every timeline stamp comes from it (monotonic, in nanoseconds)."""
    return time.perf_counter_ns()


def percentiles(values: Sequence[float], qs: Sequence[float]) -> list[float]:
    """Linear-interpolated percentiles (numpy's default method) with one sort; 0.0 each for
    an empty list."""
    if not values:
        return [0.0 for _ in qs]
    ordered = sorted(values)
    out = []
    for q in qs:
        pos = (len(ordered) - 1) * q / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        out.append(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """One linear-interpolated percentile; 0.0 for an empty list."""
    return percentiles(values, (q,))[0]


@dataclass
class RequestTimeline:
    """Raw stamps of one request's life: submitted -> prefill -> tokens -> done."""

    submitted_ns: int
    prefill_start_ns: int = 0
    first_logits_ns: int = 0
    token_ns: list[int] = field(default_factory=list)
    done_ns: int = 0

    def itl_s(self) -> list[float]:
        """The gaps between consecutive tokens, in seconds."""
        return [(b - a) * NS for a, b in zip(self.token_ns, self.token_ns[1:], strict=False)]


@dataclass
class RequestMetrics:
    queue_s: float
    prefill_s: float
    ttft_s: float
    itl_s: list[float]
    tpot_s: float
    decode_s: float
    decode_tok_s: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    output_tokens: int
    parameters: int
    weight_bytes_per_step: int
    achieved_gb_s: float
    prefill_tflop_s: float
    itl_p50_s: float
    itl_p90_s: float
    itl_p99_s: float
    cache_miss_reason: str = "first_turn"
    # False when Stop ended the prefill before it read the whole prompt: prefilled_tokens then
    # counts what it read (kept in the cache), and prompt > cached + prefilled.
    prefill_complete: bool = True
    # False when a remote server did not report the count (the number above is then 0).
    prompt_tokens_known: bool = True
    cached_tokens_known: bool = True
    # The cached prefix read back from a snapshot on disk (0: none): tokens, bytes, seconds.
    restored_tokens: int = 0
    restored_bytes: int = 0
    restore_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute_metrics(
    tl: RequestTimeline,
    *,
    prompt_tokens: int,
    cached_tokens: int,
    parameters: int,
    weight_bytes_per_step: int,
    cache_miss_reason: str,
    prefilled_tokens: int | None = None,
    restored: Restored | None = None,
) -> RequestMetrics:
    """Turn a finished request's stamps into the metrics of docs/architecture.md.

    prefilled_tokens: the prompt tokens the prefill read (computed into the cache); None for
    all it was given (prompt - cached: a remote server's prefill, seen from the client). Fewer
    means Stop ended the prefill: its time then runs until the request ended."""
    n = len(tl.token_ns)
    prefill_start = tl.prefill_start_ns or tl.done_ns
    queue_s = (prefill_start - tl.submitted_ns) * NS
    # Without first logits (Stop while the prompt was read) the prefill ran until Stop was
    # honoured, which ended the request; never started, it took no time (done - done).
    prefill_s = ((tl.first_logits_ns or tl.done_ns) - prefill_start) * NS
    e2e_s = (tl.done_ns - tl.submitted_ns) * NS
    ttft_s = (tl.token_ns[0] - tl.submitted_ns) * NS if n else 0.0
    itl_s = tl.itl_s()
    decode_s = (tl.token_ns[-1] - tl.token_ns[0]) * NS if n > 1 else 0.0
    decode_tok_s = (n - 1) / decode_s if decode_s > 0 else 0.0
    tpot_s = (e2e_s - ttft_s) / (n - 1) if n > 1 else 0.0
    itl_p50, itl_p90, itl_p99 = percentiles(itl_s, (50, 90, 99))
    prefilled = prompt_tokens - cached_tokens if prefilled_tokens is None else prefilled_tokens
    complete = cached_tokens + prefilled >= prompt_tokens
    # A prefill Stop cut short has no rate: its time includes the chunk it threw away.
    prefill_tflop_s = (2 * parameters * prefilled / prefill_s / 1e12
                       if prefill_s > 0 and complete else 0.0)
    return RequestMetrics(
        queue_s=queue_s,
        prefill_s=prefill_s,
        ttft_s=ttft_s,
        itl_s=itl_s,
        tpot_s=tpot_s,
        decode_s=decode_s,
        decode_tok_s=decode_tok_s,
        e2e_s=e2e_s,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        prefilled_tokens=prefilled,
        output_tokens=n,
        parameters=parameters,
        weight_bytes_per_step=weight_bytes_per_step,
        achieved_gb_s=weight_bytes_per_step * decode_tok_s / 1e9,
        prefill_tflop_s=prefill_tflop_s,
        itl_p50_s=itl_p50,
        itl_p90_s=itl_p90,
        itl_p99_s=itl_p99,
        cache_miss_reason=cache_miss_reason,
        prefill_complete=complete,
        restored_tokens=restored.tokens if restored else 0,
        restored_bytes=restored.nbytes if restored else 0,
        restore_s=restored.seconds if restored else 0.0,
    )
