"""The HUD's nine panels. Each is a card with a title, one pyqtgraph plot, a hover readout and
a caption, and redraws from the session model only when the HUD's throttle timer asks.

Panels only read ui.hud.model; they never compute timings from a UI clock.
"""

from __future__ import annotations

import html
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, QObject, QPointF, Qt, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QToolButton, QVBoxLayout

from engine.events import SamplerSnapshot
from engine.metrics import RequestMetrics, percentiles
from engine.tools.calibrate import DevicePeaks, roof
from engine.tools.speed import ModelSpeed
from ui.hud import style
from ui.hud.live_label import LiveLabel
from ui.hud.model import (
    THROUGHPUT_WINDOW,
    Breakdown,
    ReplyRecord,
    SessionModel,
    fmt_ms,
    fmt_seconds,
)
from ui.session import PromptReading

MAX_TURNS_SHOWN = 40  # per-turn bar plots show the latest turns only
MARKER_LABEL_GAP_PX = 8  # a marker label shows only if it clears the next one by this much
HISTORY_ALPHA = 90  # saved replies (history) are drawn faded beside live ones
MARKER_LABEL_FILL_ALPHA = 225  # a marker label's backing: bars behind it show faintly
WAITING = "Waiting for a reply."  # a caption before there is anything to describe
LABEL_GAP_PX = 6  # between the ITL plot's percentile labels
NO_HOVER = " "  # the readout's resting text (keeps its line's height)
SAMPLER_ROWS = 10
BAR_WIDTH = 0.62  # a turn's slot on the per-turn bar plots
SHARED_BAR_FILL = 0.8  # of a bar's share of a slot it shares: a gap tells the bars apart
DASH = Qt.PenStyle.DashLine


@dataclass
class HudContext:
    """What every panel redraws from."""

    model: SessionModel
    reply: ReplyRecord | None  # the selected (or live) reply
    peaks: DevicePeaks | None
    text_interval_s: float = 0.0  # the chat view paints streaming text this often (batches)
    prefill: PromptReading | None = None  # the reply's latest, while its prompt is read
    speed: ModelSpeed | None = None  # the reply's model's predicted speed here (engine/speed)


def prefill_caption(reading: PromptReading) -> str:
    """"reading the prompt: 42% (840 / 2,000 tokens) at 420 tok/s, 3 s left" (the time left
    as the session said it)."""
    p = reading.progress
    text = (f"reading the prompt: {p.fraction:.0%} ({p.done_tokens:,} / {p.total_tokens:,} "
            f"tokens) at {p.tok_s:,.0f} tok/s")
    return text + (f", {reading.left}" if reading.left else "")


_CONTROL_TOKEN = re.compile(r"^<\|?([A-Za-z0-9_./-]+)\|?>$")  # <|im_end|>, <s>, </s> ...
_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def short_token(text: str, limit: int = 10) -> str:
    """A token as a readable label: visible whitespace, escaped control chars, clipped.

    Control tokens read as ⟨im_end⟩; a byte token (part of a multi-byte character, which
    decodes alone to U+FFFD) shows its byte, <0xE2>, when the engine sent it that way, and
    "<byte>" when all that arrived is the replacement character.
    """
    if _BYTE_TOKEN.match(text):
        return text.upper().replace("0X", "0x")
    control = _CONTROL_TOKEN.match(text)
    if control:
        shown = f"⟨{control.group(1)}⟩"
    elif "\ufffd" in text:
        shown = text.replace("\ufffd", "<byte>").replace(" ", "·")
    else:
        shown = repr(text)[1:-1].replace(" ", "·") or "∅"
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


