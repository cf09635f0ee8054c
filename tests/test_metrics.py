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
