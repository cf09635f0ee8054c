import pytest

from engine.metrics import RequestTimeline, compute_metrics, percentile

MS = 1_000_000


def test_metrics_follow_design_definitions() -> None:
    tl = RequestTimeline(
        submitted_ns=0,
        prefill_start_ns=10 * MS,
        first_logits_ns=110 * MS,
        token_ns=[120 * MS, 170 * MS, 230 * MS, 270 * MS],
        done_ns=280 * MS,
    )
    m = compute_metrics(tl, prompt_tokens=50, cached_tokens=30, parameters=1000,
                        weight_bytes_per_step=2_000_000_000, cache_miss_reason="none")
    assert m.queue_s == pytest.approx(0.010)
    assert m.prefill_s == pytest.approx(0.100)
    assert m.ttft_s == pytest.approx(0.120)
    assert m.itl_s == pytest.approx([0.050, 0.060, 0.040])
    assert m.decode_s == pytest.approx(0.150)
    assert m.decode_tok_s == pytest.approx(3 / 0.150)
    assert m.e2e_s == pytest.approx(0.280)
    assert m.tpot_s == pytest.approx((0.280 - 0.120) / 3)
    assert m.prefilled_tokens == 20
    assert m.prompt_tokens == m.cached_tokens + m.prefilled_tokens
    assert m.achieved_gb_s == pytest.approx(2.0 * 20)
    assert m.prefill_tflop_s == pytest.approx(2 * 1000 * 20 / 0.1 / 1e12)
    assert m.itl_p50_s == pytest.approx(0.050)


def test_single_token_reply_has_no_decode_rate() -> None:
    tl = RequestTimeline(submitted_ns=0, prefill_start_ns=1, first_logits_ns=2, token_ns=[3],
                         done_ns=4)
    m = compute_metrics(tl, prompt_tokens=5, cached_tokens=0, parameters=1,
                        weight_bytes_per_step=1, cache_miss_reason="first_turn")
    assert (m.output_tokens, m.itl_s, m.tpot_s, m.decode_tok_s) == (1, [], 0.0, 0.0)


def test_percentile_matches_linear_interpolation() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile([], 99) == 0.0


# ----- edge cases and every field (mutation testing, `make mutation`) ---------------------------
def metrics_of(tl: RequestTimeline, **kw) -> object:
    args = dict(prompt_tokens=10, cached_tokens=4, parameters=1000, weight_bytes_per_step=10**9,
                cache_miss_reason="edited_history")
    args.update(kw)
    return compute_metrics(tl, **args)


def test_every_field_of_a_finished_request() -> None:
    tl = RequestTimeline(submitted_ns=5 * MS, prefill_start_ns=7 * MS, first_logits_ns=47 * MS,
                         token_ns=[50 * MS, 60 * MS, 90 * MS], done_ns=95 * MS)
    d = metrics_of(tl).to_dict()
    assert d.pop("itl_s") == pytest.approx([0.010, 0.030])
    assert d == pytest.approx({
        "queue_s": 0.002, "prefill_s": 0.040, "ttft_s": 0.045,
        "tpot_s": (0.090 - 0.045) / 2, "decode_s": 0.040, "decode_tok_s": 2 / 0.040,
        "e2e_s": 0.090, "prompt_tokens": 10, "cached_tokens": 4, "prefilled_tokens": 6,
        "output_tokens": 3, "parameters": 1000, "weight_bytes_per_step": 10**9,
        "achieved_gb_s": 1.0 * 2 / 0.040, "prefill_tflop_s": 2 * 1000 * 6 / 0.040 / 1e12,
        "itl_p50_s": 0.020, "itl_p90_s": 0.028, "itl_p99_s": 0.0298,
        "cache_miss_reason": "edited_history", "prefill_complete": True,
        "prompt_tokens_known": True, "cached_tokens_known": True,
        "restored_tokens": 0, "restored_bytes": 0, "restore_s": 0.0,
    })


def test_cancelled_before_its_prefill_queued_until_done() -> None:
    """No prefill start: the whole wait was the queue; no prefill, no tokens."""
    tl = RequestTimeline(submitted_ns=2 * MS, done_ns=32 * MS)
    m = metrics_of(tl)
    assert (m.queue_s, m.prefill_s, m.ttft_s, m.e2e_s) == pytest.approx((0.030, 0.0, 0.0, 0.030))
    assert (m.output_tokens, m.itl_s, m.decode_s, m.decode_tok_s, m.tpot_s) == (0, [], 0.0, 0.0,
                                                                                0.0)
    assert (m.prefill_tflop_s, m.achieved_gb_s) == (0.0, 0.0)
    assert (m.itl_p50_s, m.itl_p90_s, m.itl_p99_s) == (0.0, 0.0, 0.0)