class Panel(QFrame):
    """A card: title row (with a hide button), plot, hover readout, caption."""

    sig_hide_requested = Signal(str)
    """The user clicked the card's hide button; carries the panel key."""

    key = ""
    title = ""
    plot_height = 150

    def __init__(self) -> None:
        super().__init__()
        self.setObjectName("hudCard")
        self.plot = style.make_plot(self.plot_height)
        self.readout = self._live_label("hudReadout", NO_HOVER)
        self.caption = self._live_label("hudCaption", WAITING)
        layout = self._column = QVBoxLayout(self)
        layout.setContentsMargins(10, 8, 10, 8)
        layout.setSpacing(4)
        layout.addLayout(self._header())
        layout.addWidget(self.plot)
        layout.addWidget(self.readout)
        layout.addWidget(self.caption)
        self._markers: list[tuple[float, str, pg.InfiniteLine]] = []
        self.plot.scene().sigMouseMoved.connect(self._on_mouse_moved)
        self.plot.viewport().installEventFilter(self)  # the pointer leaving clears the readout
        vb = self.plot.getPlotItem().vb  # labels are laid out in pixels: redo it as the view moves
        vb.sigXRangeChanged.connect(self._relayout_markers)
        vb.sigResized.connect(self._relayout_markers)

    def _label(self, name: str, text: str) -> QLabel:
        label = QLabel(text)
        label.setObjectName(name)
        label.setWordWrap(True)
        return label

    @staticmethod
    def _live_label(name: str, text: str) -> LiveLabel:
        label = LiveLabel(text, word_wrap=True)
        label.setObjectName(name)
        return label

    def _header(self) -> QHBoxLayout:
        row = QHBoxLayout()
        title = self._label("hudTitle", self.title)
        hide = QToolButton()
        hide.setObjectName("hudHide")
        hide.setText("✕")
        hide.setToolTip(f"Hide “{self.title}” (Panels menu brings it back)")
        hide.clicked.connect(lambda: self.sig_hide_requested.emit(self.key))
        hide.setFocusPolicy(Qt.FocusPolicy.NoFocus)  # by keyboard: the HUD's Panels menu
        row.addWidget(title, 1)
        row.addWidget(hide)
        return row

    # ----- to override -----
    def refresh(self, ctx: HudContext) -> None:
        raise NotImplementedError

    def hover_text(self, x: float, y: float) -> str | None:
        """The readout for the data nearest to view point (x, y); None for nothing."""
        return None

    # ----- shared -----
    def set_markers(self, markers: Sequence[tuple[float, str]]) -> None:
        """The settings-change markers (x, label), oldest first: the plot's one marker layer.

        Unchanged markers keep their items; labels that would overlap are hidden by
        layout_markers (the line stays, the newest label wins).
        """
        if [(x, text) for x, text, _ in self._markers] == list(markers):
            return
        for _x, _text, line in self._markers:
            self.plot.removeItem(line)
        self._markers = []
        for x, text in markers:
            line = pg.InfiniteLine(
                pos=x, angle=90, pen=style.pen(style.MARKER, 1, DASH), label=text,
                labelOpts={"position": 0.95, "color": style.MARKER,
                           "anchors": [(1, 0), (1, 0)],
                           # backed by the plot's colour: readable where it crosses a bar
                           "fill": style.brush(style.CARD, MARKER_LABEL_FILL_ALPHA)},
            )
            self.plot.addItem(line, ignoreBounds=True)
            self._markers.append((x, text, line))
        self.layout_markers()

    def layout_markers(self) -> None:
        """Show a marker's label only where it clears the newer one's and the plot's left
        edge (labels sit left of their line), so changes close together on the axis never
        smear into each other. The newest is always labelled, right of its line if need be;
        hovering a line reads out any marker's changes."""
        left_edge = math.inf  # the left end of the newest label shown so far, in pixels
        plot_width = self._plot_width()
        for n, (x, _text, line) in enumerate(reversed(self._markers)):
            px, width = self._marker_px(x), line.label.boundingRect().width()
            anchor = (0, 0) if n == 0 and px < width else (1, 0)
            line.label.anchors = [anchor, anchor]
            line.label.setAnchor(anchor)
            left = px if anchor == (0, 0) else px - width
            on_plot = 0 <= px <= plot_width  # a line out of view labels nothing (clipped)
            shown = on_plot and (n == 0 or (px <= left_edge - MARKER_LABEL_GAP_PX and left >= 0))
            line.label.setVisible(shown)
            if shown:
                left_edge = left

    def _relayout_markers(self, *_args: object) -> None:
        if self._markers:
            self.layout_markers()

    def _plot_width(self) -> float:
        return self.plot.getPlotItem().vb.width() or self.plot.width()

    def _marker_px(self, x: float) -> float:
        """A view x as pixels from the plot area's left edge."""
        (x0, x1), width = self.plot.getPlotItem().vb.viewRange()[0], self._plot_width()
        return (x - x0) * width / (x1 - x0) if x1 > x0 else 0.0

    def marker_text(self, x: float) -> str | None:
        """The settings change whose line is within a few pixels of view x, if any."""
        px = self._marker_px(x)
        near = [(abs(self._marker_px(mx) - px), text) for mx, text, _line in self._markers]
        best = min(near, default=None)
        return f"settings changed: {best[1]}" if best and best[0] <= 4 else None

    def marker_labels(self) -> list[str]:
        return [text for _x, text, _line in self._markers]

    def visible_marker_labels(self) -> list[str]:
        return [text for _x, text, line in self._markers if line.label.isVisible()]

    def _on_mouse_moved(self, pos: QPointF) -> None:
        vb = self.plot.getPlotItem().vb
        text = None
        if vb.sceneBoundingRect().contains(pos):
            point = vb.mapSceneToView(pos)
            text = self.marker_text(point.x()) or self.hover_text(point.x(), point.y())
        self.readout.setText(text or NO_HOVER)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.Leave:
            self.readout.setText(NO_HOVER)
        return False


def key_html(pairs: list[tuple[str, str]]) -> str:
    """A one-line colour key for a caption: ■ name ■ name."""
    return " &nbsp;".join(f"<span style='color:{color}'>■</span> {name}" for name, color in pairs)


def turn_axis(plot: pg.PlotWidget, values: list[int], most: int = 12) -> None:
    """A per-turn axis: whole-number ticks (no 1.5, 2.5), thinned when there are many, over
    the turns' slots (turn 1's alone when there are none yet), so a settings marker between
    turns stays in view and no other chat's range lingers."""
    values = list(dict.fromkeys(values))  # a turn with several replies is one tick
    step = max(1, math.ceil(len(values) / most))
    plot.getPlotItem().getAxis("bottom").setTicks([[(v, str(v)) for v in values[::step]]])
    plot.setXRange(min(values, default=1) - 0.5, max(values, default=1) + 0.5, padding=0.02)


def bar_brushes(rows: Sequence[tuple[int, ReplyRecord]], color: str) -> list[object]:
    """One brush per bar: faded for a saved reply (history), full for a live one."""
    return [style.brush(color, HISTORY_ALPHA if r.history else 255) for _x, r in rows]


def turn_slots(rows: Sequence[tuple[int, ReplyRecord]]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's bar centre and width on a per-turn axis: the replies of one turn (attempts
    of a regenerated or edited turn, a set of alternatives) share its slot side by side, in
    order, so none hides another behind it."""
    per_turn = Counter(turn for turn, _r in rows)
    placed: Counter[int] = Counter()
    centres, widths = [], []
    for turn, _r in rows:
        width = BAR_WIDTH / per_turn[turn]
        centres.append(turn - BAR_WIDTH / 2 + width * (placed[turn] + 0.5))
        widths.append(width if per_turn[turn] == 1 else width * SHARED_BAR_FILL)
        placed[turn] += 1
    return np.array(centres, dtype=float), np.array(widths, dtype=float)


def history_key(rows: Sequence[tuple[int, ReplyRecord]]) -> str:
    """The caption's note when saved replies are drawn (faded)."""
    return " &nbsp;faded: saved (history)" if any(r.history for _x, r in rows) else ""


SYMBOLS_UP_TO = 400  # beyond this, per-point symbols cost more than they show
NICE_STEPS = (1.0, 2.0, 3.0, 5.0, 10.0)


def nice_ceiling(value: float) -> float:
    """The round number at or above value (1, 2, 3, 5 x 10^k); 1 for nothing.

    Live plots snap their ranges to these, so an axis (ticks, text, grid: the costliest
    paint, about 5 ms a time) is redrawn a few times per reply instead of at every redraw:
    8 times over a 256-token reply's token axis.
    """
    if not math.isfinite(value) or value <= 0:
        return 1.0
    magnitude = 10.0 ** math.floor(math.log10(value))
    return next(step * magnitude for step in NICE_STEPS if step * magnitude >= value * (1 - 1e-9))


def snap_range(plot: pg.PlotWidget, *, x_to: float | None = None, y_to: float | None = None,
               x_from: float = 0.0) -> None:
    """Set the x and/or y range from x_from (or 0) to the nice ceiling of a data maximum."""
    if x_to is not None:
        plot.setXRange(x_from, nice_ceiling(x_to), padding=0.02)
    if y_to is not None:
        plot.setYRange(0, nice_ceiling(y_to), padding=0)


