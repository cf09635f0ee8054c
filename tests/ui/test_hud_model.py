"""The HUD's Qt-free session model: advisor, percentiles, forecast, export, calibration cache."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from engine.events import RequestFinished, TokenEmitted
from engine.metrics import percentile
from engine.tools.calibrate import (
    CACHE_FILE,
    DevicePeaks,
    calibration_method,
    device_peaks,
    roof,
    table_peaks,
)
from tests.support.hud_events import (
    MS,
    ReplySpec,
    conversation_specs,
    from_stamps,
    loaded_event,
    reply_events,
)
from ui.hud.model import Breakdown, SessionModel, advise, fmt_seconds, nice_cap


def breakdown(queue: float, prefill: float, decode: float, *, prompt: int = 100,
              cached: int = 0, output: int = 100, other: float = 0.0) -> Breakdown:
    e2e = queue + prefill + decode + other
    return Breakdown(queue, prefill, decode, e2e, queue + prefill, prompt, cached, output,
                     final=True)


def session(specs: list[ReplySpec] | None = None) -> SessionModel:
    model = SessionModel()
    model.apply(loaded_event())
    for spec in specs or conversation_specs():
        for event in reply_events(spec):
            model.apply(event)
    return model


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8", newline="") as fh:
        return list(csv.DictReader(fh))


# ----- advisor -------------------------------------------------------------------------------
def test_advisor_decode_dominated_matches_the_seed_example() -> None:
    b = breakdown(0.0, 1.5, 1200 * 0.0237, prompt=40, output=1201)
    assert advise(b) == (
        "Decode owns 95% (1,201 tokens: 1,200 gaps x 23.7 ms). A cap of 400 tokens would save "
        "about 19 s; streaming already makes the perceived wait 1.5 s."
    )


def test_advisor_prefill_dominated_names_the_prompt_lever() -> None:
    b = breakdown(0.001, 2.4, 0.1, prompt=3000, cached=0, output=5)
    text = advise(b)
    assert text.startswith("Prefill owns 96% (3,000 new prompt tokens x 0.8 ms, 0 cached).")
    assert "skip 1,500 tokens would save about 1.2 s of TTFT" in text


def test_advisor_queue_dominated_says_wait_or_batch() -> None:
    text = advise(breakdown(3.0, 0.2, 0.5))
    assert text.startswith("Queueing owns 81% (3.0 s before prefill started).")
    assert "batch" in text


def test_advisor_is_silent_when_nothing_dominates() -> None:
    assert advise(breakdown(0.0, 1.0, 1.0)) == ""
    assert advise(None) == ""


def test_advisor_for_short_reply_skips_the_cap() -> None:
    text = advise(breakdown(0.0, 0.01, 0.5, output=10))
    assert text.startswith("Decode owns")
    assert "cap" not in text


def test_formatting_helpers() -> None:
    assert [nice_cap(n) for n in (1200, 350, 90, 2)] == [400, 100, 30, 1]
    assert [fmt_seconds(s) for s in (19.2, 1.53, 0.41, 0.0032)] == [
        "19 s", "1.5 s", "410 ms", "3.2 ms"]


# ----- folding events ------------------------------------------------------------------------
def test_model_numbers_are_the_engines_and_breakdown_adds_up() -> None:
    specs = conversation_specs()
    model = session(specs)
    assert [r.request_id for r in model.finished()] == [s.request_id for s in specs]
    for reply, spec in zip(model.finished(), specs, strict=True):
        expected = from_stamps(reply_events(spec))  # the same stamps, worked out here
        m = reply.metrics
        b = reply.breakdown()
        assert b.final
        assert b.queue_s + b.prefill_s + b.decode_s + b.other_s == pytest.approx(m.e2e_s)
        assert (b.queue_s, b.prefill_s, b.decode_s) == (m.queue_s, m.prefill_s, m.decode_s)
        assert (b.queue_s, b.ttft_s, b.decode_s, b.e2e_s) == pytest.approx(
            (expected.queue_s, expected.ttft_s, expected.decode_s, expected.e2e_s))
        assert reply.itl_s() == pytest.approx(expected.itl_s)
        assert reply.output_tokens == m.output_tokens == expected.output_tokens


def test_live_itl_and_percentiles_match_the_engine_definition() -> None:
    spec = ReplySpec("r", 0, 50, 0, 40)
    events = reply_events(spec)
    model = SessionModel()
    for event in events[:-1]:  # everything but RequestFinished: still live
        model.apply(event)
    live = model.replies["r"]
    assert not live.done and live.breakdown() is not None and not live.breakdown().final
    finished = events[-1]
    assert isinstance(finished, RequestFinished)
    m = finished.result.metrics
    gaps = from_stamps(events).itl_s  # from the token stamps alone
    assert live.itl_s() == pytest.approx(gaps)
    assert m.itl_s == pytest.approx(gaps)
    assert live.itl_percentiles() == pytest.approx(
        (percentile(gaps, 50), percentile(gaps, 90), percentile(gaps, 99)))
    assert live.itl_percentiles() == pytest.approx((m.itl_p50_s, m.itl_p90_s, m.itl_p99_s))


def test_session_ttft_percentiles() -> None:
    model = session()
    ttfts = [r.metrics.ttft_s for r in model.finished()]
    assert model.ttft_percentiles() == (
        percentile(ttfts, 50), percentile(ttfts, 90), percentile(ttfts, 99))


def test_rolling_throughput_has_one_point_per_later_token() -> None:
    model = session([ReplySpec("r", 0, 10, 0, 30, itl_ms=25.0)])
    assert len(model.throughput) == 29
    assert model.throughput[-1] == pytest.approx(40.0, rel=0.05)  # 1 / 25 ms


def test_rolling_throughput_of_replies_decoding_at_once_is_their_sum_in_one_line() -> None:
    """Two chats streaming at once (one batch) draw one unbroken line at their total rate,
    not a NaN between every pair of tokens (a blank plot, and two ring rows a token); a
    reply after they ended starts a new stretch."""
    together = [e for spec in (ReplySpec("a", 2_000 * MS, 10, 0, 40, itl_ms=25.0),
                               ReplySpec("b", 2_000 * MS, 10, 0, 40, itl_ms=25.0))
                for e in reply_events(spec, jitter=False)]
    model = SessionModel()
    model.apply(loaded_event())
    for event in sorted(together, key=lambda e: e.t_ns):  # interleaved, as the engine emits
        model.apply(event)
    assert len(model.throughput) == 2 * 39  # one row per token after each reply's first
    assert model.throughput[-1] == pytest.approx(80.0, rel=0.05)  # 2 / 25 ms
    later = model.ordered()[-1].done_ns + 1_000 * MS
    for event in reply_events(ReplySpec("c", later, 10, 0, 10, itl_ms=25.0), jitter=False):
        model.apply(event)
    _t, v = model.throughput_series()
    assert int(np.isnan(v).sum()) == 1  # the idle second between the stretches
    assert model.throughput[-1] == pytest.approx(40.0, rel=0.05)  # c alone


def test_context_forecast_uses_the_conversations_pace() -> None:
    model = session()
    turns = model.conversation()
    assert [t.request_id for t in turns] == ["req-1", "req-2", "req-3", "req-4"]
    f = model.context_forecast()
    used = 1100 + 300
    per_turn = (used - (420 + 180)) / 3
    assert (f.used, f.length) == (used, 8192)
    assert f.per_turn == pytest.approx(per_turn)
    assert f.turns_left == int((8192 - used) // per_turn)
    assert "more turns fit" in f.describe()


def test_first_turn_miss_starts_a_new_conversation() -> None:
    specs = [*conversation_specs(), ReplySpec("new", 60_000 * MS, 200, 0, 50)]
    model = session(specs)
    assert [t.request_id for t in model.conversation()] == ["new"]
    f = model.context_forecast()
    assert f.per_turn == 250 and f.turns_left == (8192 - 250) // 250


def test_context_overflow_is_announced() -> None:
    model = session([ReplySpec("r", 0, 8000, 0, 150)])
    assert model.context_forecast().describe().endswith("The next turn will overflow the context.")


# ----- export --------------------------------------------------------------------------------
def test_csv_export_round_trips_replies_and_tokens(tmp_path: Path) -> None:
    model = session()
    model.mark_setting("max_tokens", 256, 40_000 * MS)
    replies_path, tokens_path = model.export_csv(tmp_path / "s.csv")
    rows = read_csv(replies_path)
    tokens = read_csv(tokens_path)
    finished = model.finished()
    assert [r["request_id"] for r in rows] == [r.request_id for r in finished]
    for row, reply in zip(rows, finished, strict=True):
        assert float(row["ttft_s"]) == pytest.approx(reply.metrics.ttft_s)
        assert int(row["output_tokens"]) == reply.metrics.output_tokens
        assert row["device"] == "cpu" and row["model"] == "SmolLM2-135M-Instruct"
        assert float(row["setting_temperature"]) == reply.settings["temperature"]
    assert len(tokens) == sum(r.output_tokens for r in finished)
    assert tokens[1]["itl_s"] and float(tokens[1]["itl_s"]) == pytest.approx(
        finished[0].metrics.itl_s[0])


def test_json_export_round_trips(tmp_path: Path) -> None:
    model = session()
    model.peaks = DevicePeaks("cpu: test", 20.0, 0.1, "calibrated").to_dict()
    model.mark_setting("temperature", 1.3, 40_000 * MS)  # the last reply ran at 1.1
    data = json.loads(model.export_json(tmp_path / "s.json").read_text("utf-8"))
    assert data["model"]["device"] == "cpu"
    assert data["device_peaks"]["source"] == "calibrated"
    assert data["setting_changes"][0]["name"] == "temperature"
    assert data["settings"] == {"temperature": 1.3}
    first = data["replies"][0]
    reply = model.replies["req-1"]
    assert first["itl_s"] == reply.metrics.itl_s
    assert first["e2e_s"] == reply.metrics.e2e_s
    assert len(first["tokens"]) == reply.output_tokens
    assert first["tokens"][0]["text"] == reply.token_texts[0]


def test_painted_tokens_give_render_lag() -> None:
    model = session([ReplySpec("r", 0, 10, 0, 5)])
    reply = model.replies["r"]
    for i, t in enumerate(reply.token_ns):
        model.mark_painted("r", i, t + (i + 1) * MS)
    model.mark_painted("r", 0, reply.token_ns[0] + 99 * MS)  # a repaint is not a new paint
    indices, lags = reply.render_lags_s()
    assert indices == [0, 1, 2, 3, 4]
    assert lags == pytest.approx([0.001, 0.002, 0.003, 0.004, 0.005])
    assert model.mark_painted("unknown", 0, 0) is None


def test_token_events_for_unknown_requests_are_ignored() -> None:
    model = SessionModel()
    assert model.apply(TokenEmitted("ghost", 5, 0, 1, "x")) is None
    assert model.replies == {}


# ----- device peaks --------------------------------------------------------------------------
def test_known_gpu_comes_from_the_table(tmp_path: Path) -> None:
    peaks = device_peaks("cuda:0", name="NVIDIA H200", directory=tmp_path,
                         measure=lambda d: pytest.fail("must not measure a known GPU"))
    assert (peaks.bandwidth_gb_s, peaks.tflop_s, peaks.source) == (4800, 989, "spec table")
    assert table_peaks("NVIDIA H100 PCIe").bandwidth_gb_s == 2000
    assert table_peaks("Some Unknown Accelerator") is None


def test_calibration_runs_once_then_comes_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))
    calls: list[str] = []

    def fake_measure(device: str) -> tuple[float, float]:
        calls.append(device)
        return 25.0, 0.2

    first = device_peaks("cpu", name="cpu: test", measure=fake_measure)
    second = device_peaks("cpu", name="cpu: test", measure=fake_measure)
    assert calls == ["cpu"]
    assert first.source == "calibrated" and second.source == "calibrated (cached)"
    assert (second.bandwidth_gb_s, second.tflop_s) == (25.0, 0.2)
    assert (tmp_path / CACHE_FILE).exists()
    assert "calibrated (cached)" in second.describe()


def test_real_calibration_measures_positive_peaks(tmp_path: Path) -> None:
    from engine.tools.calibrate import measure_peaks

    gb_s, tflop_s = measure_peaks("cpu", budget_s=0.2)
    assert gb_s > 0 and tflop_s > 0


def test_the_roof_rises_to_every_achieved_figure_and_says_so() -> None:
    peaks = DevicePeaks("cpu: test", 20.0, 0.09, "calibrated", "fp32 GEMM")
    assert roof(peaks, [(12.0, 0.05)]) is peaks  # nothing above the measured peaks
    raised = roof(peaks, [(12.0, 0.268), (31.5, 0.1)])
    assert (raised.bandwidth_gb_s, raised.tflop_s) == (31.5, 0.268)
    assert raised.raised == ("bandwidth raised to the best decode seen (31.5 GB/s; measured "
                             "20.0); compute raised to the best prefill seen (0.268 TFLOP/s; "
                             "measured 0.090)")
    assert raised.how_measured().startswith("Peak: calibrated on cpu: test: fp32 GEMM; ")


def test_a_cached_peak_measured_another_way_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first calibration's 512 x 512 GEMM read a quarter of the CPU's rate: its cached
    figures (no method recorded) must not outlive it."""
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))
    (tmp_path / CACHE_FILE).write_text(json.dumps(
        {"cpu: test": {"bandwidth_gb_s": 20.0, "tflop_s": 0.09}}))
    peaks = device_peaks("cpu", name="cpu: test", measure=lambda d: (25.0, 0.4))
    assert (peaks.tflop_s, peaks.source) == (0.4, "calibrated")
    assert peaks.method == calibration_method("cpu")
    assert "1536x1536 GEMM" in peaks.method


