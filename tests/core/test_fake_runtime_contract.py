"""The runner contract on a third runtime written only against the core's protocols
(tests/support/fake_runtime.py): the checks torch and llama.cpp pass, unchanged, and a chat
that resumes from a snapshot on disk through the core's ledger."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.params import Speculative
from tests.support.runner_checks import CHECKS, RunnerKit, fake_kit


@pytest.fixture
def kit(tiny_model_dir: Path) -> RunnerKit:
    from transformers import AutoTokenizer

    return fake_kit(AutoTokenizer.from_pretrained(tiny_model_dir))


@pytest.mark.parametrize("name", list(CHECKS))
def test_a_third_runtime_keeps_the_contract(name: str, kit: RunnerKit) -> None:
    with torch.inference_mode():
        CHECKS[name](kit)


def test_a_third_runtime_resumes_a_chat_from_disk(kit: RunnerKit, tmp_path: Path) -> None:
    """The ledger's snapshots need nothing of a runtime but KvStore.export and restore."""
    from engine.core.ledger import KvLedger
    from engine.core.snapshots import KvShelf
    from tests.support.fake_runtime import FakeKvStore

    first = kit.pool
    first.shelf = KvShelf(tmp_path, "fake")
    lease = first.acquire("chat", kit.prompt[:40])
    kit.runner.forward(lease, kit.prompt[:40], 1)
    first.release(lease)
    while first.shelve_one():
        pass
    first.shelf.close(10)
    again: KvLedger = KvLedger(FakeKvStore(), budget_bytes=1 << 30)
    again.shelf = KvShelf(tmp_path, "fake")
    restored = again.acquire("chat", kit.prompt[:50])
    assert (restored.miss_reason, restored.cached_tokens) == ("restored_from_disk", 40)
    warm = kit.runner.forward(restored, kit.prompt[40:50], 1)
    cold = again.cold_lease("cold")
    assert torch.equal(warm, kit.runner.forward(cold, kit.prompt[:50], 1))
    again.shelf.close(10)


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_the_plain_step_time_is_a_moving_average_a_drafted_step_leaves_alone(
        kit: RunnerKit, speculative: Speculative | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch's plain decode step time (what sizes the prompt chunks riding in its steps)
    is the first step's, then 0.7 of the last average and 0.3 of the new step; a step that
    verified a draft costs more than a plain one and is left out. The clock is the batch's own
    (engine/core/batch.py's now_ns), stepped by hand: first logits, then two steps' ends."""
    from engine.core import batch as batch_module
    from engine.core.reply import DetachedJob
    from engine.events import GenerationResult
    from engine.params import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = kit.prompt[20:44]
    said: list[int] = []

    def done(_job: object, result: GenerationResult | None, _error: object) -> None:
        assert result is not None
        said.extend(result.token_ids)

    alone = kit.batcher(lambda _job, _event: None, done, None)
    alone.admit([DetachedJob(GenerationRequest([], params, prompt_token_ids=first,
                                               reuse_cache=False))])
    while alone.rows:
        alone.step()
    prompt = first + said[:4] + first  # continued with `said` again: prompt lookup drafts

    clock = iter([0, 0, 2_000_000, 10_000_000, 14_000_000])
    monkeypatch.setattr(batch_module, "now_ns", lambda: next(clock))
    batcher = kit.batcher(lambda _job, _event: None, lambda *_: None, None)
    batcher.admit([DetachedJob(GenerationRequest([], params, prompt_token_ids=prompt,
                                                 reuse_cache=False, speculative=speculative))])
    row = batcher.rows[0]
    batcher.step()
    if speculative is None:
        assert batcher._decode_step_s == pytest.approx(0.002)
        batcher.step()
        assert batcher._decode_step_s == pytest.approx(0.7 * 0.002 + 0.3 * 0.004)
    else:
        assert row.spec.proposed > 0
        assert batcher._decode_step_s == 0.0
