"""The HUD widget: synthetic event sequences in, panel data out; plus one real-engine reply."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engine import ChatMessage, GenerationRequest, SamplingParams
from engine.events import EngineEvent, RequestFinished, SamplerSnapshot, TokenEmitted
from engine.tools.calibrate import CACHE_FILE, DevicePeaks, calibration_method, device_name
from engine.worker import Engine
from tests.support.hud_events import (
    MS,
    ReplySpec,
    conversation_specs,
    from_stamps,
    loaded_event,
    reply_events,
)
from tests.support.window_helpers import new_hud
from ui.hud.widget import HudWidget

PEAKS = DevicePeaks("cpu: test", 28.0, 0.16, "calibrated (cached)")


@pytest.fixture
def hud(qtbot) -> HudWidget:
    """Overrides conftest's hud: calibrated device peaks, and no model loaded yet."""
    widget = new_hud(qtbot)
    widget.set_device_peaks(PEAKS)
    return widget


def feed(hud: HudWidget, events: list[EngineEvent], paint_lag_ms: int = 4) -> None:
    """Forward events as the window would, reporting each token painted paint_lag_ms later."""
    for event in events:
        hud.on_engine_event(event)
        if isinstance(event, TokenEmitted):
            hud.on_token_painted(event.request_id, event.index, event.t_ns + paint_lag_ms * MS)


def feed_conversation(hud: HudWidget) -> None:
    hud.on_engine_event(loaded_event())
    for spec in conversation_specs():
        feed(hud, reply_events(spec))


def test_events_only_schedule_a_throttled_redraw(hud: HudWidget) -> None:
    feed(hud, reply_events(ReplySpec("r", 0, 20, 0, 10))[:5])
    assert hud._timer.isActive()
    assert hud._timer.interval() >= 1000 / 30  # never redraws faster than 30 Hz
    hud.flush()
    assert not hud._timer.isActive() and not hud._dirty


def test_panels_show_the_engine_numbers(hud: HudWidget) -> None:
    feed_conversation(hud)
    hud.flush()
    finished = hud.model.finished()
    ttft = hud.panels["ttft"]
    heights = [q + p + f for q, p, f in zip(
        ttft._bars["queue"].opts["height"], ttft._bars["prefill"].opts["height"],
        ttft._bars["first"].opts["height"], strict=True)]
    assert heights == pytest.approx([r.metrics.ttft_s for r in finished])
    _x, itl_y = hud.panels["itl"]._curve.getData()
    assert list(itl_y) == pytest.approx(finished[-1].metrics.itl_s)
    cache = hud.panels["cache"]
    assert list(cache._reused.opts["height"]) == [r.cached_tokens for r in finished]
    assert "1,058 reused, 42 recomputed (full hit)" in cache.caption.text()
    table = hud.panels["breakdown"].table.text()
    assert "1,100 prompt tokens, 1,058 cached" in table
    assert "299 gaps after the first token x 34.0 ms" in table
    assert "more turns fit" in hud.panels["context"].caption.text()
    roof = hud.panels["roofline"].caption.text()
    assert f"{finished[-1].metrics.achieved_gb_s:,.1f} GB/s of 28" in roof
    assert "calibrated (cached)" in roof
    assert hud.advice_label.text() == hud.advice_text()
    assert hud.advice_text().startswith("Decode owns 99% (300 tokens: 299 gaps x 34.0 ms).")
    assert hud.reply_combo.count() == 1 + len(finished)


def test_live_reply_moves_the_panels(hud: HudWidget) -> None:
    events = reply_events(ReplySpec("live", 0, 30, 0, 40))
    feed(hud, events[:-1])  # not finished yet
    hud.flush()
    _x, itl_y = hud.panels["itl"]._curve.getData()
    assert len(itl_y) == 39
    assert "(live)" in hud.panels["itl"].caption.text()
    assert hud.advice_label.text().startswith("Live: ")
    assert len(hud.model.throughput) == 39


def test_past_replies_are_selectable(hud: HudWidget) -> None:
    feed_conversation(hud)
    hud.select_reply("req-2")
    hud.flush()
    _x, itl_y = hud.panels["itl"]._curve.getData()
    assert len(itl_y) == hud.model.replies["req-2"].metrics.output_tokens - 1
    assert "Reply #2" in hud.panels["breakdown"].caption.text()
    assert hud.reply_combo.currentData() == "req-2"
    hud.reply_combo.setCurrentIndex(0)  # the user picks "Live reply": follow it again
    hud.reply_combo.activated.emit(0)
    assert hud.selected_reply().request_id == "req-4"