def fast_curve(plot: pg.PlotWidget, color: str) -> pg.PlotDataItem:
    """A per-token curve that stays cheap at 10,000 points: clipped and peak-downsampled."""
    curve = plot.plot([], [], pen=style.pen(color, 1), symbolPen=None,
                      symbolBrush=style.brush(color), symbolSize=3)
    curve.setClipToView(True)
    curve.setDownsampling(auto=True, method="peak")
    return curve


def set_points(curve: pg.PlotDataItem, x: np.ndarray, y: np.ndarray, *,
               join_dots: bool = True) -> None:
    """Dots while there are few points (joined or not), a plain line once there are many."""
    few = len(x) <= SYMBOLS_UP_TO
    curve.setSymbol("o" if few else None)
    if not join_dots:
        curve.setPen(None if few else curve.opts["symbolBrush"].color())
    curve.setData(x, y)


def _nearest(xs: Sequence[float] | np.ndarray, x: float) -> int | None:
    if len(xs) == 0:
        return None
    return int(np.argmin(np.abs(np.asarray(xs, dtype=float) - x)))


# ----- 1. TTFT per turn ----------------------------------------------------------------------
class TtftPanel(Panel):
    key, title = "ttft", "Time to first token, per turn"

    def __init__(self) -> None:
        super().__init__()
        style.axis_label(self.plot, "left", "TTFT", "s")
        style.axis_label(self.plot, "bottom", "turn")
        self._bars = {
            phase: pg.BarGraphItem(x=[], height=[], width=BAR_WIDTH, brush=style.brush(color),
                                   pen=style.pen(color, 0))
            for phase, color in (("queue", style.QUEUE), ("prefill", style.PREFILL),
                                 ("first", style.OTHER))
        }
        for bar in self._bars.values():
            self.plot.addItem(bar)
        self._cached = pg.ScatterPlotItem(symbol="t1", size=7, brush=style.brush(style.CACHED),
                                          pen=None)
        self.plot.addItem(self._cached)
        self._rows: list[tuple[int, ReplyRecord]] = []  # (turn, reply); history included
        self._x = np.zeros(0)  # each row's bar centre (turn_slots)

    def refresh(self, ctx: HudContext) -> None:
        self._rows = ctx.model.turn_rows()[-MAX_TURNS_SHOWN:]
        self._x, widths = turn_slots(self._rows)
        # A reply without numbers ("–") or without a first token (stopped before it: no
        # TTFT) has no bar; its hover says why.
        shown = [i for i, (_x, r) in enumerate(self._rows)
                 if r.metrics is not None and r.metrics.output_tokens]
        drawn = [self._rows[i] for i in shown]
        x, width = self._x[shown], widths[shown]
        m = [_metrics(r) for _x, r in drawn]
        queue = np.array([mm.queue_s for mm in m])
        prefill = np.array([mm.prefill_s for mm in m])
        first = np.array([max(mm.ttft_s - mm.queue_s - mm.prefill_s, 0.0) for mm in m])
        colors = {"queue": style.QUEUE, "prefill": style.PREFILL, "first": style.OTHER}
        for (key, height), y0 in zip((("queue", queue), ("prefill", prefill), ("first", first)),
                                     (np.zeros_like(queue), queue, queue + prefill), strict=True):
            self._bars[key].setOpts(x=x, width=width, height=height, y0=y0,
                                    brushes=bar_brushes(drawn, colors[key]))
        ttft = queue + prefill + first
        # Cached share of the prompt drawn as a marker at that fraction of the bar's height;
        # none where the server did not report the counts.
        known = [i for i, (_x, r) in enumerate(drawn) if r.prompt_known]
        share = np.array([m[i].cached_tokens / m[i].prompt_tokens if m[i].prompt_tokens
                          else 0.0 for i in known])
        self._cached.setData(x=x[known], y=ttft[known] * share)
        turn_axis(self.plot, [turn for turn, _r in self._rows])
        if not m:
            self.caption.setText(self._live_caption(ctx.model, ctx.reply))
            return
        if ctx.model.chat is None:
            p50, p90, p99 = ctx.model.ttft_percentiles()
            scope = "Session"
        else:
            p50, p90, p99 = percentiles([mm.ttft_s for mm in m], (50, 90, 99))
            scope = "This chat's"
        self.caption.setText(
            key_html([("queue", style.QUEUE), ("prefill", style.PREFILL),
                      ("first sample", style.OTHER), ("▲ cached share", style.CACHED)])
            + history_key(self._rows)
            + f"<br>{scope} TTFT p50 {fmt_seconds(p50)} · p90 {fmt_seconds(p90)} · "
            f"p99 {fmt_seconds(p99)}."
        )

    @staticmethod
    def _live_caption(model: SessionModel, reply: ReplyRecord | None) -> str:
        """Before any reply (of the open chat) has a TTFT: the live reply's once its first
        token is out; until then no numbers (another chat's would be stale). A finished reply
        stopped before its first token has none to give."""
        b = reply.breakdown() if reply is not None else None
        if reply is not None and b is not None and b.final and not b.has_first_token:
            what = "while reading the prompt" if b.prefill_cut else "before its first token"
            return f"{model.reply_name(reply)}: stopped {what}, so no TTFT."
        if reply is None or b is None or not b.has_first_token:
            return WAITING
        return (f"{model.reply_name(reply)}: TTFT {fmt_seconds(b.ttft_s)} (live); "
                "its bar appears when the reply finishes.")

    def hover_text(self, x: float, y: float) -> str | None:
        i = _nearest(self._x, x)
        if i is None:
            return None
        turn, r = self._rows[i]
        m = r.metrics
        saved = " (saved)" if r.history else ""
        if m is None:
            return f"turn {turn}{saved}: TTFT – (no numbers were saved with this reply)"
        if not m.output_tokens:
            return f"turn {turn}{saved}: stopped before its first token (no TTFT)"
        cached = (f"{m.cached_tokens:,}/{m.prompt_tokens:,}" if r.prompt_known else "–")
        return (f"turn {turn}{saved}: TTFT {fmt_seconds(m.ttft_s)} = queue "
                f"{fmt_seconds(m.queue_s)} + prefill {fmt_seconds(m.prefill_s)}; {cached} "
                "prompt tokens cached")