# ----- a reply stopped while its prompt was read (issue 31 item 4) ------------------------------
def stopped_in_prefill(model: SessionModel, rid: str, *, prompt: int, cached: int, read: int,
                       start_ns: int = 0) -> None:
    """Queued, prefill started, Stop after `read` prompt tokens: the engine's result (no first
    logits, no token), its metrics from compute_metrics as Reply.result builds them."""
    from engine.events import GenerationResult, PrefillStarted, RequestQueued
    from engine.metrics import RequestTimeline, compute_metrics
    from tests.support.hud_events import INFO

    tl = RequestTimeline(start_ns, prefill_start_ns=start_ns + 2 * MS,
                         done_ns=start_ns + 8_002 * MS)
    m = compute_metrics(tl, prompt_tokens=prompt, cached_tokens=cached,
                        parameters=INFO.parameters,
                        weight_bytes_per_step=INFO.weight_bytes_per_step,
                        cache_miss_reason="first_turn", prefilled_tokens=read)
    for event in (RequestQueued(rid, start_ns),
                  PrefillStarted(rid, tl.prefill_start_ns, prompt, cached, "first_turn"),
                  RequestFinished(rid, tl.done_ns, GenerationResult(
                      rid, "", "cancelled", [], list(range(prompt)), m, INFO))):
        model.apply(event)