def test_sampler_view_shows_candidates_cut_and_drawn_token(hud: HudWidget) -> None:
    events = reply_events(ReplySpec("s", 0, 10, 0, 8, temperature=0.8, top_p=0.8))
    feed(hud, events)
    hud.flush()
    snap = [e for e in events if isinstance(e, SamplerSnapshot)][-1]
    panel = hud.panels["sampler"]
    assert panel.snapshot_index == snap.index == 5
    assert list(panel._bars.opts["width"]) == [p for _, _, p in snap.candidates]
    assert panel._cut.isVisible() and panel._cut.value() == snap.kept - 0.5
    assert ("temperature 0.80, top-p 0.80; top-k, top-p and min-p together keep 4 of these 10"
            in panel.caption.text())
    assert "drew “·a”" in panel.caption.text()  # index 5 draws the runner-up in hud_events
    assert panel.hover_text(0.1, 0) == "“·Paris”: p = 0.4100 after temperature"


def test_render_lag_compares_painted_with_emitted(hud: HudWidget) -> None:
    feed(hud, reply_events(ReplySpec("r", 0, 10, 0, 12)), paint_lag_ms=7)
    hud.flush()
    panel = hud.panels["render"]
    assert panel.indices == list(range(12))
    assert panel.lags_s == pytest.approx([0.007] * 12)
    assert "p50 7.0 ms" in panel.caption.text() and "the UI keeps up" in panel.caption.text()


def test_render_lag_is_judged_against_the_text_batching(hud: HudWidget) -> None:
    """60 ms of lag is behind a 34 ms token gap, unless text is painted in 100 ms batches."""
    feed(hud, reply_events(ReplySpec("r", 0, 10, 0, 12), jitter=False), paint_lag_ms=60)
    hud.flush()
    caption = hud.panels["render"].caption.text
    assert "the UI is slower than the engine" in caption()
    hud.set_text_interval(0.1)
    hud.flush()
    assert "(text painted every 100.0 ms): the UI keeps up" in caption()


def test_setting_changes_drop_markers_on_time_plots(hud: HudWidget) -> None:
    feed_conversation(hud)
    hud.mark_setting_change("temperature", 1.1, 30_000 * MS)
    hud.mark_setting_change("temperature", 1.2, 30_100 * MS)  # a slider drag: one marker
    hud.mark_setting_change("max_tokens", 256, 30_200 * MS)  # same gap: the same marker
    assert hud.panels["throughput"].marker_labels() == ["temperature=1.2, max_tokens=256"]
    assert hud.panels["ttft"].marker_labels() == ["temperature=1.2, max_tokens=256"]
    assert hud.model.settings == {"temperature": 1.2, "max_tokens": 256}


def test_hover_reads_out_values(hud: HudWidget) -> None:
    feed_conversation(hud)
    hud.flush()
    assert hud.panels["ttft"].hover_text(1.1, 0).startswith("turn 1: TTFT 1.3 s")
    assert "tok/s" in hud.panels["throughput"].hover_text(5.0, 0)
    assert hud.panels["breakdown"].hover_text(5.0, 0).startswith("decode:")
    assert "miss: edited history" in hud.panels["cache"].hover_text(3, 0)


def test_panels_hide_and_show(hud: HudWidget, qtbot) -> None:
    assert len(hud.panel_keys()) == 9
    hud.set_panel_visible("itl", False)
    assert not hud.is_panel_visible("itl")
    assert not hud._panel_actions["itl"].isChecked()
    feed(hud, reply_events(ReplySpec("r", 0, 10, 0, 10)))
    hud.flush()
    _x, itl_y = hud.panels["itl"]._curve.getData()
    assert itl_y is None or len(itl_y) == 0  # hidden panels are not redrawn
    hud._panel_actions["itl"].setChecked(True)  # the Panels menu brings it back
    hud.flush()
    assert hud.is_panel_visible("itl")
    assert len(hud.panels["itl"]._curve.getData()[1]) == 9
    hud.panels["sampler"].sig_hide_requested.emit("sampler")  # the card's ✕ button
    assert not hud.is_panel_visible("sampler")


def test_export_pngs_csv_and_json(hud: HudWidget, tmp_path: Path) -> None:
    feed_conversation(hud)
    hud.flush()
    pngs = hud.export_all_pngs(tmp_path / "plots")
    assert len(pngs) == 9
    for png in pngs:
        assert png.exists() and png.stat().st_size > 1000
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    csv_paths = hud.export_csv(tmp_path / "session.csv")
    assert all(p.stat().st_size > 0 for p in csv_paths)
    data = json.loads(hud.export_json(tmp_path / "session.json").read_text("utf-8"))
    assert len(data["replies"]) == 4 and data["device_peaks"]["bandwidth_gb_s"] == 28.0


