"""The decode batch's shared terms: how many rows, how a batch reports, where alternatives keep
their cache."""

from __future__ import annotations

from collections.abc import Callable

from engine.core.reply import ReplyJob
from engine.events import EngineEvent, GenerationResult

ALT_CACHE_SUFFIX = "~alt"  # prefix-cache key of alternative i >= 1: f"{conversation}~alt{i}"

Emit = Callable[[ReplyJob, EngineEvent], None]
Done = Callable[[ReplyJob, GenerationResult | None, BaseException | None], None]


def alternative_cache_key(conversation_id: str | None, index: int) -> str:
    """Where alternative `index` (>= 1) of a conversation's reply keeps its cached prefix;
    alternative 0 uses the conversation's own entry."""
    return f"{conversation_id}{ALT_CACHE_SUFFIX}{index}"
