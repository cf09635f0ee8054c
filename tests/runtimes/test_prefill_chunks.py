"""Chunked prefill: the same logits and reply as one pass, progress after each chunk, Stop
within one chunk, and streaming rows that keep decoding between another prompt's chunks."""

from __future__ import annotations

import itertools
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import (
    EngineEvent,
    GenerationRequest,
    GenerationResult,
    PrefillProgress,
    SamplingParams,
    TokenEmitted,
)
from engine.core import prefill_progress
from engine.core.reply import DetachedJob, ReplyJob
from engine.metrics import RequestTimeline, now_ns
from engine.runtimes.torch.batching import Batcher
from engine.runtimes.torch.generate import ChunkedPrefill, DecodeSession
from engine.runtimes.torch.loader import LoadedModel, load_model
from engine.runtimes.torch.prefix_cache import PrefixCache
from engine.runtimes.torch.runtime import TorchRuntime
from ui.session import PromptReading

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(autouse=True)
def progress_at_chunk_ends_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count the events at chunk ends; a slow moment must not add one from inside
    a chunk (those have their own tests: tests/runtimes/test_prefill_progress.py)."""
    monkeypatch.setattr(prefill_progress, "WITHIN_CHUNK_NS", 1 << 62)


@pytest.fixture(scope="module")
def sharp(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny model with its layer weights scaled up, so its greedy reply depends on the
    whole context (the plain tiny model repeats one token)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("sharp-prefill")
    shutil.copytree(tiny_model_dir, folder, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() == 2 and "embed" not in name:
                weight.mul_(8.0)
    model.save_pretrained(folder)
    return load_model(str(folder))


def prompt(loaded: LoadedModel, n: int, offset: int = 0) -> list[int]:
    vocab = loaded.model.config.vocab_size
    return [(7 * i + 3 + offset) % (vocab - 3) + 3 for i in range(n)]


def pool(loaded: LoadedModel) -> PrefixCache:
    return PrefixCache(loaded.model.config, budget_bytes=1 << 30)


def run(loaded: LoadedModel, ids: list[int], chunk: int, cache: PrefixCache | None = None,
        cancel: threading.Event | None = None, events: list | None = None,
        conversation: str | None = None) -> GenerationResult:
    request = GenerationRequest([], GREEDY, prompt_token_ids=ids, conversation_id=conversation)
    session = DecodeSession(loaded, cache or pool(loaded), prefill_chunk=chunk)
    sink = events if events is not None else []
    return session.run(request, RequestTimeline(now_ns()), cancel or threading.Event(),
                       sink.append)


@torch.inference_mode()
def test_chunked_prefill_logits_match_one_pass(sharp: LoadedModel) -> None:
    ids = prompt(sharp, 150)
    logits = {}
    for chunk in (len(ids), 64, 17, 1):
        lease = pool(sharp).cold_lease(None)
        prefill = ChunkedPrefill(sharp, lease, ids, "r", lambda _e: None)
        logits[chunk] = prefill.run(chunk, threading.Event())
        assert lease.ids == ids and lease.cache.get_seq_length() == len(ids)
    one_pass = logits.pop(len(ids))
    for chunk, got in logits.items():
        torch.testing.assert_close(got, one_pass, rtol=1e-4, atol=1e-4, msg=f"chunk {chunk}")


def test_chunked_prefill_gives_the_same_greedy_reply(sharp: LoadedModel) -> None:
    ids = prompt(sharp, 150)
    one_pass = run(sharp, ids, chunk=len(ids))
    assert len(set(one_pass.token_ids)) > 1, "the reply depends on the context"
    for chunk in (64, 17):
        assert run(sharp, ids, chunk=chunk).token_ids == one_pass.token_ids


def test_progress_after_each_chunk_then_tokens(sharp: LoadedModel) -> None:
    ids = prompt(sharp, 100)
    events: list[Any] = []
    result = run(sharp, ids, chunk=16, events=events)
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    assert [p.done_tokens for p in progress] == [16, 32, 48, 64, 80, 96, 100]
    assert {p.total_tokens for p in progress} == {100}
    assert all(p.tok_s > 0 for p in progress)
    assert progress[-1].eta_s == 0.0 and progress[-1].fraction == 1.0
    first_token = next(i for i, e in enumerate(events) if isinstance(e, TokenEmitted))
    assert events.index(progress[-1]) < first_token
    assert result.metrics.prefilled_tokens == 100


def test_only_uncached_tokens_are_prefilled_and_counted(sharp: LoadedModel) -> None:
    cache = pool(sharp)
    ids = prompt(sharp, 90)
    run(sharp, ids[:60], chunk=16, cache=cache, conversation="c")
    events: list[Any] = []
    result = run(sharp, ids, chunk=16, cache=cache, conversation="c", events=events)
    assert result.metrics.cached_tokens == 60
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    assert [(p.done_tokens, p.total_tokens) for p in progress] == [(16, 30), (30, 30)]


def test_stop_during_prefill_takes_effect_within_one_chunk(sharp: LoadedModel) -> None:
    cache = pool(sharp)
    ids = prompt(sharp, 120)
    cancel = threading.Event()
    events: list[Any] = []

    def emit(event: EngineEvent) -> None:
        events.append(event)
        if isinstance(event, PrefillProgress):
            cancel.set()  # Stop pressed while the first chunk ran

    request = GenerationRequest([], GREEDY, prompt_token_ids=ids, conversation_id="c")
    session = DecodeSession(sharp, cache, prefill_chunk=32)
    result = session.run(request, RequestTimeline(now_ns()), cancel, emit)

    assert result.finish_reason == "cancelled" and result.token_ids == []
    assert [e.done_tokens for e in events if isinstance(e, PrefillProgress)] == [32]
    assert not any(isinstance(e, TokenEmitted) for e in events)
    m = result.metrics  # what it read, and for how long: not the whole prompt, not 0 s
    assert (m.prompt_tokens, m.cached_tokens, m.prefilled_tokens) == (120, 0, 32)
    assert not m.prefill_complete and m.prefill_s > 0 and m.ttft_s == 0
    # The chunk that ran stays cached: asking again resumes after it.
    again = run(sharp, ids, chunk=32, cache=cache, conversation="c")
    assert again.metrics.cached_tokens == 32
    assert again.metrics.prefill_complete and again.metrics.prefilled_tokens == 120 - 32
    assert again.token_ids == run(sharp, ids, chunk=len(ids)).token_ids


# ----- the batcher: decode rows are not starved by another prompt's prefill -------------------
class Recorder:
    """The batcher's emit and done callbacks: every event in order, every result."""

    def __init__(self) -> None:
        self.events: list[EngineEvent] = []
        self.results: dict[str, GenerationResult] = {}

    def emit(self, _job: ReplyJob, event: EngineEvent) -> None:
        self.events.append(event)

    def done(self, job: ReplyJob, result: GenerationResult | None,
             error: BaseException | None) -> None:
        assert error is None, error
        assert result is not None
        self.results[job.request.request_id] = result


