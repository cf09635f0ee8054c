"""Record one lone llama.cpp prefill's PrefillProgress sequence as JSON: the fixture of
tests/core/test_prefill_eta.py (tests/data/prefill_progress_llamacpp_6000.json), so the time-left
rule can be tested on real progress. Prints the event count and the prefill's seconds.

    .venv/bin/python benchmarks/record_prefill_progress.py 6000 out.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# The engine of the checkout this file is in, not the installed one.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import runtimes
from engine.core.reply import DetachedJob
from engine.events import PrefillProgress
from engine.params import GenerationRequest, SamplingParams
from engine.runtimes.torch.kernels import cpu_name
from engine.tools import bench


def main() -> None:
    tokens, out = int(sys.argv[1]), Path(sys.argv[2])
    runtime = runtimes.load("default", "llama.cpp")
    ids = bench.fixed_prompt_ids(runtime, tokens)
    seen: list[tuple[int, int]] = []

    def emit(_job: Any, event: Any) -> None:
        if isinstance(event, PrefillProgress):
            seen.append((event.t_ns, event.done_tokens))

    pool = runtime.new_prefix_cache(budget_bytes=1 << 40)
    batcher = runtime.new_batcher(pool, emit, lambda *_a: None)  # the engine's own schedule
    job = DetachedJob(GenerationRequest(
        [], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        prompt_token_ids=ids, reuse_cache=False))
    batcher.admit([job])
    t = job.timeline
    out.write_text(json.dumps({
        "what": f"lone llama.cpp prefill, bundled model, {cpu_name()}",
        "total": len(ids), "start_ns": 0, "end_ns": t.first_logits_ns - t.prefill_start_ns,
        "progress": [[ns - t.prefill_start_ns, done] for ns, done in seen]},
        separators=(",", ":")))
    print(len(seen), (t.first_logits_ns - t.prefill_start_ns) / 1e9)


if __name__ == "__main__":
    main()
