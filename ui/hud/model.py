"""The HUD's session model: pure Python, no Qt, testable headless.

It folds engine events into per-reply records and answers the questions the HUD panels ask
(breakdown, advisor, rolling throughput, percentiles, context forecast) and exports the
session. Every time comes from the engine's perf_counter_ns stamps; nothing here reads a clock.
The only UI-side stamp is painted_ns (same clock), used for render lag.
"""

from __future__ import annotations

import csv
import json
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from engine.events import (
    EngineEvent,
    GenerationResult,
    ModelInfo,
    ModelLoaded,
    PrefillStarted,
    RequestFailed,
    RequestFinished,
    RequestQueued,
    SamplerSnapshot,
    TokenEmitted,
)
from engine.metrics import NS, RequestMetrics, percentiles

DOMINANT_SHARE = 0.6  # a phase "owns" the time above this share of e2e
THROUGHPUT_WINDOW = 16  # tokens in the rolling decode tok/s window
# A max_tokens cap is advised only for a finished reply this long, when it saves this much:
# a live reply's length is not known yet, and a cap on a short reply saves nothing worth a knob.
MIN_TOKENS_FOR_CAP = 96
MIN_CAP_SAVING_S = 2.0
# Session-wide plot points kept (one per token, plus a gap between replies): 10,000 tokens of
# history fit; beyond that the oldest points drop, so memory and redraw cost stay bounded.
PLOT_HISTORY = 16_384


# ----- formatting --------------------------------------------------------------------------
def fmt_seconds(s: float) -> str:
    """Human seconds with a unit: '19 s', '1.5 s', '410 ms', '3.2 ms'."""
    if s >= 10:
        return f"{s:,.0f} s"
    if s >= 1:
        return f"{s:.1f} s"
    if s >= 0.01:
        return f"{s * 1000:.0f} ms"
    return f"{s * 1000:.1f} ms"


def fmt_eta(s: float) -> str:
    """Time left, as precise as it is useful: 'under 1 s', '42 s', '2 min 40 s' (10 s steps
    past a minute, so a rate that wobbles does not flicker the last digit), '14 min'."""
    if s < 1:
        return "under 1 s"
    if s < 60:
        return f"{s:.0f} s"
    if s < 600:
        minutes, seconds = divmod(round(s / 10) * 10, 60)
        return f"{minutes} min {seconds} s" if seconds else f"{minutes} min"
    return f"{round(s / 60)} min"


def fmt_ms(s: float) -> str:
    """Seconds shown as milliseconds with one decimal: '23.7 ms'."""
    return f"{s * 1000:.1f} ms"


