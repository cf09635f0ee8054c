"""The runner contract on a third runtime written only against the core's protocols
(tests/support/fake_runtime.py): the checks torch and llama.cpp pass, unchanged, and a chat
that resumes from a snapshot on disk through the core's ledger."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
