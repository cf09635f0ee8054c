"""How fast here (engine/tools/speed.py): a model's cost per token from its header, the prediction
from one measurement of this machine, that measurement cached per machine and engine build,
and the figures replies measured, kept per model file."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from engine.gguf_header import read_gguf
from engine.metrics import RequestTimeline, compute_metrics
from engine.runtime_choice import LLAMA_CPP, TORCH
from engine.runtimes.llamacpp.model import weight_bytes_per_step
from engine.tools import speed
from engine.tools.speed import (
    MeasuredSpeeds,
    ModelCost,
    ModelSpeed,
    SpeedProfiles,
    predict,
    prompt_seconds,
)
from tests.support.gguf import write_gguf
from tests.support.speed import CountingMeasure, fake_speed


def test_cost_of_an_untied_gguf_from_its_header(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "u.gguf", layers=2, kv_heads=2, rows=32, untied=True)
    cost = ModelCost.from_gguf_file(path)
    width = 8 * 64
    embed, ffn, head = 32 * width, 2 * width * width, 32 * width
    assert (cost.parameters, cost.body_parameters, cost.head_parameters) == (
        embed + ffn + head, ffn, head)
    # A step reads the block (f16) and the head (f32) whole, and one row of the input table.
    assert cost.step_bytes == ffn * 2 + head * 4 + width * 2
    assert cost.attention == 2 * 8 * (64 + 64)  # layers x query heads x (key + value)
    # The llama.cpp engine's figure for the HUD is the same one.
    assert weight_bytes_per_step(path, 1) == cost.step_bytes


def test_a_tied_table_is_read_whole_and_is_the_head(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", layers=1, kv_heads=1, rows=64)
    cost = ModelCost.from_gguf_file(path)
    header = read_gguf(path)
    assert cost.step_bytes == path.stat().st_size - header.data_start == 64 * 512 * 2
    assert cost.head_parameters == 64 * 512 and cost.body_parameters == 0
    # Another quant of the repository, half the size: half the bytes per step.
    other = cost.for_file_size(header, path.stat().st_size,
                               header.data_start + (path.stat().st_size - header.data_start) // 2)
    assert other.step_bytes == cost.step_bytes // 2 and other.attention == cost.attention


def test_prediction_scales_the_measured_engine_by_bytes_and_flops() -> None:
    measured = fake_speed(LLAMA_CPP, decode_tok_s=100.0)  # 100 MB a step at 100 tok/s
    model = ModelCost(parameters=10**9, body_parameters=5 * 10**8, head_parameters=10**8,
                      step_bytes=400_000_000, attention=34560 * 2, context_length=8192)
    got = predict(model, measured)
    assert got.engine == LLAMA_CPP
    assert got.decode_tok_s == pytest.approx(25.0)  # 4 x the bytes: a quarter of the rate
    a, b, d = measured.prefill_line
    # 2 x 5e8 FLOPs a token where the bundled model had 2e8: a x 5; twice its attention: b x 2
    assert got.prompt_s == pytest.approx(d + a * 4000 * 5 + b * 4000**2 / 2 * 2)
    assert got.text().startswith("~25 tok/s, 4,000-token prompt ~")
    # Cached tokens are not read; later ones attend deeper.
    assert prompt_seconds(model, measured, 3000, 1000) == pytest.approx(
        d + a * 2000 * 5 + b * (3000**2 - 1000**2) / 2 * 2)
    short = replace(model, context_length=2048)
    assert predict(short, measured).prompt_s is None
    assert "over its context" in predict(short, measured).text()
    # On torch the bytes are its kernel's, per weight: 100 MB / 134 M weights measured.
    on_torch = predict(model, fake_speed(TORCH))
    assert on_torch.decode_tok_s == pytest.approx(100.0 * 134 / 600, rel=1e-3)


def test_the_measurement_is_taken_once_per_machine_and_engine_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measure = CountingMeasure()
    profiles = SpeedProfiles(tmp_path, measure=measure)
    assert profiles.cached(LLAMA_CPP) is None
    first = profiles.get(LLAMA_CPP)
    assert profiles.get(LLAMA_CPP) == first  # cached
    assert SpeedProfiles(tmp_path, measure=measure).get(LLAMA_CPP) == first  # on disk
    assert measure.calls == [LLAMA_CPP]
    assert profiles.get(TORCH).engine == TORCH and measure.calls == [LLAMA_CPP, TORCH]
    again = profiles.get(LLAMA_CPP, again=True)  # the user asked to measure again
    assert again.when == "call 3" and profiles.cached(LLAMA_CPP) == again
    # Another build of the engine (or CPU, or thread count) is another machine.
    monkeypatch.setattr(speed, "engine_build", lambda engine: f"{engine} 9.9")
    assert profiles.cached(LLAMA_CPP) is None
    profiles.get(LLAMA_CPP)
    assert len(measure.calls) == 4


def test_what_replies_measured_is_kept_per_file_beside_the_prediction(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    store = MeasuredSpeeds(tmp_path / "cache")
    assert store.get(model, LLAMA_CPP) is None
    for decode_ms, output, cached, read in [(10, 41, 0, 200), (20, 21, 200, 100),
                                            (10, 3, 0, 10)]:
        store.add(model, LLAMA_CPP, _metrics(decode_ms, output, cached, read))
    got = store.get(model, LLAMA_CPP)
    assert got is not None and got.replies == 3
    assert got.decode_tok_s == pytest.approx(75.0)  # the median of 100 and 50 (3 tokens: out)
    assert got.reads == ((0, 200, pytest.approx(0.4)), (200, 300, pytest.approx(0.2)))
    assert got.prefill_tok_s == pytest.approx(500.0)
    assert store.get(model, TORCH) is None  # another engine is another figure
    priced = ModelSpeed(ModelCost(1, 10**8, 0, 10**8, 34560, 8192), fake_speed(LLAMA_CPP))
    assert priced.prediction().decode_tok_s == pytest.approx(100.0)
    line = priced.versus(got)
    assert line.startswith("decode predicted ~100 tok/s, measured 75 (x0.75); prompts (~")
    predicted = 300 / (priced.prompt_s(200) + priced.prompt_s(300, 200))
    assert f"predicted ~{predicted:,.0f} tok/s, measured 500 (x{500 / predicted:.2f})" in line


def _metrics(decode_ms: float, output: int, cached: int, read: int) -> object:
    """A reply's metrics: `output` tokens decode_ms apart; `read` prompt tokens at 2 ms."""
    ns = 1_000_000
    start = 10 * ns
    first = start + read * 2 * ns
    tl = RequestTimeline(submitted_ns=0, prefill_start_ns=start, first_logits_ns=first,
                         token_ns=[first + int(i * decode_ms * ns) for i in range(output)])
    tl.done_ns = tl.token_ns[-1]
    return compute_metrics(tl, prompt_tokens=cached + read, cached_tokens=cached,
                           parameters=1, weight_bytes_per_step=1, cache_miss_reason="none")


