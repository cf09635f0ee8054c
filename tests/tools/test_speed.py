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
    EngineSpeed,
    MeasuredSpeeds,
    ModelCost,
    ModelSpeed,
    SpeedProfiles,
    main_type,
    predict,
    prompt_seconds,
    time_prompt_types,
)
from tests.support.child import needs_llama_cpp, run_in_child
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


def test_a_gguf_names_its_body_matrices_types(tmp_path: Path) -> None:
    """The bundled file: its body in Q4_1, its tied table (Q8_0) no part of the body."""
    from engine.model_files import default_gguf_path

    cost = ModelCost.from_gguf_file(default_gguf_path())
    assert [t for t, _n in cost.body_types] == ["Q4_1"]
    assert cost.body_types[0][1] == cost.body_parameters - sum(  # all but the norms' vectors
        n for name, dims in read_gguf(default_gguf_path()).tensor_dims.items()
        if len(dims) == 1 for n in dims)
    untied = ModelCost.from_gguf_file(write_gguf(tmp_path / "u.gguf", layers=2, kv_heads=2,
                                                 untied=True))
    assert untied.body_types == (("F16", 2 * 512 * 512),)  # not the F32 head, not the table


def test_a_prompt_is_priced_by_its_weight_types_against_the_measured_models() -> None:
    """On llama.cpp a prompt's matrices cost each type's own time per FLOP: the bundled model's
    matrices (at its type's rate) come out of its per-token time, the rest scales by FLOPs, and
    the model's matrices go in at their types' rates. Types not timed: FLOPs alone."""
    measured = replace(fake_speed(LLAMA_CPP), prompt_type_s=(("Q4_1", 5e-12), ("Q4_K", 2.5e-12),
                                                             ("Q6_K", 4e-12)),
                       model_types=(("Q4_1", 10**8),))
    model = ModelCost(parameters=10**9, body_parameters=5 * 10**8, head_parameters=10**8,
                      step_bytes=400_000_000, attention=34560, context_length=8192,
                      body_types=(("Q4_K", 4 * 10**8), ("Q6_K", 10**8)))
    a, b, d = measured.prefill_line  # a: 2 ms a token, 1 ms of it the bundled Q4_1 matrices
    assert measured.matmul_s(measured.model_types) == pytest.approx(0.001)
    matrices = 2 * 4e8 * 2.5e-12 + 2 * 1e8 * 4e-12  # 2.8 ms
    per_token = (a - 0.001) * 5 + matrices  # 5 x the bundled model's FLOPs
    assert prompt_seconds(model, measured, 4000) == pytest.approx(
        d + per_token * 4000 + b * 4000**2 / 2)
    flops_alone = d + a * 5 * 4000 + b * 4000**2 / 2
    untimed = replace(model, body_types=(("Q4_K", 4 * 10**8), ("IQ2_XS", 10**8)))
    assert prompt_seconds(untimed, measured, 4000) == pytest.approx(flops_alone)
    folder = replace(model, body_types=())  # a Hugging Face folder: FLOPs alone
    assert prompt_seconds(folder, measured, 4000) == pytest.approx(flops_alone)
    on_torch = replace(measured, prompt_type_s=())
    assert prompt_seconds(model, on_torch, 4000) == pytest.approx(flops_alone)
    # The types survive the cache file's round trip; an older entry without them reads as
    # untimed.
    assert EngineSpeed.from_dict(measured.to_dict()) == measured
    older = {k: v for k, v in measured.to_dict().items()
             if k not in ("prompt_type_s", "model_types")}
    assert prompt_seconds(model, EngineSpeed.from_dict(older), 4000) == pytest.approx(
        flops_alone)


def test_another_quant_of_a_repository_takes_the_type_its_name_says(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "u.gguf", layers=2, kv_heads=2, untied=True)
    header, size = read_gguf(path), path.stat().st_size
    cost = ModelCost.from_gguf_file(path)
    other = cost.for_file_size(header, size, size, "Q4_K_M")
    assert other.body_types == (("Q4_K", 2 * 512 * 512),)
    assert cost.for_file_size(header, size, size).body_types == ()  # its name says none
    assert [main_type(q) for q in ("Q4_K_M", "q5_k_s", "Q3_K_L", "Q8_0", "IQ4_XS", "BF16",
                                   "Q6_K")] == [
        "Q4_K", "Q5_K", "Q3_K", "Q8_0", "IQ4_XS", "BF16", "Q6_K"]


def _time_two_types() -> list[tuple[str, float]]:
    # rows of 320: Q4_0's blocks of 32 fit, Q4_K's 256 do not (llama.cpp stores it otherwise)
    return time_prompt_types(("Q4_0", "Q4_K", "Q8_0"), shape=(320, 512, 1), tokens=64)


@needs_llama_cpp
def test_each_weight_types_prompt_is_timed_on_a_synthetic_model() -> None:
    timed = dict(run_in_child(_time_two_types))
    assert set(timed) == {"Q4_0", "Q8_0"}  # Q4_K could not be stored as itself: left out
    assert all(0 < s < 1e-6 for s in timed.values())  # seconds per FLOP


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