def test_a_reply_stopped_in_its_prefill_says_how_much_it_read() -> None:
    """82% of 5,474 new tokens read before Stop: the breakdown and the advisor say "4,489 of
    5,474 new prompt tokens read", its 8 s after the queue are prefill, it has no TTFT."""
    model = SessionModel()
    stopped_in_prefill(model, "cut", prompt=5_498, cached=24, read=4_489)
    b = model.replies["cut"].breakdown()
    assert b is not None and b.prefill_cut and not b.has_first_token
    assert (b.prefilled_tokens, b.new_tokens) == (4_489, 5_474)
    assert b.prefill_s == pytest.approx(8.0) and b.other_s == pytest.approx(0.0)
    detail = dict((phase, text) for phase, text, _s, _share in b.rows())["prefill"]
    assert detail == "4,489 of 5,474 new prompt tokens read before Stop (82%), 24 cached"
    advice = advise(b)
    assert advice.startswith("Stopped while reading the prompt, after 8.0 s of prefill: "
                             "4,489 of 5,474 new prompt tokens read before Stop (82%)")
    assert "5,474 new prompt tokens," not in advice
    assert model.replies["cut"].unread_tokens == 5_474 - 4_489


def test_a_reply_without_a_first_token_is_no_ttft_in_the_percentiles() -> None:
    """Its TTFT of 0 would read "p50 0.0 ms": the percentiles leave it out; alone, there are
    none."""
    model = session()
    ttfts = model.ttfts()
    stopped_in_prefill(model, "cut", prompt=300, cached=0, read=128, start_ns=10**12)
    assert model.ttfts() == ttfts and model.ttft_percentiles()[0] == percentile(ttfts, 50)
    alone = SessionModel()
    stopped_in_prefill(alone, "cut", prompt=300, cached=0, read=128)
    assert alone.ttfts() == []


def test_a_reply_stopped_after_its_prefill_keeps_todays_breakdown() -> None:
    """A whole prefill (first token out, then Stop) is no cut prefill: prefilled = new."""
    model = session([ReplySpec("r", 0, 200, 50, 5)])
    b = model.replies["r"].breakdown()
    assert b is not None and not b.prefill_cut and b.has_first_token
    assert b.prefilled_tokens == 150 and model.replies["r"].unread_tokens == 0
    assert dict((p, t) for p, t, _s, _sh in b.rows())["prefill"] == \
        "200 prompt tokens, 50 cached"