def test_measuring_runs_the_engine_in_a_child_and_fits_its_prompt_line(
        tiny_model_dir: Path) -> None:
    """The real measurement, small: the tiny model on torch, three short prompts."""
    got = speed.measure_engine(TORCH, "cpu", spec=str(tiny_model_dir), lengths=(16, 32, 64),
                               decode=(8, 9))
    assert got.engine == TORCH and got.model.startswith(tiny_model_dir.name)
    assert [n for n, _s in got.prefill_points] == [16, 32, 64]
    assert all(s > 0 for _n, s in got.prefill_points)
    a, b, d = got.prefill_line
    assert a > 0 and b >= 0 and d >= 0
    assert got.decode_tok_s > 0 and got.bandwidth_gb_s > 0 and got.decode_bytes > 0
    assert got.attention > 0 and got.prompt_flops_per_token > 0
    assert "decode" in got.describe() and "GB/s" in got.describe()


def test_a_measurement_taken_busy_is_taken_again_once_the_machine_is_idle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    busy = replace(fake_speed(), loadavg=4.2)
    assert busy.busy and "busy then (load 4.2)" in busy.describe()
    monkeypatch.setattr(speed, "_loadavg", lambda: 3.0)
    assert not busy.worth_measuring_again()  # still busy: another try would say no more
    monkeypatch.setattr(speed, "_loadavg", lambda: 0.4)
    assert busy.worth_measuring_again()
    assert not fake_speed().worth_measuring_again()  # taken idle: kept for good