def job(ids: list[int], max_tokens: int) -> DetachedJob:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return DetachedJob(GenerationRequest([], params, prompt_token_ids=ids, reuse_cache=False))


def stream_then_join(loaded: LoadedModel, batcher: Batcher) -> tuple[DetachedJob, DetachedJob]:
    """Row A streams for three steps; then B's 180-token prompt joins; steps until all end."""
    a, b = job(prompt(loaded, 20), max_tokens=40), job(prompt(loaded, 180, 5), max_tokens=8)
    batcher.admit([a])
    for _ in range(3):
        batcher.step()
    batcher.admit([b])
    while batcher.rows:
        batcher.step()
    return a, b


def stream_then_long_prompt(loaded: LoadedModel, interleave: bool) -> tuple[Recorder, str, str]:
    """Row A streams; then B's 180-token prompt joins. Returns the recorder and both ids."""
    rec = Recorder()
    batcher = Batcher(loaded, pool(loaded), rec.emit, rec.done, prefill_chunk=64,
                      interleave=interleave, step_token_budget=40)
    a, b = stream_then_join(loaded, batcher)
    return rec, a.request.request_id, b.request.request_id


def test_streaming_row_decodes_between_prefill_chunks(sharp: LoadedModel) -> None:
    rec, a, b = stream_then_long_prompt(sharp, interleave=True)
    progress = [i for i, e in enumerate(rec.events)
                if isinstance(e, PrefillProgress) and e.request_id == b]
    assert len(progress) == 5  # 180 tokens in chunks of 40 - 1 streaming row
    for start, end in itertools.pairwise(progress):
        between = rec.events[start:end]
        assert any(isinstance(e, TokenEmitted) and e.request_id == a for e in between)
    # Interleaving changes the schedule, never the output.
    ref, ref_a, ref_b = stream_then_long_prompt(sharp, interleave=False)
    assert rec.results[a].token_ids == ref.results[ref_a].token_ids
    assert rec.results[b].token_ids == ref.results[ref_b].token_ids
    assert rec.results[b].token_ids == run(sharp, prompt(sharp, 180, 5), 1000).token_ids[:8]