# ----- 2. ITL of the live (or selected) reply ------------------------------------------------
class ItlPanel(Panel):
    key, title = "itl", "Inter-token latency"

    def __init__(self) -> None:
        super().__init__()
        style.axis_label(self.plot, "left", "ITL", "s")
        style.axis_label(self.plot, "bottom", "token")
        self._curve = fast_curve(self.plot, style.DECODE)
        self._lines = {}
        for name, color, at in (("p50", style.P50, 0.9), ("p90", style.P90, 0.6),
                                ("p99", style.P99, 0.3)):  # laid out in pixels on refresh
            line = pg.InfiniteLine(angle=0, pen=style.pen(color, 1, DASH), label=name,
                                   labelOpts={"position": at, "color": color,
                                              "anchors": [(0.5, 1), (0.5, 1)]})
            line.setVisible(False)
            self.plot.addItem(line, ignoreBounds=True)
            self._lines[name] = line
        self._itl: list[float] = []
        vb = self.plot.getPlotItem().vb
        vb.sigResized.connect(self._layout_percentile_labels)
        vb.sigYRangeChanged.connect(self._layout_percentile_labels)

    def refresh(self, ctx: HudContext) -> None:
        reply = ctx.reply
        self._itl = reply.itl_s() if reply else []
        itl = np.asarray(self._itl, dtype=float)
        set_points(self._curve, np.arange(1, len(itl) + 1), itl)
        if reply is None or not len(itl):
            for line in self._lines.values():
                line.setVisible(False)
            if reply is not None and reply.history:
                self.caption.setText(f"{reply.name} (saved): ITL – (no token gaps were saved "
                                     "with this reply).")
            elif reply is not None and reply.done:  # not the previous reply's caption
                tokens = reply.metrics.output_tokens if reply.metrics else reply.output_tokens
                why = "stopped before its first token" if not tokens else "a single token"
                self.caption.setText(f"{ctx.model.reply_name(reply)}: ITL – ({why}, no gaps "
                                     "between tokens).")
            return
        pcts = reply.itl_percentiles()
        # From zero, so a flat ITL looks flat: the point decode's physics makes.
        snap_range(self.plot, x_to=max(len(itl), 10), y_to=max(float(itl.max()), pcts[2]) * 1.15)
        for (name, line), value in zip(self._lines.items(), pcts, strict=True):
            line.setPos(value)
            line.setVisible(True)  # first: a hidden label ignores a new format (kept "p50")
            text = f"{name} {fmt_ms(value)}"
            if line.label.format != text:  # re-laying out the same text costs a repaint
                line.label.setFormat(text)
        self._layout_percentile_labels()
        state = "saved" if reply.history else "live" if not reply.done else "finished"
        tokens = reply.metrics.output_tokens if reply.metrics else reply.output_tokens
        self.caption.setText(
            f"{ctx.model.reply_name(reply)} ({state}): {tokens:,} tokens, "
            f"{len(self._itl):,} gaps between them · p50 {fmt_ms(pcts[0])} · p90 "
            f"{fmt_ms(pcts[1])} · p99 {fmt_ms(pcts[2])}. " + burst_note(reply))

    def _layout_percentile_labels(self, *_args: object) -> None:
        """Close percentiles put their lines close, never their labels on each other: the
        p50, p90 and p99 labels sit side by side from the right edge (p50 rightmost) where
        the plot is wide enough, else stacked at the right edge, p99 on top, each pushed down
        just clear of the one above."""
        vb = self.plot.getPlotItem().vb
        width = vb.width()
        labels = [line.label for line in self._lines.values()]
        if width <= 0:
            return
        widths = [label.boundingRect().width() for label in labels]
        if sum(widths) + LABEL_GAP_PX * (len(labels) + 1) <= width:
            right = width - LABEL_GAP_PX
            for label, label_width in zip(labels, widths, strict=True):
                self._place_label(label, (right - label_width / 2) / width, 1.0)
                right -= label_width + LABEL_GAP_PX
            return
        x = (width - LABEL_GAP_PX - max(widths) / 2) / width
        top = vb.sceneBoundingRect().top()  # the previous label's bottom, in scene pixels
        for label in reversed(labels):  # p99, p90, p50: highest line first
            height = label.boundingRect().height()
            line_y = vb.mapViewToScene(QPointF(0, label.line.value())).y()
            bottom = max(line_y, top + height)  # above its line unless that overlaps
            self._place_label(label, x, 1 - (bottom - line_y) / height)
            top = bottom + LABEL_GAP_PX / 2

    @staticmethod
    def _place_label(label: pg.InfLineLabel, position: float, anchor_y: float) -> None:
        """Centre the label at `position` along its line, its bottom anchor_y heights above
        the line (1: just above it; below 1: lower)."""
        anchor = (0.5, anchor_y)
        label.anchors = [anchor, anchor]
        label.setAnchor(anchor)
        label.setPosition(position)

    def percentile_label_rects(self) -> list[object]:
        """The shown percentile labels' scene rectangles (QRectF), p50 first."""
        return [line.label.sceneBoundingRect() for line in self._lines.values()
                if line.isVisible()]

    def hover_text(self, x: float, y: float) -> str | None:
        i = _nearest(np.arange(1, len(self._itl) + 1), x)
        if i is None:
            return None
        return f"token {i + 1}: {fmt_ms(self._itl[i])} after token {i}"


def burst_note(reply: ReplyRecord) -> str:
    """Why ITL looks the way it does: flat per token, or bursty with speculation."""
    method = reply.result.speculative if reply.result is not None else None
    if method:
        return (f"Speculative decoding ({method}): tokens arrive in accepted bursts, so most "
                "gaps are near zero and ITL p50 understates the time per token; compare "
                "decode tok/s instead.")
    return "Decode is one weight read per token, so ITL stays flat."


