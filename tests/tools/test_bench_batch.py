"""`bench --batch` times what it says: B rows decoding at once, every timed step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.core.batch import BatchCore
from engine.runtimes.torch.loader import load_model
from engine.runtimes.torch.runtime import TorchRuntime
from engine.tools.bench import bench_batch, bench_decode, run_ours


class CountingRuntime(TorchRuntime):
    """The tiny model's runtime, its batches noting how many rows each step decodes."""

    def __init__(self, folder: Path) -> None:
        super().__init__(load_model(str(folder)))
        self.rows_per_step: list[int] = []

    def new_batcher(self, *args: Any, **kwargs: Any) -> BatchCore:
        batcher = super().new_batcher(*args, **kwargs)
        step = batcher.step

        def counted() -> None:
            self.rows_per_step.append(len(batcher.rows))
            step()

        batcher.step = counted  # type: ignore[method-assign]  # a probe on one instance
        return batcher


def test_every_step_bench_batch_drives_decodes_all_b_rows(tiny_model_dir: Path) -> None:
    """A prompt long enough to be read in chunks between the rows' steps (the engine's own
    schedule) must not let the first row stream alone, nor its end leave one row stepping."""
    runtime = CountingRuntime(tiny_model_dir)
    report = bench_batch(runtime, batch_sizes=(1, 3), prompt_tokens=100, max_tokens=5,
                         rounds=1)
    assert runtime.rows_per_step == [1] * 4 + [3] * 4
    assert [row["steps_timed"] for row in report["batches"]] == [4, 4]


class PathRuntime(CountingRuntime):
    """The tiny model's runtime, noting which path each request ran on."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.alone = 0

    def new_session(self, *args: Any, **kwargs: Any) -> Any:
        self.alone += 1
        return super().new_session(*args, **kwargs)


def test_bench_decodes_a_plain_reply_on_the_path_the_app_takes(tiny_model_dir: Path) -> None:
    """The worker batches a plain reply (and a prompt-lookup one where drafts verify in the
    batch): `bench` times that path, not the one a draft model's request runs alone on."""
    runtime = PathRuntime(tiny_model_dir)
    ids = list(range(5, 25))
    result = run_ours(runtime, ids, 6)
    assert result.metrics.output_tokens == 6
    assert runtime.alone == 0 and runtime.rows_per_step == [1] * 5  # the first from the prefill
    assert run_ours(runtime, ids, 1).metrics.output_tokens == 1  # ends in its prefill
    report = bench_decode(runtime, prompt_tokens=16, max_tokens=4, repeats=1)
    assert report["decode_path"] == "batch" and runtime.alone == 0
