"""A long session (10,000 tokens of history): bounded plot buffers, latest numbers on screen.

Timings live in benchmarks/hud_history.py; these check structure only.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.events import EngineEvent, RequestFinished, TokenEmitted
from engine.metrics import NS
from engine.tools.calibrate import DevicePeaks
from tests.support.hud_events import MS, ReplySpec, history_events, loaded_event, reply_events
from ui.hud.model import THROUGHPUT_WINDOW, SeriesRing, SessionModel
from ui.hud.panels import nice_ceiling
from ui.hud.widget import FINAL_REDRAW_MS, REDRAW_INTERVAL_MS, HudWidget

TOKENS = 10_000
PER_REPLY = 250


@pytest.fixture(scope="module")
def history() -> list[list[EngineEvent]]:
    return history_events(TOKENS, PER_REPLY)


def feed(target: SessionModel | HudWidget, replies: list[list[EngineEvent]]) -> None:
    apply = target.apply if isinstance(target, SessionModel) else target.on_engine_event
    for events in replies:
        for event in events:
            apply(event)
            if isinstance(target, HudWidget) and isinstance(event, TokenEmitted):
                target.on_token_painted(event.request_id, event.index, event.t_ns + 3 * MS)


def last_rolling_tok_s(events: list[EngineEvent]) -> float:
    """The rolling throughput at a reply's last token, computed from its stamps here."""
    stamps = [e.t_ns for e in events if isinstance(e, TokenEmitted)]
    return THROUGHPUT_WINDOW / ((stamps[-1] - stamps[-1 - THROUGHPUT_WINDOW]) * NS)


# ----- the ring buffer -----------------------------------------------------------------------
def test_series_ring_keeps_the_latest_rows_in_order_as_one_slice() -> None:
    ring = SeriesRing(capacity=7, columns=2)
    assert ring.view().shape == (2, 0)
    for i in range(3):
        ring.append(i, -i)
    assert ring.view().tolist() == [[0, 1, 2], [0, -1, -2]]
    for i in range(3, 25):  # wraps three times
        ring.append(i, -i)
    view = ring.view()
    assert len(ring) == 7 and ring.appended == 25
    assert view[0].tolist() == list(range(18, 25))
    assert view[1].tolist() == [-i for i in range(18, 25)]
    assert view.base is not None  # a view into the buffer, not a rebuilt copy


def test_session_plot_memory_is_bounded_after_10000_tokens(history) -> None:
    model = SessionModel(plot_history=1_000)
    ring = model.throughput_ring
    nbytes = ring.nbytes
    feed(model, history)
    # A point for every token after a reply's first, a NaN row between replies.
    assert ring.appended == (PER_REPLY - 1) * len(history) + len(history) - 1
    assert len(ring) == ring.capacity == 1_000 and ring.nbytes == nbytes
    t, v = model.throughput_series()
    assert len(t) == len(v) == 1_000
    finite = np.isfinite(t)
    assert np.all(np.diff(t[finite]) > 0)  # oldest first
    # The kept window ends with the last reply; a NaN row separates it from the one before.
    last_reply_points = PER_REPLY - 1
    assert np.isnan(t[-last_reply_points - 1]) and finite[-last_reply_points:].all()
    assert v[-1] == pytest.approx(last_rolling_tok_s(history[-1]))
    assert model.throughput[-1] == v[-1] and len(model.throughput_t) == finite.sum()


# ----- the widget after a long history -------------------------------------------------------
@pytest.fixture(scope="module")
def long_hud(history, qapp) -> HudWidget:
    hud = HudWidget(calibrate=False)
    hud.resize(420, 900)
    hud.set_device_peaks(DevicePeaks("cpu: test", 28.0, 0.16, "calibrated (cached)"))
    hud.on_engine_event(loaded_event())
    feed(hud, history)
    hud.flush()
    yield hud
    hud.close()
    hud.deleteLater()