def test_calibration_thread_delivers_cached_peaks(
    qtbot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))
    (tmp_path / CACHE_FILE).write_text(json.dumps(
        {device_name("cpu"): {"bandwidth_gb_s": 12.5, "tflop_s": 0.05,
                              "method": calibration_method("cpu")}}))
    widget = HudWidget()
    qtbot.addWidget(widget)
    with qtbot.waitSignal(widget.sig_peaks_ready, timeout=10_000):
        widget.on_engine_event(loaded_event())
    assert widget.peaks.source == "calibrated (cached)" and widget.peaks.bandwidth_gb_s == 12.5


def test_real_engine_reply_numbers_reach_the_hud(tiny_engine: Engine, qtbot) -> None:
    hud = HudWidget(calibrate=False)
    qtbot.addWidget(hud)
    hud.set_device_peaks(PEAKS)
    events: list[EngineEvent] = []
    tiny_engine.add_listener(events.append)  # list.append is atomic; replayed on this thread
    request = GenerationRequest([ChatMessage("user", "Hello there")],
                                SamplingParams(temperature=0.8, max_tokens=12, seed=1),
                                conversation_id="c1")
    result = tiny_engine.submit(request).wait(timeout=60)
    ours = [e for e in events if getattr(e, "request_id", None) == request.request_id]
    assert isinstance(ours[-1], RequestFinished)
    expected = from_stamps(ours)
    assert expected.output_tokens == 12 and expected.e2e_s is not None

    feed(hud, ours[:-1])  # live: everything but the end
    hud.flush()
    reply = hud.model.replies[request.request_id]
    assert reply.metrics is None
    assert reply.itl_s() == pytest.approx(expected.itl_s)
    assert list(hud.panels["itl"]._curve.getData()[1]) == pytest.approx(expected.itl_s)
    live = reply.breakdown()
    assert live is not None and not live.final
    assert (live.queue_s, live.decode_s) == pytest.approx(
        (expected.queue_s, expected.decode_s))
    assert live.queue_s + live.prefill_s == pytest.approx(expected.ttft_s)

    feed(hud, ours[-1:])
    hud.flush()
    m = result.metrics
    assert reply.metrics == m
    assert reply.itl_s() == pytest.approx(expected.itl_s)
    assert list(hud.panels["itl"]._curve.getData()[1]) == pytest.approx(expected.itl_s)
    assert (m.queue_s, m.ttft_s, m.decode_s, m.e2e_s) == pytest.approx(
        (expected.queue_s, expected.ttft_s, expected.decode_s, expected.e2e_s))
    b = reply.breakdown()
    assert b.queue_s + b.prefill_s + b.decode_s + b.other_s == pytest.approx(m.e2e_s)
    assert reply.output_tokens == m.output_tokens == expected.output_tokens
    assert reply.snapshot is not None and reply.snapshot.chosen_id in result.token_ids
    assert hud.panels["ttft"]._bars["queue"].opts["height"][0] == pytest.approx(
        expected.queue_s)
    assert hud.panels["render"].indices == list(range(m.output_tokens))
    assert f"{m.cached_tokens:,} reused" in hud.panels["cache"].caption.text()


def test_roofline_ceiling_rises_to_the_best_prefill_seen_never_over_100_percent(
    hud: HudWidget,
) -> None:
    """Issue 31 item 2: a prefill faster than the calibrated GEMM (llama.cpp's int8 kernels)
    read "0.268 TFLOP/s of 0.09 (300%)" and sat off the chart."""
    hud.on_engine_event(loaded_event())
    # 30,000 tokens in 3 s: 2 x 134,515,008 x 30,000 / 3 = 2.690 TFLOP/s, above PEAKS' 0.16.
    feed(hud, reply_events(ReplySpec("fast", 0, 30_000, 0, 20, prefill_ms_per_token=0.1)))
    hud.flush()
    panel = hud.panels["roofline"]
    caption = panel.caption.text()
    assert "prefill: 2.690 TFLOP/s of 2.690 (100%)" in caption
    assert "compute raised to the best prefill seen (2.690 TFLOP/s; measured 0.160)" in caption
    assert "calibrated (cached) on cpu: test" in panel.caption.toolTip()
    # Both points lie inside the plotted range (log axes): AI 0.5 x 30,000 = 15,000 FLOP/byte.
    (x0, x1), (y0, y1) = panel.plot.getPlotItem().viewRange()
    xs, ys = panel._points.getData()
    assert list(xs) == pytest.approx([math.log10(0.5), math.log10(15_000)])
    assert all(x0 <= x <= x1 for x in xs) and all(y0 <= y <= y1 for y in ys)
    _ai, roof_y = panel._roof.getData()
    assert max(roof_y) == pytest.approx(math.log10(2.69030016))  # log axes: data in decades