def test_without_interleaving_the_stream_waits_for_the_whole_prefill(sharp: LoadedModel) -> None:
    rec, a, b = stream_then_long_prompt(sharp, interleave=False)
    progress = [i for i, e in enumerate(rec.events)
                if isinstance(e, PrefillProgress) and e.request_id == b]
    assert len(progress) == 3  # 180 tokens in whole chunks of 64
    between = rec.events[progress[0]:progress[-1]]
    assert not any(isinstance(e, TokenEmitted) and e.request_id == a for e in between)


def test_cancel_during_a_batched_prefill(sharp: LoadedModel) -> None:
    rec = Recorder()
    long = job(prompt(sharp, 150), max_tokens=8)

    def emit(j: ReplyJob, event: EngineEvent) -> None:
        rec.emit(j, event)
        if isinstance(event, PrefillProgress):
            long.cancel.set()  # Stop pressed while the first chunk ran

    batcher = Batcher(sharp, pool(sharp), emit, rec.done, prefill_chunk=32)
    batcher.admit([long])
    result = rec.results[long.request.request_id]
    assert result.finish_reason == "cancelled" and result.token_ids == []
    assert sum(isinstance(e, PrefillProgress) for e in rec.events) == 1
    assert not batcher.rows
    m = result.metrics  # the one chunk read before Stop
    assert (m.prompt_tokens, m.prefilled_tokens, m.prefill_complete) == (150, 32, False)
    assert m.prefill_s > 0


def test_interference_bench_reports_both_modes(sharp: LoadedModel) -> None:
    from engine.tools.bench import bench_interference

    r = bench_interference(TorchRuntime(sharp), prompt_tokens=150, stream_prompt_tokens=16,
                           alone_tokens=6)
    assert r["one_pass_stream_tokens_during_prefill"] == 1  # one gap spans the whole prefill
    assert r["chunked_stream_tokens_during_prefill"] >= 2
    assert r["modes"] == ["one_pass", "chunked", "beside"]  # torch on a CPU: a side thread
    for mode in r["modes"]:
        assert r[f"{mode}_itl_p99_ratio"] == pytest.approx(
            r[f"{mode}_itl_p99_during_prefill_s"] / r[f"{mode}_itl_p99_alone_s"])
        assert r[f"{mode}_itl_p99_before_prefill_s"] > 0


