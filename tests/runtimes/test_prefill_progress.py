"""Progress from inside a prefill chunk: the reporter's bounds and throttle, and torch's
decoder-layer hooks (llama.cpp's graph meter: tests/runtimes/test_llamacpp_engine.py; each
architecture's layers: tests/runtimes/test_architectures.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from engine.core import prefill_progress
from engine.core.prefill_progress import PrefillReporter
from engine.events import PrefillProgress
from engine.runtimes.torch.generate import ChunkedPrefill
from engine.runtimes.torch.layer_progress import LayerProgress, decoder_layers
from engine.runtimes.torch.loader import LoadedModel, load_model
from engine.runtimes.torch.prefix_cache import PrefixCache


@pytest.fixture
def every_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """No interval between progress events within a chunk: each one is seen."""
    monkeypatch.setattr(prefill_progress, "WITHIN_CHUNK_NS", 0)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir))


def test_within_a_chunk_reports_its_share_but_never_its_end(every_report: None) -> None:
    events: list[PrefillProgress] = []
    reporter = PrefillReporter("r", 100, events.append)
    reporter.within(0, 64, 0.5)
    reporter.within(0, 64, 0.25)  # behind what was said: nothing
    reporter.within(0, 64, 1.0)  # the chunk's end is chunk_done's
    reporter.chunk_done(64)
    reporter.within(64, 36, 0.0)  # no further than the chunk's start: nothing
    reporter.within(64, 36, 2.0)
    reporter.chunk_done(100)
    assert [e.done_tokens for e in events] == [32, 63, 64, 99, 100]
    assert {(e.request_id, e.total_tokens) for e in events} == {("r", 100)}
    assert [e.t_ns for e in events] == sorted(e.t_ns for e in events)
    assert events[-1].eta_s == 0.0 and events[-1].fraction == 1.0


def test_within_a_chunk_waits_out_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefill_progress, "WITHIN_CHUNK_NS", 1 << 62)
    events: list[PrefillProgress] = []
    reporter = PrefillReporter("r", 10, events.append)
    for fraction in (0.2, 0.5, 0.9):
        reporter.within(0, 10, fraction)
    reporter.chunk_done(10)  # a chunk's end is always said
    assert [e.done_tokens for e in events] == [10]


@torch.inference_mode()
def test_a_torch_chunk_reports_after_each_decoder_layer(tiny: LoadedModel,
                                                        every_report: None) -> None:
    layers = tiny.model.config.num_hidden_layers
    assert len(decoder_layers(tiny.model)) == layers == 2
    events: list[PrefillProgress] = []
    lease = PrefixCache(tiny.model.config, budget_bytes=1 << 30).cold_lease(None)
    ids = [3 + i % 50 for i in range(40)]
    logits = ChunkedPrefill(tiny, lease, ids, "r", events.append).run(16, threading.Event())
    assert logits is not None and lease.ids == ids
    # chunks 0-16, 16-32, 32-40: half the tokens after layer 1, all but the last after layer 2
    assert [e.done_tokens for e in events] == [8, 15, 16, 24, 31, 32, 36, 39, 40]
    # the hooks are gone with the prefill: a forward reports nothing
    tiny.model(input_ids=torch.tensor([ids[:4]]))
    assert len(events) == 9


@torch.inference_mode()
def test_layer_hooks_count_only_the_thread_that_installed_them(tiny: LoadedModel) -> None:
    """A prompt prefilled beside streaming rows shares the model with the engine thread."""
    seen: list[float] = []
    ids = torch.tensor([[5, 6, 7, 8]])

    def forward_elsewhere() -> None:
        with torch.inference_mode():  # a thread's own mode
            tiny.model(input_ids=ids)

    with LayerProgress(decoder_layers(tiny.model), seen.append):
        other = threading.Thread(target=forward_elsewhere)
        other.start()
        other.join()
        assert seen == []
        tiny.model(input_ids=ids)
    assert seen == [0.5, 1.0]