# ----- 3. Throughput over time ---------------------------------------------------------------
class ThroughputPanel(Panel):
    key, title = "throughput", "Decode throughput over time"

    def __init__(self) -> None:
        super().__init__()
        style.axis_label(self.plot, "left", "decode", "tok/s")
        style.axis_label(self.plot, "bottom", "session time", "s")
        self._curve = self.plot.plot([], [], pen=style.pen(style.DECODE, 1),
                                     connect="finite")
        self._curve.setDownsampling(auto=True, method="peak")
        self._means = pg.ScatterPlotItem(symbol="d", size=8, brush=style.brush(style.P90),
                                         pen=None)
        self.plot.addItem(self._means)
        self._t = np.empty(0)
        self._v = np.empty(0)

    def refresh(self, ctx: HudContext) -> None:
        model = ctx.model
        # From the model's bounded ring (NaN between replies breaks the line, so idle time
        # isn't drawn as throughput): no per-redraw work grows past the ring's capacity.
        self._t, self._v = model.throughput_series()
        self._curve.setData(self._t, self._v)
        if len(self._t):
            first, last = float(np.nanmin(self._t)), float(np.nanmax(self._t))
            x_from = 0.0
            if model.throughput_ring.appended > model.throughput_ring.capacity:
                step = nice_ceiling(last - first) / 10  # the oldest points dropped: snap too
                x_from = math.floor(first / step) * step
            snap_range(self.plot, x_to=last, y_to=np.nanmax(self._v) * 1.15, x_from=x_from)
        done = model.finished()
        # A reply stopped before its first token decoded nothing: no mean, not a 0 tok/s one.
        rated = [r for r in done if _metrics(r).output_tokens]
        if len(rated) != len(self._means.data):  # reply means change only when one finishes
            self._means.setData(x=[model.session_s(r.done_ns) for r in rated],
                                y=[_metrics(r).decode_tok_s for r in rated])
        if done and not _metrics(done[-1]).output_tokens:
            self.caption.setText(f"Rolling over {THROUGHPUT_WINDOW} tokens of all replies; "
                                 "◆ = reply mean. "
                                 "Last reply: stopped before its first token, no decode.")
        elif done:
            m = _metrics(done[-1])
            self.caption.setText(
                f"Rolling over {THROUGHPUT_WINDOW} tokens of all replies; ◆ = reply mean. "
                "Last reply "
                f"{m.decode_tok_s:,.1f} tok/s over {m.output_tokens:,} tokens "
                f"({max(m.output_tokens - 1, 0):,} gaps; TTFT excluded)."
            )
        elif np.isfinite(self._v).any():  # the first reply is still streaming
            live = float(self._v[np.isfinite(self._v)][-1])
            self.caption.setText(f"Rolling over {THROUGHPUT_WINDOW} tokens of all replies: "
                                 f"{live:,.1f} tok/s "
                                 "now (live); ◆ marks each finished reply's mean.")
        elif (saved := saved_rates(model)):  # only history: it has no place on this clock
            self.caption.setText(saved)

    def hover_text(self, x: float, y: float) -> str | None:
        finite = np.isfinite(self._t)
        if not finite.any():
            return None
        ts, vs = self._t[finite], self._v[finite]
        i = _nearest(ts, x)
        return None if i is None else f"t = {ts[i]:.2f} s: {vs[i]:,.1f} tok/s"


SAVED_RATES_SHOWN = 8


def saved_rates(model: SessionModel) -> str:
    """The open chat's saved decode rates, per turn ("–" where none was saved): saved replies
    ran on another session's clock, so they are listed, not plotted against session time."""
    turns = model.chat.turns if model.chat is not None else []
    if not turns:
        return ""
    shown = [f"turn {r.number}: " + (f"{r.metrics.decode_tok_s:,.1f}"
                                      if r.metrics is not None and r.metrics.decode_tok_s
                                      else "–")
             for r in turns[-SAVED_RATES_SHOWN:]]
    return "Saved (history), decode tok/s: " + " · ".join(shown) + "."


# ----- 4. Where the time went ----------------------------------------------------------------
class BreakdownPanel(Panel):
    key, title = "breakdown", "Where the time went"
    plot_height = 46

    def __init__(self) -> None:
        super().__init__()
        item = self.plot.getPlotItem()
        item.hideAxis("left")
        item.showGrid(x=False, y=False)
        style.axis_label(self.plot, "bottom", "", "s")
        self._bars = {
            phase: pg.BarGraphItem(x0=[0], y=[0], width=[0], height=0.8, brush=style.brush(c),
                                   pen=style.pen(c, 0))
            for phase, c in style.PHASE_COLORS.items()
        }
        # While a prompt is read: the prefill still to come at its rate so far, faded.
        self._prefill_left = pg.BarGraphItem(
            x0=[0], y=[0], width=[0], height=0.8, brush=style.brush(style.PREFILL, 70),
            pen=style.pen(style.PREFILL, 1, DASH))
        for bar in (*self._bars.values(), self._prefill_left):
            self.plot.addItem(bar)
        self.table = LiveLabel(word_wrap=True)
        self._column.insertWidget(2, self.table)
        self._breakdown: Breakdown | None = None

    def refresh(self, ctx: HudContext) -> None:
        b = ctx.reply.breakdown() if ctx.reply else None
        self._breakdown = b
        self._prefill_left.setOpts(width=[0])
        if b is None and ctx.reply is not None and ctx.prefill is not None:
            self._draw_prefill(ctx.model, ctx.reply, ctx.prefill)
        if b is None and ctx.reply is not None and ctx.reply.history:
            for bar in self._bars.values():
                bar.setOpts(width=[0])
            self.table.setText("")
            self.caption.setText(f"{ctx.reply.name}: – (no numbers were saved with it).")
        if b is None:
            return
        start = 0.0
        for phase, _detail, seconds, _share in b.rows():
            self._bars[phase].setOpts(x0=[start], width=[seconds])
            start += seconds
        # Live, the axis snaps to round steps (cheap repaints); final, it fits the reply.
        end = max(b.e2e_s, 1e-6) if b.final else nice_ceiling(b.e2e_s)
        self.plot.setXRange(0, end, padding=0.01)
        self.plot.setYRange(-0.5, 0.5, padding=0)
        self.table.setText(self._table_html(b))
        reply = ctx.reply
        assert reply is not None  # it gave the breakdown
        state = "e2e (saved)" if reply.history else "e2e" if b.final else "so far (live)"
        path = reply.path_text()
        ttft = fmt_seconds(b.ttft_s) if b.has_first_token else "– (stopped before a token)"
        self.caption.setText(f"{ctx.model.reply_name(reply)}: {fmt_seconds(b.e2e_s)} {state}; "
                             f"TTFT {ttft}." + (f" {path}." if path else ""))

    def _draw_prefill(self, model: SessionModel, reply: ReplyRecord,
                      reading: PromptReading) -> None:
        """Queue, the prefill so far and (faded) what is left of it, before the first token."""
        queue_s = max(reply.prefill_ns - reply.queued_ns, 0) * 1e-9
        so_far_s = max(reading.progress.t_ns - reply.prefill_ns, 0) * 1e-9
        self._bars["queue"].setOpts(x0=[0], width=[queue_s])
        self._bars["prefill"].setOpts(x0=[queue_s], width=[so_far_s])
        self._bars["decode"].setOpts(x0=[0], width=[0])
        self._bars["other"].setOpts(x0=[0], width=[0])
        left_s = reading.left_s or 0.0  # None: not known yet, no bar rather than a guess
        self._prefill_left.setOpts(x0=[queue_s + so_far_s], width=[left_s])
        self.plot.setXRange(0, nice_ceiling(queue_s + so_far_s + left_s), padding=0.01)
        self.plot.setYRange(-0.5, 0.5, padding=0)
        self.table.setText("")
        self.caption.setText(f"{model.reply_name(reply)}: {prefill_caption(reading)}")

    @staticmethod
    def _table_html(b: Breakdown) -> str:
        rows = []
        for phase, detail, seconds, share in b.rows():
            color = style.PHASE_COLORS[phase]
            rows.append(
                f"<tr><td><span style='color:{color}'>■</span> {phase}</td>"
                f"<td style='color:{style.MUTED}'>{detail}</td>"
                f"<td align='right'>{seconds:.3f} s</td>"
                f"<td align='right'>{share:.0%}</td></tr>"
            )
        return ("<table width='100%' cellspacing='0' cellpadding='2' style='font-size:8.5pt'>"
                + "".join(rows) + "</table>")

    def hover_text(self, x: float, y: float) -> str | None:
        if self._breakdown is None:
            return None
        start = 0.0
        for phase, detail, seconds, share in self._breakdown.rows():
            if start <= x <= start + seconds:
                return f"{phase}: {fmt_seconds(seconds)} ({share:.0%}) · {detail}"
            start += seconds
        return None