def nice_cap(output_tokens: int) -> int:
    """A round max_tokens suggestion near a third of the reply (1,200 -> 400)."""
    target = max(output_tokens / 3, 1)
    magnitude = 10 ** math.floor(math.log10(target))
    return max(int(target // magnitude * magnitude), 1)


# ----- plot buffers -------------------------------------------------------------------------
class SeriesRing:
    """The latest `capacity` rows of a few float columns; O(1) append, O(1) read.

    Each row is stored twice (at slot i and i + capacity), so the latest rows are always one
    contiguous slice: a plot gets a numpy view, never a list rebuilt from the whole history.
    """

    def __init__(self, capacity: int, columns: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.appended = 0  # rows ever appended (the oldest drop beyond capacity)
        self._data = np.full((columns, 2 * capacity), np.nan)

    def append(self, *row: float) -> None:
        slot = self.appended % self.capacity
        self._data[:, slot] = row
        self._data[:, slot + self.capacity] = row
        self.appended += 1

    def __len__(self) -> int:
        return min(self.appended, self.capacity)

    @property
    def nbytes(self) -> int:
        return self._data.nbytes

    def view(self) -> np.ndarray:
        """(columns, rows) oldest first; a view into the buffer, valid until the next append."""
        start = self.appended % self.capacity if self.appended > self.capacity else 0
        return self._data[:, start:start + len(self)]


# ----- records -----------------------------------------------------------------------------
@dataclass
class Breakdown:
    """Where one reply's time went. queue + prefill + decode + other == e2e."""

    queue_s: float
    prefill_s: float
    decode_s: float
    e2e_s: float
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    final: bool  # False while the reply is still streaming (built from live stamps)
    prefill_cut: bool = False  # stopped (or failed) while its prompt was being read
    # Prompt tokens the prefill read (computed); None: all it was given (prompt - cached), or,
    # for a cut prefill saved before the engine counted it, not known.
    read_tokens: int | None = None
    restored_tokens: int = 0  # of the cached ones, read back from a snapshot on disk
    restore_s: float = 0.0
    forecast_ttft_s: float | None = None  # what the window forecast before it was sent
    cold_prefill_s: float | None = None  # the forecast of reading the whole prompt instead

    @property
    def other_s(self) -> float:
        """First-token sampling and wrap-up: what the three phases don't cover."""
        return max(self.e2e_s - self.queue_s - self.prefill_s - self.decode_s, 0.0)

    @property
    def decode_steps(self) -> int:
        return max(self.output_tokens - 1, 0)

    @property
    def has_first_token(self) -> bool:
        """False for a reply stopped (or failed) before its first token: no TTFT to show."""
        return self.output_tokens > 0

    @property
    def ms_per_token_s(self) -> float:
        """Seconds per decoded token (1 / decode tok/s)."""
        return self.decode_s / self.decode_steps if self.decode_steps else 0.0

    @property
    def new_tokens(self) -> int:
        """The prompt tokens not in the cache: what the prefill had to read."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def prefilled_tokens(self) -> int:
        """The prompt tokens the prefill read: all new ones, or those read before Stop."""
        return self.new_tokens if self.read_tokens is None else self.read_tokens

    def prefill_detail(self) -> str:
        """The prefill's tokens in words: "2,064 of 2,566 new prompt tokens read before
        Stop (80%), 0 cached" for a cut one, else "2,566 prompt tokens, 0 cached"."""
        if not self.prefill_cut:
            return (f"{self.prompt_tokens:,} prompt tokens, {self.cached_tokens:,} cached"
                    f"{self.restored_detail()}")
        if self.read_tokens is None:  # saved by an engine that did not count it
            return (f"stopped while reading {self.prompt_tokens:,} prompt tokens, "
                    f"{self.cached_tokens:,} cached")
        share = self.read_tokens / self.new_tokens if self.new_tokens else 1.0
        return (f"{self.read_tokens:,} of {self.new_tokens:,} new prompt tokens read before "
                f"Stop ({share:.0%}), {self.cached_tokens:,} cached")

    def restored_detail(self) -> str:
        """" (2,400 restored from disk in 210 ms)", or "" when nothing came from disk."""
        if not self.restored_tokens:
            return ""
        return f" ({self.restored_tokens:,} restored from disk in {fmt_ms(self.restore_s)})"

    def share(self, seconds: float) -> float:
        return seconds / self.e2e_s if self.e2e_s > 0 else 0.0

    def rows(self) -> list[tuple[str, str, float, float]]:
        """(phase, detail, seconds, share) in the seed's table form."""
        return [
            ("queue", "waiting for the engine", self.queue_s, self.share(self.queue_s)),
            ("prefill", self.prefill_detail(), self.prefill_s, self.share(self.prefill_s)),
            ("decode", f"{self.decode_steps:,} gaps after the first token x "
             f"{fmt_ms(self.ms_per_token_s)}" if self.has_first_token else "no first token",
             self.decode_s, self.share(self.decode_s)),
            ("other", "first sample + finish" if self.has_first_token else "finish",
             self.other_s, self.share(self.other_s)),
        ]

    @classmethod
    def from_metrics(cls, m: RequestMetrics) -> Breakdown:
        if not m.prefill_complete:  # the engine says what it read, and for how long
            return cls(m.queue_s, m.prefill_s, m.decode_s, m.e2e_s, m.ttft_s, m.prompt_tokens,
                       m.cached_tokens, m.output_tokens, final=True, prefill_cut=True,
                       read_tokens=m.prefilled_tokens)
        # Saved before the engine counted a stopped prefill: no first logits, no prefill
        # time, though the time after its queue was that prefill, cut short (not "first
        # sample + finish"); how much it read is not known.
        legacy = m.output_tokens == 0 and m.prefill_s == 0 and m.e2e_s > m.queue_s
        return cls(m.queue_s, m.e2e_s - m.queue_s if legacy else m.prefill_s, m.decode_s,
                   m.e2e_s, m.ttft_s, m.prompt_tokens, m.cached_tokens, m.output_tokens,
                   final=True, prefill_cut=legacy, restored_tokens=m.restored_tokens,
                   restore_s=m.restore_s)


@dataclass
class ReplyRecord:
    """Everything the HUD knows about one request, live or finished."""

    request_id: str
    number: int
    queued_ns: int
    settings: dict[str, object] = field(default_factory=dict)
    forecast_ttft_s: float | None = None  # the wait forecast shown when it was sent
    cold_prefill_s: float | None = None  # and of reading its whole prompt (nothing cached)
    prefill_ns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    miss_reason: str = ""
    token_ns: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    painted_ns: dict[int, int] = field(default_factory=dict)
    # Appended as events arrive so a redraw never rebuilds 10,000-token lists.
    live_itl_s: list[float] = field(default_factory=list)
    lag_indices: list[int] = field(default_factory=list)
    lags_s: list[float] = field(default_factory=list)
    snapshot: SamplerSnapshot | None = None
    metrics: RequestMetrics | None = None
    finish_reason: str = ""
    error: str = ""
    done_ns: int = 0
    result: GenerationResult | None = None  # the engine's own, once finished
    # A reply read back from a saved chat (history, not live): `number` is its turn in the
    # chat, `metrics` the saved engine-clock numbers (None when none were saved), and
    # `saved` what else was saved with it (message id, model, engine, kernel, ...);
    # finish_reason is then the status the chat saved (done, stopped, length, error).
    history: bool = False
    saved: dict[str, object] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return bool(self.finish_reason or self.error or self.history)

    @property
    def name(self) -> str:
        """"Reply #11" live, "Saved turn 3" for history."""
        return f"Saved turn {self.number}" if self.history else f"Reply #{self.number}"

    @property
    def prompt_known(self) -> bool:
        """False when a remote server did not report the prompt's (or cached) token count."""
        m = self.metrics
        return m is None or (m.prompt_tokens_known and m.cached_tokens_known)

    @property
    def output_tokens(self) -> int:
        return len(self.token_ns)

    @property
    def unread_tokens(self) -> int:
        """Prompt tokens a Stop inside the prefill left unread (0 for a whole prefill, or
        before the engine says)."""
        m = self.metrics
        if m is None or m.prefill_complete:
            return 0
        return m.prompt_tokens - m.cached_tokens - m.prefilled_tokens

    def itl_s(self) -> list[float]:
        """Gaps between emitted tokens: the engine's list once finished, live stamps before."""
        if self.metrics is not None:
            return self.metrics.itl_s
        return self.live_itl_s

    def itl_percentiles(self) -> tuple[float, float, float]:
        if self.metrics is not None:
            m = self.metrics
            return m.itl_p50_s, m.itl_p90_s, m.itl_p99_s
        p50, p90, p99 = percentiles(self.itl_s(), (50, 90, 99))
        return p50, p90, p99

    def render_lags_s(self) -> tuple[list[int], list[float]]:
        """(token indices, painted - emitted seconds) for tokens the view reported painting."""
        return self.lag_indices, self.lags_s

    def path_text(self) -> str:
        """Which decode path ran, and how speculation did: "" until the reply finishes."""
        r = self.result
        if r is None:
            engine, kernel = self.saved.get("engine"), self.saved.get("kernel")
            return f"{engine} engine, kernel {kernel}" if engine and kernel else ""
        parts = [f"{r.model.engine} engine, kernel {r.model.kernel}"] if r.model else []
        if r.speculative:
            parts.append(f"speculative ({r.speculative}): {r.spec_accepted:,} of "
                         f"{r.spec_proposed:,} drafted tokens accepted "
                         f"({r.spec_accept_rate:.0%})")
        return " · ".join(parts)

    def breakdown(self) -> Breakdown | None:
        if self.metrics is not None:
            b = Breakdown.from_metrics(self.metrics)
            b.forecast_ttft_s, b.cold_prefill_s = self.forecast_ttft_s, self.cold_prefill_s
            return b
        if not self.token_ns or not self.prefill_ns:
            return None
        # Live estimate from engine stamps; prefill here includes the first sample.
        queue_s = (self.prefill_ns - self.queued_ns) * NS
        ttft_s = (self.token_ns[0] - self.queued_ns) * NS
        decode_s = (self.token_ns[-1] - self.token_ns[0]) * NS
        return Breakdown(queue_s, ttft_s - queue_s, decode_s, ttft_s + decode_s, ttft_s,
                         self.prompt_tokens, self.cached_tokens, self.output_tokens, final=False)

    def context_used(self) -> int:
        """Tokens this reply leaves in the context: its prompt plus its output (a saved reply
        has no token stamps: its saved count)."""
        output = self.metrics.output_tokens if self.metrics is not None else self.output_tokens
        return self.prompt_tokens + output


@dataclass(frozen=True)
class ContextForecast:
    used: int
    length: int
    per_turn: float
    turns_left: int | None  # None when there is no pace yet

    @property
    def fraction(self) -> float:
        return self.used / self.length if self.length else 0.0

    def describe(self) -> str:
        head = f"{self.used:,} / {self.length:,} tokens ({self.fraction:.0%})"
        if self.turns_left is None:
            return head
        if self.turns_left <= 0:
            return f"{head}. The next turn will overflow the context."
        return (f"{head}. At ~{self.per_turn:,.0f} tokens a turn, about "
                f"{self.turns_left:,} more turn{'s' if self.turns_left != 1 else ''} fit.")


@dataclass(frozen=True)
class SettingMarker:
    """The settings changed between two replies (net of drags back and forth), at t_ns."""

    changes: dict[str, object]
    t_ns: int

    def label(self) -> str:
        """"temperature=1.1, max_tokens=256"."""
        return ", ".join(f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"
                         for name, value in self.changes.items())


_METRIC_FIELDS = {f.name for f in fields(RequestMetrics)}
_REQUIRED_METRICS = {f.name for f in fields(RequestMetrics)
                     if f.default is MISSING and f.default_factory is MISSING}


def saved_metrics(record: dict[str, object] | None) -> RequestMetrics | None:
    """A saved reply's metrics as the engine measured them (RequestMetrics.to_dict() plus
    where it ran); None when nothing, or too little, was saved: the HUD then shows "–"."""
    if not record or not record.keys() >= _REQUIRED_METRICS:
        return None
    values = {k: v for k, v in record.items() if k in _METRIC_FIELDS}
    return RequestMetrics(**values)  # type: ignore[arg-type]


def saved_request_id(message_id: int) -> str:
    """The HUD's id for saved message `message_id` (its picker entry, select_reply)."""
    return f"message-{message_id}"


def saved_reply(message_id: int, turn: int, status: str, metrics: dict[str, object] | None,
                settings: dict[str, object] | None) -> ReplyRecord:
    """One saved reply of a chat as a history record (turn-numbered, never live)."""
    m = saved_metrics(metrics)
    extra = {k: v for k, v in (metrics or {}).items() if k not in _METRIC_FIELDS}
    reply = ReplyRecord(saved_request_id(message_id), turn, 0, settings=dict(settings or {}),
                        metrics=m, finish_reason=status, history=True,
                        saved={"message_id": message_id, **extra})
    if m is not None:
        reply.prompt_tokens, reply.cached_tokens = m.prompt_tokens, m.cached_tokens
        reply.miss_reason = m.cache_miss_reason
    return reply


@dataclass
class SavedChat:
    """A chat's saved replies, read back from the database: its history in the HUD and what
    its export writes. Numbers are the saved engine-clock values, never recomputed."""

    chat_id: str
    title: str
    turns: list[ReplyRecord] = field(default_factory=list)

    def rows(self) -> list[dict[str, object]]:
        """One row per saved reply; a count the server did not report is blank, not 0."""
        rows = []
        for r in self.turns:
            row: dict[str, object] = {"chat": self.title, "turn": r.number,
                                      "status": r.finish_reason}  # as the chat saved it
            if r.metrics is not None:
                row.update({k: v for k, v in r.metrics.to_dict().items() if k != "itl_s"})
                if not r.metrics.prompt_tokens_known:
                    row.update(prompt_tokens="", prefilled_tokens="")
                if not r.metrics.cached_tokens_known:
                    row.update(cached_tokens="", prefilled_tokens="")
            row.update(r.saved)
            row.update({f"setting_{k}": v for k, v in r.settings.items()})
            rows.append(row)
        return rows

    def export_csv(self, path: str | Path) -> list[Path]:
        path = Path(path)
        _write_csv(path, self.rows())
        return [path]

    def export_json(self, path: str | Path) -> list[Path]:
        path = Path(path)
        replies = [dict(row, itl_s=r.metrics.itl_s if r.metrics is not None else None)
                   for r, row in zip(self.turns, self.rows(), strict=True)]
        data = {"chat": self.title, "chat_id": self.chat_id, "replies": replies}
        path.write_text(json.dumps(data, indent=1, default=str), "utf-8")
        return [path]


# ----- advisor -----------------------------------------------------------------------------
def advise(b: Breakdown | None) -> str:
    """One or two sentences: the dominant phase and its lever with a predicted saving.

    Empty when no phase owns at least DOMINANT_SHARE of the reply's time.
    """
    if b is None or b.e2e_s <= 0:
        return ""
    if b.prefill_cut:
        head = f"Stopped while reading the prompt, after {fmt_seconds(b.prefill_s)} of prefill"
        if b.read_tokens is None:
            return (f"{head} ({b.new_tokens:,} new prompt tokens, {b.cached_tokens:,} "
                    "cached): a shorter prompt, or one whose prefix is cached, answers sooner.")
        return (f"{head}: {b.prefill_detail()}. What it read stays in the prefix cache while "
                "there is room: Regenerate reads only the rest.")
    phases = {"queue": b.queue_s, "prefill": b.prefill_s, "decode": b.decode_s}
    phase, seconds = max(phases.items(), key=lambda kv: kv[1])
    share = b.share(seconds)
    told = " ".join(t for t in (_forecast_sentence(b), _restored_sentence(b)) if t)
    if share < DOMINANT_SHARE:
        return told
    advice = {"decode": _advise_decode, "prefill": _advise_prefill, "queue": _advise_queue}[
        phase
    ](b, share)
    return f"{told} {advice}" if told else advice


def _forecast_sentence(b: Breakdown) -> str:
    """The forecast set against what happened: "Forecast ~9.0 s to first token; it took
    8.4 s (x0.93 of the forecast)."."""
    if b.forecast_ttft_s is None or not b.has_first_token or b.forecast_ttft_s <= 0:
        return ""
    ratio = b.ttft_s / b.forecast_ttft_s
    return (f"Forecast ~{fmt_seconds(b.forecast_ttft_s)} to first token; it took "
            f"{fmt_seconds(b.ttft_s)} (x{ratio:.2f} of the forecast).")


def _restored_sentence(b: Breakdown) -> str:
    """What the snapshot on disk saved: "5,980 tokens restored from disk in 0.2 s; reading
    them would take ~48 s." The estimate is the window's forecast of reading the whole prompt
    (the session's fitted prefill cost along the prompt; left out where there was none): this
    reply's own few new tokens, read at the end of a long context, cost several times the
    average token of a cold read."""
    if not b.restored_tokens:
        return ""
    head = f"{b.restored_tokens:,} tokens restored from disk in {fmt_seconds(b.restore_s)}"
    if b.cold_prefill_s is None or b.cold_prefill_s <= 0:
        return f"{head}."
    return f"{head}; reading them would take ~{fmt_seconds(b.cold_prefill_s)}."


def _advise_decode(b: Breakdown, share: float) -> str:
    head = (f"Decode owns {share:.0%} ({b.output_tokens:,} tokens: {b.decode_steps:,} gaps x "
            f"{fmt_ms(b.ms_per_token_s)}).")
    perceived = f"streaming already makes the perceived wait {fmt_seconds(b.ttft_s)}."
    cap = nice_cap(b.output_tokens)
    saving = (b.output_tokens - cap) * b.ms_per_token_s
    if not b.final or b.output_tokens < MIN_TOKENS_FOR_CAP or saving < MIN_CAP_SAVING_S:
        return f"{head} Each token is one full read of the weights; {perceived}"
    return (f"{head} A cap of {cap:,} tokens would save about {fmt_seconds(saving)}; "
            f"{perceived}")


def _advise_prefill(b: Breakdown, share: float) -> str:
    read_s = b.prefill_s - b.restore_s  # a restore from disk is not reading
    per_token = read_s / b.prefilled_tokens if b.prefilled_tokens else 0.0
    head = (f"Prefill owns {share:.0%} ({b.prefilled_tokens:,} new prompt tokens x "
            f"{fmt_ms(per_token)}, {b.cached_tokens:,} cached).")
    half = b.prefilled_tokens // 2
    if half < 1:
        return head
    lever = ("Keeping the prompt's prefix cacheable (don't edit earlier messages)"
             if b.cached_tokens == 0 else "Shortening the prompt")
    return (f"{head} {lever} to skip {half:,} tokens would save about "
            f"{fmt_seconds(half * per_token)} of TTFT.")


def _advise_queue(b: Breakdown, share: float) -> str:
    work = b.e2e_s - b.queue_s
    return (f"Queueing owns {share:.0%} ({fmt_seconds(b.queue_s)} before prefill started). "
            f"Wait for the running reply or batch requests; this reply itself took "
            f"{fmt_seconds(work)}.")


# ----- session -----------------------------------------------------------------------------
class SessionModel:
    """All replies of a session, folded from engine events in arrival order."""

    def __init__(self, plot_history: int = PLOT_HISTORY) -> None:
        self.replies: dict[str, ReplyRecord] = {}
        self._order: list[ReplyRecord] = []  # replies in arrival order, for O(1) tail reads
        self.model: ModelInfo | None = None
        self.peaks: dict[str, object] | None = None  # calibrate.DevicePeaks as a dict
        self.settings: dict[str, object] = {}
        self.markers: list[SettingMarker] = []
        self.t0_ns: int | None = None
        # Session-wide rolling decode throughput: (session seconds, tok/s), one row per token
        # and a NaN row before each stretch of decoding, so idle time is never drawn as
        # throughput. Replies decoding at once (other chats, alternatives) share one stretch:
        # the rate is of all their tokens together, what the engine's batch delivers.
        self.throughput_ring = SeriesRing(plot_history, 2)
        self._stretch_ns: deque[int] = deque(maxlen=THROUGHPUT_WINDOW + 1)
        # The chat on screen: its saved replies are the per-turn panels' history, and its
        # live replies (by the chat and turn the window gave them) append to them.
        self.chat: SavedChat | None = None
        self._chat_of: dict[str, tuple[str, int]] = {}  # request id -> (chat id, turn)
        self._next_forecast: float | None = None
        self._next_cold: float | None = None

    def expect_ttft(self, seconds: float | None, cold_s: float | None = None) -> None:
        """The wait forecast of the message being sent (and of reading its whole prompt): the
        next reply keeps them, to set against its real time to first token."""
        self._next_forecast, self._next_cold = seconds, cold_s

    # -- folding events --
    def apply(self, event: EngineEvent) -> ReplyRecord | None:
        """Fold one event in; return the reply it touched (None for non-request events)."""
        t_ns = getattr(event, "t_ns", None)
        if t_ns is not None and self.t0_ns is None:
            self.t0_ns = t_ns
        if isinstance(event, ModelLoaded):
            self.model = event.info
            return None
        if isinstance(event, RequestQueued):
            return self._queued(event)
        rid = getattr(event, "request_id", None)
        reply = self.replies.get(rid) if rid is not None else None
        if reply is None:
            return None
        if isinstance(event, PrefillStarted):
            reply.prefill_ns = event.t_ns
            reply.prompt_tokens = event.prompt_tokens
            reply.cached_tokens = event.cached_tokens
            reply.miss_reason = event.cache_miss_reason
        elif isinstance(event, TokenEmitted):
            self._token(reply, event)
        elif isinstance(event, SamplerSnapshot):
            reply.snapshot = event
            reply.settings.update(temperature=event.temperature, top_p=event.top_p)
        elif isinstance(event, RequestFinished):
            self._finished(reply, event)
        elif isinstance(event, RequestFailed):
            reply.error = event.message
            reply.done_ns = event.t_ns
        return reply

    def _queued(self, event: RequestQueued) -> ReplyRecord:
        reply = ReplyRecord(event.request_id, len(self.replies) + 1, event.t_ns,
                            settings=dict(self.settings), forecast_ttft_s=self._next_forecast,
                            cold_prefill_s=self._next_cold)
        self._next_forecast = self._next_cold = None
        self.replies[event.request_id] = reply
        self._order.append(reply)
        return reply

    def _token(self, reply: ReplyRecord, event: TokenEmitted) -> None:
        reply.token_ns.append(event.t_ns)
        reply.token_ids.append(event.token_id)
        reply.token_texts.append(event.text)
        n = len(reply.token_ns)
        if n < 2:
            return
        reply.live_itl_s.append((event.t_ns - reply.token_ns[-2]) * NS)
        stretch = self._stretch_ns
        if n == 2 and not any(r is not reply and len(r.token_ns) > 1 and not r.done
                              for r in self.replies.values()):
            # Nothing else decodes: a new stretch, from this reply's first token.
            if stretch and self.throughput_ring.appended:
                self.throughput_ring.append(math.nan, math.nan)
            stretch.clear()
            stretch.append(reply.token_ns[0])
        stretch.append(event.t_ns)
        if len(stretch) > 1 and event.t_ns > stretch[0]:
            self.throughput_ring.append(self.session_s(event.t_ns),
                                        (len(stretch) - 1) / ((event.t_ns - stretch[0]) * NS))

    def _finished(self, reply: ReplyRecord, event: RequestFinished) -> None:
        result = event.result
        reply.metrics = result.metrics
        reply.finish_reason = result.finish_reason
        reply.done_ns = event.t_ns
        reply.result = result
        # The engine's numbers are authoritative; fill what PrefillStarted may have missed.
        reply.prompt_tokens = result.metrics.prompt_tokens
        reply.cached_tokens = result.metrics.cached_tokens
        reply.miss_reason = result.metrics.cache_miss_reason
        if result.model is not None:
            self.model = result.model

    def open_chat(self, chat: SavedChat | None) -> None:
        """Show this chat's saved replies as history (None: every reply of the session)."""
        self.chat = chat

    def assign(self, request_id: str, chat_id: str, turn: int) -> None:
        """Which chat and turn a live reply answers."""
        self._chat_of[request_id] = (chat_id, turn)

    def chat_of(self, request_id: str) -> tuple[str, int] | None:
        return self._chat_of.get(request_id)

    def record(self, request_id: str) -> ReplyRecord | None:
        """A live reply, or a saved one of the open chat."""
        reply = self.replies.get(request_id)
        if reply is None and self.chat is not None:
            reply = next((r for r in self.chat.turns if r.request_id == request_id), None)
        return reply

    def turn_rows(self, *, finished: bool = True) -> list[tuple[int, ReplyRecord]]:
        """(x, reply) for the per-turn panels, in order.

        Without an open chat: every reply of the session by its number (finished ones, or,
        with finished=False, those whose prompt is known). With one: the chat's saved replies
        by turn (all of them: one without numbers shows "–"), then its live replies by turn;
        a live reply replaces the saved one of its turn (a regenerated reply)."""
        live = [r for r in self.replies.values()
                if (r.metrics is not None if finished else r.prompt_tokens)]
        if self.chat is None:
            return [(r.number, r) for r in live]
        turn_of = self._live_turns()
        mine = [(turn_of[r.request_id], r) for r in live if r.request_id in turn_of]
        saved = [(r.number, r) for r in self.saved_turns()]
        return sorted(saved + mine, key=lambda row: row[0])

    def reply_name(self, reply: ReplyRecord) -> str:
        """How captions name a reply: "Saved turn 3", "Turn 4" (a live reply of the open
        chat, as the per-turn plots place it), else "Reply #11"."""
        chat = self._chat_of.get(reply.request_id)
        if reply.history or self.chat is None or chat is None or chat[0] != self.chat.chat_id:
            return reply.name
        return f"Turn {chat[1]}"

    def saved_turns(self) -> list[ReplyRecord]:
        """The open chat's saved replies whose turn has no live reply this session."""
        if self.chat is None:
            return []
        replaced = set(self._live_turns().values())
        return [r for r in self.chat.turns if r.number not in replaced]

    def _live_turns(self) -> dict[str, int]:
        """Request id -> turn of the open chat's live replies."""
        chat_id = self.chat.chat_id if self.chat is not None else None
        return {rid: turn for rid, (cid, turn) in self._chat_of.items()
                if cid == chat_id and rid in self.replies}

    def mark_setting(self, name: str, value: object, t_ns: int) -> SettingMarker | None:
        """Record a setting; return the marker of the gap since the latest reply, if any.

        Settings before the first reply are the starting state (restored at start-up), not
        changes: no marker. After it, every change until the next reply folds into one marker
        listing the net changes against the settings the latest reply used; changes that
        return to those values leave no marker.
        """
        self.settings[name] = value
        latest = self.latest()
        if latest is None:
            return None
        if self.t0_ns is None:
            self.t0_ns = t_ns
        same_gap = bool(self.markers) and self.markers[-1].t_ns >= latest.queued_ns
        previous = self.markers.pop() if same_gap else SettingMarker({}, t_ns)
        names = dict.fromkeys([*previous.changes, name])  # in the order they were changed
        changes = {k: self.settings[k] for k in names
                   if k not in latest.settings or latest.settings[k] != self.settings[k]}
        if not changes:
            return None
        marker = SettingMarker(changes, previous.t_ns)
        self.markers.append(marker)
        return marker

    def mark_painted(self, request_id: str, index: int, painted_ns: int) -> ReplyRecord | None:
        reply = self.replies.get(request_id)
        # The first paint is what the user saw; a token must be emitted before it's painted.
        if reply is None or index in reply.painted_ns or index >= len(reply.token_ns):
            return reply
        reply.painted_ns[index] = painted_ns
        reply.lag_indices.append(index)
        reply.lags_s.append((painted_ns - reply.token_ns[index]) * NS)
        return reply

    # -- queries --
    def session_s(self, t_ns: int) -> float:
        return (t_ns - (self.t0_ns or t_ns)) * NS

    def ordered(self) -> list[ReplyRecord]:
        return list(self._order)

    def replies_after(self, count: int) -> list[ReplyRecord]:
        """Replies after the first `count`, without copying the whole session."""
        return self._order[count:]

    def throughput_series(self) -> tuple[np.ndarray, np.ndarray]:
        """(session seconds, tok/s) of the kept history, NaN between replies.

        Copies of one contiguous slice (bounded by the ring's capacity, a memcpy): a plot may
        keep them while the ring moves on.
        """
        t, v = self.throughput_ring.view().copy()
        return t, v

    @property
    def throughput_t(self) -> list[float]:
        """Session seconds of each kept rolling-throughput point (no gaps)."""
        t, _v = self.throughput_series()
        kept: list[float] = t[np.isfinite(t)].tolist()
        return kept

    @property
    def throughput(self) -> list[float]:
        """Rolling decode tok/s of each kept point, matching throughput_t."""
        t, v = self.throughput_series()
        kept: list[float] = v[np.isfinite(t)].tolist()
        return kept

    def latest(self) -> ReplyRecord | None:
        return next(reversed(self.replies.values()), None) if self.replies else None

    def newest_of_chat(self) -> ReplyRecord | None:
        """The reply the HUD follows: the open chat's newest (live this session, else its last
        saved one), never another chat's; with no chat open, the session's newest."""
        if self.chat is None:
            return self.latest()
        live = self._live_turns()
        for reply in reversed(self._order):
            if reply.request_id in live:
                return reply
        saved = self.saved_turns()
        return saved[-1] if saved else None

    def finished(self) -> list[ReplyRecord]:
        return [r for r in self.replies.values() if r.metrics is not None]

    def turn_position(self, t_ns: int) -> float:
        """Where a setting change at t_ns falls on a per-turn axis (between turns): after the
        open chat's saved turns (they ran before it) and its live ones queued before t_ns."""
        if self.chat is None:
            return sum(1 for r in self.replies.values() if r.queued_ns <= t_ns) + 0.5
        before = [x for x, r in self.turn_rows(finished=False) + self.turn_rows()
                  if r.history or r.queued_ns <= t_ns]
        return max(before, default=0) + 0.5

    def ttfts(self) -> list[float]:
        """The session's finished replies' TTFTs; one stopped before its first token has none
        (its 0 would pull every percentile down)."""
        return [r.metrics.ttft_s for r in self.finished()
                if r.metrics is not None and r.metrics.output_tokens]

    def ttft_percentiles(self) -> tuple[float, float, float]:
        p50, p90, p99 = percentiles(self.ttfts(), (50, 90, 99))
        return p50, p90, p99

    def conversation(self) -> list[ReplyRecord]:
        """The turns the context gauge reads: the open chat's (saved, then live, as the per-turn
        panels place them); with no chat open, the session's latest run of turns (a
        'first_turn' cache miss starts a new one)."""
        if self.chat is not None:
            return [r for _x, r in self.turn_rows(finished=False) if r.prompt_tokens]
        turns: list[ReplyRecord] = []
        for reply in self.replies.values():
            if not reply.prompt_tokens:
                continue
            if reply.miss_reason == "first_turn":
                turns = []
            turns.append(reply)
        return turns

    def context_forecast(self) -> ContextForecast | None:
        if self.model is None:
            return None
        turns = self.conversation()
        length = self.model.context_length
        if not turns:
            return ContextForecast(0, length, 0.0, None)
        used = turns[-1].context_used()
        growth = (used - turns[0].context_used()) / (len(turns) - 1) if len(turns) > 1 else used
        if growth <= 0:
            return ContextForecast(used, length, 0.0, None)
        return ContextForecast(used, length, growth, int((length - used) // growth))

    # -- export --
    def reply_rows(self) -> list[dict[str, object]]:
        return [self._reply_row(r) for r in self.replies.values()]

    def _reply_row(self, r: ReplyRecord) -> dict[str, object]:
        row: dict[str, object] = {
            "request_id": r.request_id, "turn": r.number, "finish_reason": r.finish_reason,
            "error": r.error, "queued_s": self.session_s(r.queued_ns),
        }
        if r.metrics is not None:
            row.update({k: v for k, v in r.metrics.to_dict().items() if k != "itl_s"})
        else:
            row.update(prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                       output_tokens=r.output_tokens, cache_miss_reason=r.miss_reason)
        row.update(self._device_fields())
        if (result := r.result) is not None:  # finished: the path it ran on, and drafting
            if result.model:  # (the model may have been reloaded since)
                row.update(engine=result.model.engine, kernel=result.model.kernel)
            row.update(speculative=result.speculative or "",
                       spec_proposed=result.spec_proposed, spec_accepted=result.spec_accepted)
        row.update({f"setting_{k}": v for k, v in r.settings.items()})
        return row

    def token_rows(self) -> list[dict[str, object]]:
        rows = []
        for r in self.replies.values():
            itl = r.itl_s()
            for i, t in enumerate(r.token_ns):
                painted = r.painted_ns.get(i)
                rows.append({
                    "request_id": r.request_id, "index": i, "token_id": r.token_ids[i],
                    "text": r.token_texts[i], "emitted_s": self.session_s(t),
                    "itl_s": itl[i - 1] if 0 < i <= len(itl) else "",
                    "render_lag_s": (painted - t) * NS if painted is not None else "",
                })
        return rows

    def _device_fields(self) -> dict[str, object]:
        if self.model is None:
            return {}
        m = self.model
        return {"model": m.name, "engine": m.engine, "device": m.device, "dtype": m.dtype,
                "kernel": m.kernel,
                "context_length": m.context_length}

    def to_json_dict(self) -> dict[str, object]:
        tokens_by_reply: dict[str, list[dict[str, object]]] = {}
        for row in self.token_rows():
            tokens_by_reply.setdefault(str(row["request_id"]), []).append(row)
        replies = []
        for r, row in zip(self.replies.values(), self.reply_rows(), strict=True):
            row = dict(row, itl_s=r.itl_s(), tokens=tokens_by_reply.get(r.request_id, []))
            replies.append(row)
        return {
            "model": asdict(self.model) if self.model else None,
            "device_peaks": self.peaks,
            "settings": self.settings,
            "setting_changes": [
                {"name": name, "value": value, "t_s": self.session_s(m.t_ns)}
                for m in self.markers for name, value in m.changes.items()
            ],
            "replies": replies,
        }

    def export_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json_dict(), indent=1, default=str), "utf-8")
        return path

    def export_csv(self, path: str | Path) -> list[Path]:
        """Write replies to `path` and tokens to `<stem>-tokens.csv` beside it."""
        path = Path(path)
        tokens_path = path.with_name(f"{path.stem}-tokens{path.suffix or '.csv'}")
        _write_csv(path, self.reply_rows())
        _write_csv(tokens_path, self.token_rows())
        return [path, tokens_path]


def _write_csv(path: Path, rows: Iterable[dict[str, object]]) -> None:
    rows = list(rows)
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns), restval="")
        writer.writeheader()
        writer.writerows(rows)