def test_interference_bench_has_no_beside_row_without_a_core_to_spare(
        sharp: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.runtimes.torch import side_prefill
    from engine.tools.bench import interference_modes

    monkeypatch.setattr(side_prefill, "allowed_cpus", lambda: 1)
    assert interference_modes(TorchRuntime(sharp)) == ("one_pass", "chunked")
    monkeypatch.setattr(side_prefill, "allowed_cpus", lambda: 4)
    assert interference_modes(TorchRuntime(sharp)) == ("one_pass", "chunked", "beside")


def test_interference_baseline_is_the_same_tokens_streamed_alone(sharp: LoadedModel) -> None:
    """The stream's own context grows while the prompt is read, so its baseline is its own
    gaps at the same positions in a run with no prompt, one for each gap during the prefill."""
    from engine.tools.bench import _interference_run

    run = _interference_run(TorchRuntime(sharp), "chunked", prompt(sharp, 16),
                            prompt(sharp, 150, 16), 6)
    assert len(run["before"]) == 6
    assert len(run["during"]) >= 2
    assert len(run["alone"]) == len(run["during"])
    assert min(run["alone"]) > 0



# ----- a long prompt prefilled beside the streaming rows, in a side thread ----------------------
SIDE_THREAD = "phasewise-side-prefill"


@pytest.fixture
def beside_on_two_cores(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The tiny model's prompts go beside from 100 tokens, with two cores to split whatever
    this machine has; yields the engine thread's intra-op threads before (restored after)."""
    from engine.runtimes.torch import side_prefill

    monkeypatch.setattr(side_prefill, "SIDE_MIN_TOKENS", 100)
    monkeypatch.setattr(side_prefill, "allowed_cpus", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


def stream_then_beside(loaded: LoadedModel, emit: Any, done: Any) -> tuple[Batcher, DetachedJob,
                                                                          DetachedJob]:
    """Row A streams; B's 180-token prompt joins beside it (chunks of 64); steps until A ends."""
    batcher = Batcher(loaded, pool(loaded), emit, done, prefill_chunk=64)
    a, b = stream_then_join(loaded, batcher)
    return batcher, a, b


def test_a_long_prompt_beside_the_stream_gives_the_same_replies(
        sharp: LoadedModel, beside_on_two_cores: int) -> None:
    rec, threads_seen = Recorder(), []

    def emit(j: ReplyJob, event: EngineEvent) -> None:
        threads_seen.append(threading.current_thread().name)
        rec.emit(j, event)

    batcher, a, b = stream_then_beside(sharp, emit, rec.done)
    assert batcher.side_prefills == 1
    assert torch.get_num_threads() == beside_on_two_cores  # the engine thread's, restored
    progress = [e for e in rec.events
                if isinstance(e, PrefillProgress) and e.request_id == b.request.request_id]
    done = [e.done_tokens for e in progress]  # chunks of at most 64, sized by the clock
    assert done[0] == 64 and done[-1] == 180 and len(done) >= 3 and done == sorted(set(done))
    assert SIDE_THREAD not in threads_seen  # every event from the engine thread
    # The schedule changes, never the output: both replies are the ones between the steps.
    ref, ref_a, ref_b = stream_then_long_prompt(sharp, interleave=False)
    assert rec.results[a.request.request_id].token_ids == ref.results[ref_a].token_ids
    assert rec.results[b.request.request_id].token_ids == ref.results[ref_b].token_ids


def in_side_thread(loaded: LoadedModel, action: Any) -> Any:
    """A forward hook that runs action() whenever the side thread runs the model."""
    def hook(*_args: Any) -> None:
        if threading.current_thread().name == SIDE_THREAD:
            action()
    return loaded.model.register_forward_hook(hook)


def test_stop_beside_the_stream_takes_effect_within_one_chunk(
        sharp: LoadedModel, beside_on_two_cores: int) -> None:
    rec = Recorder()
    batcher = Batcher(sharp, pool(sharp), rec.emit, rec.done, prefill_chunk=64)
    a, b = job(prompt(sharp, 20), max_tokens=40), job(prompt(sharp, 180, 5), max_tokens=8)
    batcher.admit([a])
    handle = in_side_thread(sharp, b.cancel.set)  # Stop pressed while the first chunk runs
    try:
        batcher.admit([b])
    finally:
        handle.remove()
    result = rec.results[b.request.request_id]
    assert result.finish_reason == "cancelled" and result.token_ids == []
    assert [e.done_tokens for e in rec.events if isinstance(e, PrefillProgress)
            and e.request_id == b.request.request_id] == [64]
    m = result.metrics  # the side thread's one chunk, kept
    assert (m.prompt_tokens, m.prefilled_tokens, m.prefill_complete) == (180, 64, False)
    assert [r.job for r in batcher.rows] == [a]  # A streams on
    assert torch.get_num_threads() == beside_on_two_cores


def test_an_error_in_the_side_thread_fails_that_request_on_the_engine_thread(
        sharp: LoadedModel, beside_on_two_cores: int) -> None:
    rec, failed = Recorder(), {}

    def done(j: ReplyJob, result: GenerationResult | None, error: BaseException | None) -> None:
        if error is not None:
            failed[j.request.request_id] = (error, threading.current_thread().name)
        else:
            rec.done(j, result, error)

    def boom() -> None:
        raise RuntimeError("side forward failed")

    handle = in_side_thread(sharp, boom)
    try:
        _, a, b = stream_then_beside(sharp, rec.emit, done)
    finally:
        handle.remove()
    error, thread = failed[b.request.request_id]
    assert str(error) == "side forward failed" and thread != SIDE_THREAD
    assert len(rec.results[a.request.request_id].token_ids) == 40  # A was not disturbed
    assert torch.get_num_threads() == beside_on_two_cores

# ----- the reply placeholder -------------------------------------------------------------------
def progress_event(done: int, total: int, tok_s: float = 500.0) -> PromptReading:
    return PromptReading.of(PrefillProgress("r1", 0, done, total, tok_s, (total - done) / tok_s))


def test_placeholder_reads_the_prompt_then_writes(qtbot) -> None:
    from ui.chat_view import WRITING, ChatView, prefill_status

    view = ChatView()
    qtbot.addWidget(view)
    view.begin_stream("r1")
    assert view.status_text("r1") == WRITING

    view.show_reading("r1", progress_event(840, 2000, 420.0))
    assert view.status_text("r1") == "· Reading your prompt: 42% · 3 s left · 420 tok/s"
    assert "Reading your prompt: 42%" in view.toPlainText()
    view.show_reading("r1", progress_event(2000, 2000))
    assert view.status_text("r1") == "· Reading your prompt: 100%"

    view.push_token("r1", 0, "Hello")
    assert view.status_text("r1") == WRITING
    view.show_reading("r1", progress_event(2000, 2000))  # late: the reply is writing
    assert view.status_text("r1") == WRITING
    view.end_stream()
    assert view.toPlainText().endswith(f"Assistant {WRITING}\nHello")
    assert prefill_status(progress_event(0, 60_000, 400.0)) == \
        "· Reading your prompt: 0% · 2 min 30 s left · 400 tok/s"


def test_the_time_left_reads_the_same_in_the_chat_and_the_hud_without_flicker() -> None:
    from ui.chat_view import prefill_status
    from ui.hud.model import fmt_eta
    from ui.hud.panels import prefill_caption

    # A rate that wobbles between two chunks: past a minute, 10 s steps keep one label.
    wobble = [PromptReading.of(PrefillProgress("r1", 0, 2_000, 6_000, tok_s, 4_000 / tok_s))
              for tok_s in (25.5, 24.5)]  # 157 s and 163 s left
    assert {prefill_status(e).split(" · ")[1] for e in wobble} == {"2 min 40 s left"}
    assert all(prefill_caption(e).endswith(", 2 min 40 s left") for e in wobble)
    assert [fmt_eta(s) for s in (0.4, 3.2, 42.4, 59.6, 120, 604, 3_000)] == \
        ["under 1 s", "3 s", "42 s", "60 s", "2 min", "10 min", "50 min"]


# ----- the HUD's live view ---------------------------------------------------------------------
def test_hud_draws_the_prefill_while_the_prompt_is_read(qtbot) -> None:
    from engine.events import PrefillStarted, RequestQueued
    from ui.hud.widget import HudWidget

    hud = HudWidget(calibrate=False)
    qtbot.addWidget(hud)
    ms = 1_000_000
    for event in (RequestQueued("r1", 0), PrefillStarted("r1", 10 * ms, 2000, 0, "first_turn")):
        hud.on_engine_event(event)
    hud.show_reading("r1", PromptReading.of(
        PrefillProgress("r1", 2010 * ms, 840, 2000, 420.0, 1160 / 420)))
    hud.flush()

    panel = hud.panels["breakdown"]
    assert "reading the prompt: 42% (840 / 2,000 tokens) at 420 tok/s" in panel.caption.text()
    assert hud.advice_label.text().startswith("Live: reading the prompt: 42%")
    widths = {phase: bar.opts["width"][0] for phase, bar in panel._bars.items()}
    assert widths["queue"] == pytest.approx(0.010) and widths["prefill"] == pytest.approx(2.0)
    assert panel._prefill_left.opts["width"][0] == pytest.approx(1160 / 420)

    hud.on_engine_event(TokenEmitted("r1", 4800 * ms, 0, 5, "Hi"))
    hud.flush()
    assert "reading the prompt" not in panel.caption.text()
    assert panel._prefill_left.opts["width"][0] == 0


def test_a_reply_stopped_while_its_prompt_is_read_shows_that_prefill(qtbot) -> None:
    """Stopped at 30% of a long prompt: its time after the queue was prefill, cut short (it
    read as "other: first sample + finish" and the advisor saw no dominant phase), and it read
    what the engine kept (1,792 tokens: whole chunks), not the whole prompt."""
    from engine.events import GenerationResult, PrefillStarted, RequestFinished, RequestQueued
    from engine.metrics import compute_metrics
    from tests.support.hud_events import INFO, MS
    from ui.hud.widget import HudWidget

    hud = HudWidget(calibrate=False)
    qtbot.addWidget(hud)
    timeline = RequestTimeline(submitted_ns=0)
    timeline.prefill_start_ns, timeline.done_ns = 2 * MS, 20_000 * MS  # no first logits
    metrics = compute_metrics(timeline, prompt_tokens=6_000, cached_tokens=20,
                              parameters=INFO.parameters,
                              weight_bytes_per_step=INFO.weight_bytes_per_step,
                              cache_miss_reason="first_turn", prefilled_tokens=1_792)
    result = GenerationResult("r1", "", "cancelled", [], list(range(6_000)), metrics, INFO)
    for event in (RequestQueued("r1", 0), PrefillStarted("r1", 2 * MS, 6_000, 20, "first_turn")):
        hud.on_engine_event(event)
    hud.show_reading("r1", PromptReading.of(
        PrefillProgress("r1", 19_500 * MS, 1_800, 5_980, 92.0, 45.0)))
    hud.on_engine_event(RequestFinished("r1", 20_000 * MS, result))
    hud.flush()

    rows = {phase: (detail, seconds) for phase, detail, seconds, _share
            in hud.selected_reply().breakdown().rows()}
    assert rows["prefill"] == ("1,792 of 5,980 new prompt tokens read before Stop (30%), "
                               "20 cached", pytest.approx(19.998))
    assert rows["other"][1] == pytest.approx(0.0)
    assert hud.advice_text().startswith("Stopped while reading the prompt, after 20 s of "
                                        "prefill: 1,792 of 5,980 new prompt tokens read")
    assert "reading the prompt: " not in hud.panels["breakdown"].caption.text()


def test_a_new_chats_prefill_shows_no_other_chats_numbers_and_an_unclipped_marker(
        qtbot) -> None:
    """A long prompt pasted into a new chat after another chat's replies: the per-turn
    panels drop that chat's range and TTFT percentiles, and the settings marker before turn 1
    is labelled inside the plot (it was drawn off the left edge, clipped)."""
    from engine.events import PrefillStarted, RequestQueued
    from tests.support.hud_events import MS, ReplySpec, loaded_event, reply_events
    from ui.hud import style
    from ui.hud.model import SavedChat
    from ui.hud.widget import HudWidget

    hud = HudWidget(calibrate=False)
    qtbot.addWidget(hud)
    hud.resize(420, 900)
    for key in ("itl", "throughput", "breakdown"):  # the two per-turn panels in view
        hud.set_panel_visible(key, False)
    hud.show()
    qtbot.waitExposed(hud)
    hud.on_engine_event(loaded_event())
    hud.show_chat(SavedChat("chat-a", "A", []))
    for turn, start in enumerate((2_000, 7_000), start=1):
        for event in reply_events(ReplySpec(f"a{turn}", start * MS, 300, 0, 20)):
            hud.on_engine_event(event)
        hud.name_reply(f"a{turn}", "A", turn, chat_id="chat-a")
    hud.flush()
    assert "This chat's TTFT p50" in hud.panels["ttft"].caption.text()

    hud.show_chat(None)  # New chat; the reply cap is lowered; the long prompt is sent
    hud.mark_setting_change("max_tokens", 64, 20_000 * MS)
    hud.show_chat(SavedChat("chat-b", "B", []))
    for event in (RequestQueued("b1", 21_000 * MS),
                  PrefillStarted("b1", 21_001 * MS, 6_000, 0, "first_turn")):
        hud.on_engine_event(event)
    hud.show_reading("b1", PromptReading.of(
        PrefillProgress("b1", 24_000 * MS, 2_000, 6_000, 660.0, 4_000 / 660)))
    hud.name_reply("b1", "B", 1, chat_id="chat-b")
    hud.flush()

    ttft, cache = hud.panels["ttft"], hud.panels["cache"]
    assert "TTFT p50" not in ttft.caption.text()  # chat B has no finished reply yet
    assert cache.caption.text().endswith("Turn 1: 0 reused, 6,000 recomputed (miss: first turn).")
    for panel in (ttft, cache):
        area = panel.plot.getPlotItem().vb.sceneBoundingRect()
        [(_x, text, line)] = panel._markers
        assert text == "max_tokens=64" and line.label.isVisible()
        assert line.label.fill.color().name() == style.CARD  # readable where it crosses a bar
        label = line.label.sceneBoundingRect()
        assert area.left() - 1 <= label.left() and label.right() <= area.right() + 1, \
            (panel.key, area, label)


# ----- in the window ---------------------------------------------------------------------------
def test_window_shows_prompt_progress_then_the_reply_stats_line(qtbot, make_window,
                                                                monkeypatch) -> None:
    from engine.core.schedule import PREFILL_CHUNK_ENV

    monkeypatch.setenv(PREFILL_CHUNK_ENV, "8")  # several chunks even for a short prompt
    window = make_window()
    statuses: list[str] = []
    contexts: list[tuple[str, int]] = []
    # Connected after the window's own slots: sees the placeholder as they left it.
    window.bridge.sig_prefill_progress.connect(
        lambda e: statuses.append(window.chat.status_text(e.request_id)))
    window.bridge.sig_prefill_started.connect(  # the status bar's context gauge, at once
        lambda e: contexts.append((window.status.context_label.text(), e.prompt_tokens)))

    with qtbot.waitSignal(window.sig_reply_finished, timeout=60_000):
        assert window.send("The capital of France is Paris. Hello, how are you today?")

    [(gauge, prompt_tokens)] = contexts
    assert gauge.startswith(f"context {prompt_tokens:,} / ")  # a new chat: not "context 0"
    reading = [s for s in statuses if s.startswith("· Reading your prompt: ")]
    assert len(reading) >= 3 and reading[-1] == "· Reading your prompt: 100%"
    saved = [m for m in window.store.messages(window.conversation_id) if m.role == "assistant"]
    assert saved[-1].stats is not None and saved[-1].stats.engine == "torch"
    line = saved[-1].stats.summary()
    assert "s to first token" in line and line in window.chat.toPlainText()


def test_no_time_left_is_shown_until_the_clock_can_say_it(qtbot) -> None:
    """Issue 31 item 5: the chat and the HUD show no figure while eta_s is None (too little of
    the prompt read: engine.core.prefill_eta), and no 'left' bar in the live breakdown."""
    from engine.events import PrefillStarted, RequestQueued
    from ui.chat_view import prefill_status
    from ui.hud.panels import prefill_caption
    from ui.hud.widget import HudWidget

    early = PromptReading.of(PrefillProgress("r1", 2010 * 1_000_000, 90, 2000, 420.0, None))
    assert prefill_status(early) == "· Reading your prompt: 4% · estimating time left · 420 tok/s"
    assert prefill_caption(early).endswith("at 420 tok/s, estimating time left")
    hud = HudWidget(calibrate=False)
    qtbot.addWidget(hud)
    for event in (RequestQueued("r1", 0), PrefillStarted("r1", 10 * 1_000_000, 2000, 0,
                                                         "first_turn")):
        hud.on_engine_event(event)
    hud.show_reading("r1", early)
    hud.flush()
    panel = hud.panels["breakdown"]
    assert panel._prefill_left.opts["width"][0] == 0
    assert panel._bars["prefill"].opts["width"][0] == pytest.approx(2.0)