# ----- 5. Cache ledger -----------------------------------------------------------------------
class CachePanel(Panel):
    key, title = "cache", "Prefix cache ledger"

    def __init__(self) -> None:
        super().__init__()
        style.axis_label(self.plot, "left", "prompt", "tokens")
        style.axis_label(self.plot, "bottom", "turn")
        self._reused = pg.BarGraphItem(x=[], height=[], width=BAR_WIDTH,
                                       brush=style.brush(style.CACHED), pen=None)
        self._recomputed = pg.BarGraphItem(x=[], height=[], width=BAR_WIDTH,
                                           brush=style.brush(style.RECOMPUTED), pen=None)
        # Faint: the prompt tokens a Stop inside the prefill left unread.
        self._unread = pg.BarGraphItem(x=[], height=[], width=BAR_WIDTH,
                                       brush=style.brush(style.RECOMPUTED, 60), pen=None)
        self.plot.addItem(self._reused)
        self.plot.addItem(self._recomputed)
        self.plot.addItem(self._unread)
        self.plot.getPlotItem().getAxis("left").enableAutoSIPrefix(False)
        self._rows: list[tuple[int, ReplyRecord]] = []  # (turn, reply); history included
        self._x = np.zeros(0)  # each row's bar centre (turn_slots)

    def refresh(self, ctx: HudContext) -> None:
        self._rows = ctx.model.turn_rows(finished=False)[-MAX_TURNS_SHOWN:]
        self._x, widths = turn_slots(self._rows)
        shown = [i for i, (_x, r) in enumerate(self._rows) if r.prompt_tokens and r.prompt_known]
        drawn = [self._rows[i] for i in shown]
        x, width = self._x[shown], widths[shown]
        reused = np.array([r.cached_tokens for _x, r in drawn], dtype=float)
        unread = np.array([r.unread_tokens for _x, r in drawn], dtype=float)
        fresh = np.array([r.prompt_tokens - r.cached_tokens for _x, r in drawn],
                         dtype=float) - unread
        self._reused.setOpts(x=x, width=width, height=reused, y0=np.zeros_like(reused),
                             brushes=bar_brushes(drawn, style.CACHED))
        self._recomputed.setOpts(x=x, width=width, height=fresh, y0=reused,
                                 brushes=bar_brushes(drawn, style.RECOMPUTED))
        self._unread.setOpts(x=x, width=width, height=unread, y0=reused + fresh)
        turn_axis(self.plot, [turn for turn, _r in self._rows])
        self.caption.setText(
            key_html([("reused", style.CACHED), ("recomputed", style.RECOMPUTED)])
            + history_key(self._rows) + "<br>" + self._describe(*self._rows[-1])
            if self._rows else WAITING)

    @staticmethod
    def _describe(turn: int, r: ReplyRecord) -> str:
        saved = " (saved)" if r.history else ""
        if not r.prompt_tokens or not r.prompt_known:
            return f"Turn {turn}{saved}: – (the prompt's token counts were not reported)."
        reason = r.miss_reason.replace("_", " ")
        why = "full hit" if r.miss_reason == "none" else f"miss: {reason}"
        unread = r.unread_tokens
        cut = f", {unread:,} not read (stopped)" if unread else ""
        return (f"Turn {turn}{saved}: {r.cached_tokens:,} reused, "
                f"{r.prompt_tokens - r.cached_tokens - unread:,} recomputed{cut} ({why}).")

    def hover_text(self, x: float, y: float) -> str | None:
        i = _nearest(self._x, x)
        return None if i is None else self._describe(*self._rows[i])


# ----- 6. Context gauge ----------------------------------------------------------------------
class ContextPanel(Panel):
    key, title = "context", "Context window"
    plot_height = 46

    def __init__(self) -> None:
        super().__init__()
        item = self.plot.getPlotItem()
        item.hideAxis("left")
        item.showGrid(x=False, y=False)
        item.getAxis("bottom").enableAutoSIPrefix(False)
        style.axis_label(self.plot, "bottom", "", "tokens")
        self._track = pg.BarGraphItem(x0=[0], y=[0], width=[1], height=0.7,
                                      brush=style.brush(style.BORDER), pen=None)
        self._used = pg.BarGraphItem(x0=[0], y=[0], width=[0], height=0.7,
                                     brush=style.brush(style.DECODE), pen=None)
        self._next = pg.BarGraphItem(x0=[0], y=[0], width=[0], height=0.7,
                                     brush=style.brush(style.DECODE, 70), pen=None)
        for bar in (self._track, self._next, self._used):
            self.plot.addItem(bar)
        self._text = ""

    def refresh(self, ctx: HudContext) -> None:
        forecast = ctx.model.context_forecast()
        if forecast is None:
            return
        used, length = forecast.used, forecast.length
        self._track.setOpts(width=[length])
        self._used.setOpts(width=[used])
        self._next.setOpts(x0=[used], width=[min(forecast.per_turn, max(length - used, 0))])
        self._used.setOpts(brush=style.brush(style.CHOSEN if forecast.fraction > 0.85
                                             else style.DECODE))
        self.plot.setXRange(0, length, padding=0.01)
        self.plot.setYRange(-0.5, 0.5, padding=0)
        self._text = forecast.describe()
        self.caption.setText(self._text + " Faint segment: the next turn at this pace.")

    def hover_text(self, x: float, y: float) -> str | None:
        return self._text or None