def test_panels_show_the_latest_reply_after_10000_tokens(long_hud: HudWidget, history) -> None:
    finished = long_hud.model.finished()
    latest = finished[-1].metrics
    assert len(finished) == len(history) == TOKENS // PER_REPLY
    assert sum(r.output_tokens for r in finished) == TOKENS
    _x, itl = long_hud.panels["itl"]._curve.getData()
    assert list(itl) == pytest.approx(latest.itl_s)
    assert long_hud._kpis["decode"].text() == f"{latest.decode_tok_s:,.1f} tok/s"
    table = long_hud.panels["breakdown"].table.text()
    assert f"{latest.prompt_tokens:,} prompt tokens, {latest.cached_tokens:,} cached" in table
    assert f"{latest.decode_s:.3f} s" in table
    assert long_hud.panels["render"].indices == list(range(PER_REPLY))
    assert long_hud.reply_combo.count() == 1 + len(finished)


def test_per_turn_panels_show_the_latest_turns_with_engine_numbers(long_hud: HudWidget) -> None:
    finished = long_hud.model.finished()
    ttft = long_hud.panels["ttft"]
    shown = [x for x, _r in ttft._rows]
    assert shown[-1] == finished[-1].number and len(shown) == 40
    heights = [q + p + f for q, p, f in zip(
        ttft._bars["queue"].opts["height"], ttft._bars["prefill"].opts["height"],
        ttft._bars["first"].opts["height"], strict=True)]
    assert heights == pytest.approx([r.metrics.ttft_s for r in finished[-40:]])
    assert list(long_hud.panels["cache"]._reused.opts["height"]) == [
        r.cached_tokens for r in finished[-40:]]


def test_throughput_plot_ends_at_the_latest_point_and_keeps_it_in_view(
    long_hud: HudWidget, history
) -> None:
    panel = long_hud.panels["throughput"]
    x, y = panel._curve.xData, panel._curve.yData  # as set, before downsampling for display
    assert y[-1] == pytest.approx(last_rolling_tok_s(history[-1]))
    _means_x, means_y = panel._means.getData()
    assert means_y[-1] == pytest.approx(long_hud.model.finished()[-1].metrics.decode_tok_s)
    (x_lo, x_hi), (_y_lo, y_hi) = panel.plot.getPlotItem().viewRange()
    assert x_lo <= 0 and x_hi >= x[-1] and y_hi >= np.nanmax(y)


def test_a_live_reply_after_the_long_history_still_moves_the_panels(long_hud: HudWidget) -> None:
    start = long_hud.model.latest().done_ns + 1_000 * MS
    events = reply_events(ReplySpec("live-after", start, 400, 370, 30, miss_reason="none"))
    feed(long_hud, [events[:-1]])
    assert long_hud._timer.isActive() and long_hud._timer.interval() >= REDRAW_INTERVAL_MS
    long_hud.flush()
    _x, itl = long_hud.panels["itl"]._curve.getData()
    assert len(itl) == 29 and "(live)" in long_hud.panels["itl"].caption.text()
    assert long_hud.advice_label.text().startswith("Live: ")
    feed(long_hud, [events[-1:]])
    assert isinstance(events[-1], RequestFinished)
    assert long_hud._timer.interval() == FINAL_REDRAW_MS  # the final numbers land at once
    long_hud.flush()
    assert "(finished)" in long_hud.panels["itl"].caption.text()


# ----- range snapping ------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "ceiling"), [
    (0.0, 1.0), (-3.0, 1.0), (math.nan, 1.0), (1.0, 1.0), (1.2, 2.0), (7.0, 10.0), (2.5, 3.0),
    (250.0, 300.0), (0.034, 0.05), (10_001.0, 20_000.0), (4.2e-5, 5e-5),
])
def test_nice_ceiling_snaps_up_to_round_numbers(value: float, ceiling: float) -> None:
    assert nice_ceiling(value) == pytest.approx(ceiling)


def test_throughput_plot_follows_the_ring_once_old_points_drop(qtbot, history) -> None:
    hud = HudWidget(calibrate=False)
    qtbot.addWidget(hud)
    hud.model = SessionModel(plot_history=500)
    feed(hud, history[:8])  # 2,000 tokens through a 500-point ring
    hud.flush()
    panel = hud.panels["throughput"]
    x, y = panel._curve.xData, panel._curve.yData
    assert len(x) == 500 and y[-1] == pytest.approx(last_rolling_tok_s(history[7]))
    (x_lo, x_hi), _ = panel.plot.getPlotItem().viewRange()
    assert 0 < x_lo <= np.nanmin(x) and x_hi >= np.nanmax(x)