def test_stopped_inside_the_prefill_counts_what_it_read_and_how_long() -> None:
    """Stop while the prompt is read: the prefill ran until Stop ended the request, read
    fewer tokens than the prompt's uncached part, and has no rate (its time includes the chunk
    Stop threw away); no first token, so no TTFT."""
    tl = RequestTimeline(submitted_ns=0, prefill_start_ns=4 * MS, done_ns=9 * MS)
    m = metrics_of(tl, prompt_tokens=100, cached_tokens=10, prefilled_tokens=60)
    assert (m.queue_s, m.prefill_s, m.ttft_s, m.e2e_s) == pytest.approx((0.004, 0.005, 0.0,
                                                                         0.009))
    assert (m.cached_tokens, m.prefilled_tokens, m.prefill_complete) == (10, 60, False)
    assert m.prompt_tokens > m.cached_tokens + m.prefilled_tokens
    assert m.prefill_tflop_s == 0.0
    assert m.to_dict()["prefill_complete"] is False


def test_a_prefill_that_read_everything_is_complete() -> None:
    """prefilled_tokens given as the whole uncached part (or not given: a remote server's
    count) is a complete prefill: prompt = cached + prefilled, and it has a rate."""
    tl = RequestTimeline(submitted_ns=0, prefill_start_ns=MS, first_logits_ns=3 * MS,
                         token_ns=[4 * MS], done_ns=5 * MS)
    given, default = metrics_of(tl, prefilled_tokens=6), metrics_of(tl)
    for m in (given, default):
        assert (m.prefilled_tokens, m.prefill_complete) == (6, True)
        assert m.prefill_s == pytest.approx(0.002)
        assert m.prefill_tflop_s == pytest.approx(2 * 1000 * 6 / 0.002 / 1e12)


def test_prefill_read_to_the_end_but_stopped_before_logits_is_complete() -> None:
    """Every prompt token read, no first logits stamped (a draft model's setup was stopped):
    complete, its time until the end."""
    tl = RequestTimeline(submitted_ns=0, prefill_start_ns=MS, done_ns=7 * MS)
    m = metrics_of(tl, prefilled_tokens=6)
    assert m.prefill_complete and m.prefill_s == pytest.approx(0.006)


def test_tokens_on_one_clock_tick_have_no_decode_rate() -> None:
    tl = RequestTimeline(submitted_ns=0, prefill_start_ns=1, first_logits_ns=2, token_ns=[3, 3],
                         done_ns=4)
    m = metrics_of(tl)
    assert (m.decode_s, m.decode_tok_s, m.achieved_gb_s) == (0.0, 0.0, 0.0)
    assert m.tpot_s == pytest.approx((4 - 3) * 1e-9)


def test_two_tokens_decode_rate() -> None:
    tl = RequestTimeline(submitted_ns=MS, prefill_start_ns=MS, first_logits_ns=2 * MS,
                         token_ns=[3 * MS, 7 * MS], done_ns=8 * MS)
    m = metrics_of(tl, prompt_tokens=3, cached_tokens=0, weight_bytes_per_step=4 * 10**9)
    assert (m.decode_s, m.decode_tok_s) == pytest.approx((0.004, 250.0))
    assert m.achieved_gb_s == pytest.approx(1000.0)
    assert m.prefill_tflop_s == pytest.approx(2 * 1000 * 3 / 0.001 / 1e12)
    assert m.itl_s == pytest.approx([0.004])
    assert (m.itl_p50_s, m.itl_p90_s, m.itl_p99_s) == pytest.approx((0.004, 0.004, 0.004))


def test_percentiles_interpolate_between_neighbours() -> None:
    from engine.metrics import percentiles

    values = [10.0, 40.0, 20.0, 30.0]
    assert percentiles(values, (0, 25, 50, 100)) == pytest.approx([10.0, 17.5, 25.0, 40.0])
    assert percentiles([7.0], (0, 50, 99)) == [7.0, 7.0, 7.0]
    assert percentiles([], (50, 90)) == [0.0, 0.0]
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert values == [10.0, 40.0, 20.0, 30.0]  # the caller's list is left as it was


def test_a_prefix_restored_from_disk_is_reported_with_the_metrics() -> None:
    from engine.core.snapshots import Restored

    tl = RequestTimeline(submitted_ns=0, prefill_start_ns=MS, first_logits_ns=5 * MS,
                         token_ns=[6 * MS], done_ns=7 * MS)
    m = compute_metrics(tl, prompt_tokens=100, cached_tokens=90, parameters=1,
                        weight_bytes_per_step=1, cache_miss_reason="restored_from_disk",
                        restored=Restored(tokens=90, nbytes=4096, seconds=0.003))
    assert (m.restored_tokens, m.restored_bytes, m.restore_s) == (90, 4096, 0.003)
    assert m.prefilled_tokens == 10 and m.prefill_s == pytest.approx(0.004)