# ----- 7. Roofline ---------------------------------------------------------------------------
class RooflinePanel(Panel):
    key, title = "roofline", "Roofline"

    def __init__(self) -> None:
        super().__init__()
        item = self.plot.getPlotItem()
        item.setLogMode(x=True, y=True)
        style.axis_label(self.plot, "left", "TFLOP/s")
        style.axis_label(self.plot, "bottom", "arithmetic intensity", "FLOP/byte")
        item.getAxis("bottom").enableAutoSIPrefix(False)
        item.getAxis("left").enableAutoSIPrefix(False)
        self._roof = self.plot.plot([], [], pen=style.pen(style.MUTED, 1.5))
        self._points = pg.ScatterPlotItem(size=10, pen=None)
        self.plot.addItem(self._points)
        self._info: list[tuple[float, float, str]] = []

    def refresh(self, ctx: HudContext) -> None:
        reply = ctx.reply if ctx.reply and ctx.reply.metrics else None
        if reply is None:
            done = ctx.model.finished()
            reply = done[-1] if done else None
        if reply is None or reply.metrics is None or ctx.peaks is None:
            if ctx.peaks is not None:
                self.caption.setText(ctx.peaks.describe())
            return
        m = reply.metrics
        # Every figure drawn raises the ceiling it is drawn against: none reads over 100%.
        seen = [r.metrics for r in ctx.model.finished() if r.metrics is not None and not r.history]
        peaks = roof(ctx.peaks, [(x.achieved_gb_s, x.prefill_tflop_s) for x in [*seen, m]])
        self._info = []
        decode_ai = 2 * m.parameters / max(m.weight_bytes_per_step, 1)
        decode_tflop = 2 * m.parameters * m.decode_tok_s / 1e12
        if decode_tflop > 0:
            self._info.append((decode_ai, decode_tflop,
                               f"decode: {m.achieved_gb_s:,.1f} GB/s of {peaks.bandwidth_gb_s:,.0f}"
                               f" ({m.achieved_gb_s / peaks.bandwidth_gb_s:.0%} of peak)"))
        if m.prefill_tflop_s > 0:
            prefill_ai = decode_ai * m.prefilled_tokens
            self._info.append((prefill_ai, m.prefill_tflop_s,
                               f"prefill: {m.prefill_tflop_s:,.3f} TFLOP/s of "
                               f"{peaks.tflop_s:,.3f} ({m.prefill_tflop_s / peaks.tflop_s:.0%})"))
        self._draw_roof(peaks, max((a for a, _, _ in self._info), default=1.0))
        colors = [style.DECODE, style.PREFILL][: len(self._info)]
        self._points.setData(x=[math.log10(a) for a, _, _ in self._info],
                             y=[math.log10(t) for _, t, _ in self._info],
                             brush=[style.brush(c) for c in colors])
        self.caption.setText(
            key_html([("decode", style.DECODE), ("prefill", style.PREFILL),
                      ("roof", style.MUTED)])
            + "<br>" + " · ".join(text for _, _, text in self._info)
            + ". " + html.escape(peaks.how_measured())
            + (f"<br>{html.escape(line)}" if ctx.speed and (line := predicted_line(ctx.speed, m))
               else ""))
        self.caption.setToolTip(peaks.how_measured())

    def _draw_roof(self, peaks: DevicePeaks, widest_ai: float) -> None:
        ridge = peaks.tflop_s * 1e12 / (peaks.bandwidth_gb_s * 1e9)  # FLOP/byte at the knee
        # Far enough right for the knee and for every point (a long prompt's prefill sits
        # at thousands of FLOP/byte).
        top = math.ceil(math.log10(max(ridge * 100, 1e4, widest_ai * 2)))
        ai = np.logspace(-1, top, 64)
        self._roof.setData(ai, np.minimum(peaks.tflop_s, ai * peaks.bandwidth_gb_s / 1e3))
        # Whole decades on both axes keep log tick labels readable.
        peak = math.log10(peaks.tflop_s)
        self.plot.setXRange(-1, top, padding=0.02)
        self.plot.setYRange(math.floor(peak) - 4, math.ceil(peak) + 0.3, padding=0)

    def hover_text(self, x: float, y: float) -> str | None:
        i = _nearest([math.log10(a) for a, _, _ in self._info], x)
        return None if i is None else self._info[i][2]


def predicted_line(speed: ModelSpeed, m: RequestMetrics) -> str:
    """This reply against the speed predicted for its model here: 'Predicted here: decode ~118
    tok/s, this reply 121 (x1.03); its prompt (300 tokens read) ~0.8 s, took 0.7 s (x0.88).'"""
    parts = []
    decode = speed.prediction().decode_tok_s
    if m.decode_tok_s > 0:
        parts.append(f"decode ~{decode:,.0f} tok/s, this reply {m.decode_tok_s:,.0f} "
                     f"(x{m.decode_tok_s / decode:.2f})")
    if m.prefill_complete and m.prefilled_tokens > 0 and m.prefill_s > 0:
        seconds = speed.prompt_s(m.cached_tokens + m.prefilled_tokens, m.cached_tokens)
        took = m.prefill_s - m.restore_s
        parts.append(f"its prompt ({m.prefilled_tokens:,} tokens read) ~{seconds:.2f} s, "
                     f"took {took:.2f} s (x{took / seconds:.2f})")
    return ("Predicted on this computer (from its one measurement): " + "; ".join(parts)
            + ".") if parts else ""


# ----- 8. Sampler view -----------------------------------------------------------------------
class SamplerPanel(Panel):
    key, title = "sampler", "Sampler: what temperature and top-p do"
    plot_height = 190

    def __init__(self) -> None:
        super().__init__()
        item = self.plot.getPlotItem()
        style.axis_label(self.plot, "bottom", "probability after temperature")
        item.getAxis("bottom").enableAutoSIPrefix(False)
        item.getAxis("left").setWidth(78)
        item.invertY(True)
        self._bars = pg.BarGraphItem(x0=[], y=[], width=[], height=0.72, pen=None)
        self.plot.addItem(self._bars)
        self._cut = pg.InfiniteLine(angle=0, pen=style.pen(style.CHOSEN, 1.2, DASH),
                                    label="filter cut",
                                    labelOpts={"position": 0.85, "color": style.CHOSEN})
        self._cut.setVisible(False)
        self.plot.addItem(self._cut, ignoreBounds=True)
        self.snapshot_index: int | None = None
        self._rows: list[tuple[int, str, float]] = []

    def refresh(self, ctx: HudContext) -> None:
        snap = ctx.reply.snapshot if ctx.reply else None
        if snap is None:
            if ctx.reply is not None and ctx.reply.history:
                self._rows = []
                self._bars.setOpts(x0=[], y=[], width=[], brushes=[])
                self._cut.setVisible(False)
                self.caption.setText(f"{ctx.reply.name}: sampler snapshots are not saved.")
            return
        self.snapshot_index = snap.index
        self._rows = list(snap.candidates[:SAMPLER_ROWS])
        colors = [self._color(i, tid, snap.kept, snap.chosen_id)
                  for i, (tid, _text, _p) in enumerate(self._rows)]
        ys = np.arange(len(self._rows))
        self._bars.setOpts(x0=np.zeros(len(ys)), y=ys, width=[p for _, _, p in self._rows],
                           brushes=[style.brush(c) for c in colors])
        self.plot.getPlotItem().getAxis("left").setTicks(
            [[(i, short_token(text)) for i, (_, text, _) in enumerate(self._rows)]]
        )
        self.plot.setYRange(-0.6, max(len(ys), SAMPLER_ROWS) - 0.4, padding=0)
        self.plot.setXRange(0, max((p for _, _, p in self._rows), default=1.0), padding=0.05)
        self._cut.setPos(snap.kept - 0.5)
        self._cut.setVisible(snap.kept < len(self._rows))
        self.caption.setText(self._describe(snap))

    @staticmethod
    def _color(i: int, token_id: int, kept: int, chosen: int) -> str:
        if token_id == chosen:
            return style.CHOSEN
        return style.KEPT if i < kept else style.CUT

    def _describe(self, snap: SamplerSnapshot) -> str:
        chosen = next(((t, p) for tid, t, p in snap.candidates if tid == snap.chosen_id), None)
        drew = (f"drew “{short_token(chosen[0], 16)}” (p = {chosen[1]:.2f})" if chosen
                else "drew a token outside the top list")
        # kept counts what top-k, top-p and min-p leave together, not top-p alone.
        mode = "greedy (temperature 0)" if snap.temperature == 0 else (
            f"temperature {snap.temperature:.2f}, top-p {snap.top_p:.2f}; top-k, top-p and "
            f"min-p together keep {snap.kept} of these {len(snap.candidates)}")
        return f"Token {snap.index}: {mode}; {drew}. Red = drawn, grey = cut."

    def hover_text(self, x: float, y: float) -> str | None:
        i = round(y)
        if not 0 <= i < len(self._rows):
            return None
        _tid, text, p = self._rows[i]
        return f"“{short_token(text, 24)}”: p = {p:.4f} after temperature"


# ----- 9. Render lag -------------------------------------------------------------------------
class RenderLagPanel(Panel):
    key, title = "render", "Render lag (engine → screen)"

    def __init__(self) -> None:
        super().__init__()
        style.axis_label(self.plot, "left", "lag", "s")
        style.axis_label(self.plot, "bottom", "token")
        self._curve = fast_curve(self.plot, style.MARKER)
        self._itl = pg.InfiniteLine(angle=0, pen=style.pen(style.P50, 1, DASH),
                                    label="ITL p50", labelOpts={"position": 0.9,
                                                                "color": style.P50})
        self._itl.setVisible(False)
        self.plot.addItem(self._itl, ignoreBounds=True)
        self.indices: list[int] = []
        self.lags_s: list[float] = []

    def refresh(self, ctx: HudContext) -> None:
        reply = ctx.reply
        if reply is None:
            return
        self.indices, self.lags_s = reply.render_lags_s()
        set_points(self._curve, np.asarray(self.indices, float), np.asarray(self.lags_s),
                   join_dots=False)
        itl_p50 = reply.itl_percentiles()[0]
        self._itl.setPos(itl_p50)
        self._itl.setVisible(itl_p50 > 0)
        if not self.lags_s:
            self.caption.setText("Render lag is not saved with a reply." if reply.history
                                 else "No painted tokens reported for this reply yet.")
            return
        # From zero and up to the ITL line, so lag reads against the engine's token gap.
        snap_range(self.plot, x_to=max(max(self.indices), 10),
                   y_to=max(max(self.lags_s), itl_p50) * 1.15)
        p50, p99 = percentiles(self.lags_s, (50, 99))
        # Text is painted in batches, so a token waits up to one batch interval by design;
        # the UI falls behind only when lag exceeds that plus one token gap.
        allowed = itl_p50 + ctx.text_interval_s
        verdict = ("the UI keeps up" if itl_p50 == 0 or p50 < allowed
                   else "the UI is slower than the engine")
        batching = (f" (text painted every {fmt_ms(ctx.text_interval_s)})"
                    if ctx.text_interval_s else "")
        self.caption.setText(f"Painted − emitted: p50 {fmt_ms(p50)}, p99 {fmt_ms(p99)} vs ITL "
                             f"p50 {fmt_ms(itl_p50)}{batching}: {verdict}.")

    def hover_text(self, x: float, y: float) -> str | None:
        i = _nearest(self.indices, x)
        return None if i is None else f"token {self.indices[i]}: painted {fmt_ms(self.lags_s[i])}"\
            " after the engine emitted it"


PANEL_TYPES: tuple[type[Panel], ...] = (
    TtftPanel, ItlPanel, ThroughputPanel, BreakdownPanel, CachePanel, ContextPanel,
    RooflinePanel, SamplerPanel, RenderLagPanel,
)


def _metrics(reply: ReplyRecord) -> RequestMetrics:
    """A finished reply's metrics (SessionModel.finished() keeps only replies that have them)."""
    assert reply.metrics is not None
    return reply.metrics
