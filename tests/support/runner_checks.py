"""The runner contract (issue 27 item 7), written once: what every runtime's runners promise the
core, checked the same way on torch (tests/runtimes/test_runner_contract.py, in-process on the
tiny model) and on llama.cpp (tests/runtimes/test_llamacpp_runner_contract.py, in a child on
the bundled GGUF).

Each check takes a RunnerKit: the runtime's SoloRunner (engine/core/solo.py), a factory for its
BatchCore (engine/core/batch.py), its prefix cache, and the two things only the runtime can say:
how many positions a lease's KV holds, and how close two logits of the same prompt must be.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.core import prefill_progress
from engine.core.batch import BatchCore, Done, Emit
from engine.core.ledger import CacheLease, KvLedger
from engine.core.prompt import ChatModel
from engine.core.reply import DetachedJob, Reply, ReplyJob, Vocabulary, open_reply
from engine.core.solo import SoloRunner
from engine.events import EngineEvent, GenerationResult, PrefillProgress, PrefillStarted
from engine.params import GenerationRequest, SamplingParams
from engine.runtimes.torch.prefix_cache import PrefixCache

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
POISON_STEP = 2  # the batch step at which check_an_error_in_one_row poisons a row
# Two best logits closer than this may trade places with llama.cpp's float noise (a row's
# logits move by up to ~0.9 with where a batch's KV cells lie: check_an_error_in_one_row).
NEAR_TIE = 1.0
SMALL_CHUNK = 5  # tokens per lone prefill chunk where a check wants many chunks


@dataclass
class RunnerKit:
    """One runtime's runners and what the checks need around them."""

    name: str
    model: ChatModel
    pool: KvLedger[Any]
    vocab: Vocabulary
    runner: SoloRunner
    # A batch on this runtime; `lone_chunk` fixes the size of a lone prompt's prefill chunks.
    # A joining prompt is read whole between steps (interleave=False): how a prompt rides in
    # the rows' steps follows the clock, and the checks compare runs token for token.
    batcher: Callable[[Emit, Done, int | None], BatchCore]
    cache_length: Callable[[CacheLease], int]  # positions the lease's KV really holds
    # Asserts two logits vectors of the same context agree as far as this runtime promises.
    assert_close: Callable[[torch.Tensor, torch.Tensor, str], None]
    prompt: list[int]  # at least 60 ordinary tokens
    # Whether a row's logits are the same whatever else a batch step feeds. llama.cpp's are
    # not: a step of more tokens takes other matrix kernels, whose float sums can flip a
    # near-tie between two tokens.
    batch_invariant: bool = False


# ----- helpers -------------------------------------------------------------------------------
def _job(ids: list[int], conversation: str, reuse: bool = True,
         params: SamplingParams = GREEDY) -> DetachedJob:
    return DetachedJob(GenerationRequest([], params, request_id=conversation,
                                         conversation_id=conversation, prompt_token_ids=ids,
                                         reuse_cache=reuse))


def _open(kit: RunnerKit, job: ReplyJob, events: list[EngineEvent] | None = None) -> Reply:
    sink = events.append if events is not None else (lambda _e: None)
    return open_reply(kit.model, kit.pool, job, kit.vocab, sink)


def _prefill(kit: RunnerKit, reply: Reply) -> torch.Tensor:
    """The runner's prefill of what the reply's lease lacks: the last position's logits (a
    copy: a llama.cpp view lasts only until the next decode)."""
    logits = kit.runner.prefill(reply, reply.prompt_ids[reply.lease.cached_tokens :])
    assert logits is not None, "a prefill nobody stopped returned no logits"
    assert reply.lease.ids == reply.prompt_ids
    return logits[-1].clone()


def cold_logits(kit: RunnerKit, ids: list[int]) -> torch.Tensor:
    """The prompt's last logits from a cold lease, read in one pass (the reference)."""
    reply = _open(kit, _job(ids, "cold", reuse=False))
    try:
        return _prefill(kit, reply)
    finally:
        kit.pool.discard(reply.lease)


def _assert_holds(kit: RunnerKit, lease: CacheLease, ids: list[int]) -> None:
    """The lease says it holds ids, and its KV holds exactly that many positions."""
    assert lease.ids == ids, (len(lease.ids), len(ids))
    assert kit.cache_length(lease) == len(ids), (kit.cache_length(lease), len(ids))


def _progress(events: list[EngineEvent]) -> list[PrefillProgress]:
    return [e for e in events if isinstance(e, PrefillProgress)]


def _assert_progress(events: list[EngineEvent], total: int, chunk: int | None = None) -> None:
    """Progress rises, counts the uncached tokens, ends at them; with `chunk`, every chunk's
    end is reported."""
    progress = _progress(events)
    done = [p.done_tokens for p in progress]
    assert done, "a prefill reported no progress"
    assert all(a < b for a, b in itertools.pairwise(done)), done
    assert {p.total_tokens for p in progress} == {total}, progress
    assert done[-1] == total, done
    if chunk is not None:
        assert set(range(chunk, total, chunk)) <= set(done), (chunk, done)


# ----- the checks ----------------------------------------------------------------------------
def check_prefill_equals_cold(kit: RunnerKit) -> None:
    """A prefill on a lease that already holds part of the prompt (the chat's own entry, then
    another chat's as a donor) gives the cold prefill's logits; its progress counts only the
    uncached tokens."""
    short, whole = kit.prompt[:40], kit.prompt[:60]
    first = _open(kit, _job(short, "chat"))
    _prefill(kit, first)
    kit.pool.release(first.lease)
    cold = cold_logits(kit, whole)
    for conversation, cached in (("chat", 40), ("other", 59)):  # own entry; "chat"'s, lent
        events: list[EngineEvent] = []
        reply = _open(kit, _job(whole, conversation), events)
        assert reply.lease.cached_tokens == cached, (conversation, reply.lease.cached_tokens)
        warm = _prefill(kit, reply)
        _assert_holds(kit, reply.lease, whole)
        _assert_progress(events, len(whole) - cached)
        kit.assert_close(warm, cold, f"prefill on {cached} cached tokens vs cold")
        kit.pool.release(reply.lease)


def check_chunked_equals_one_pass(kit: RunnerKit) -> None:
    """A lone prompt read in small chunks (the batch's prefill) gives the one-pass logits and
    KV; its progress reports each chunk's end."""
    ids = kit.prompt[:48]
    one_pass = cold_logits(kit, ids)
    batcher = kit.batcher(lambda _j, _e: None, lambda _j, _r, _e: None, SMALL_CHUNK)
    events: list[EngineEvent] = []
    batcher._emit = lambda _job, event: events.append(event)
    row, logits = batcher._prefill(_job(ids, "chunked", reuse=False))
    try:
        _assert_holds(kit, row.lease, ids)
        _assert_progress(events, len(ids), SMALL_CHUNK)
        kit.assert_close(logits.clone(), one_pass, f"chunks of {SMALL_CHUNK} vs one pass")
    finally:
        kit.pool.discard(row.lease)


def check_forward_rows_and_trim(kit: RunnerKit) -> None:
    """forward() of a draft's rows equals feeding them one by one; trim() then forward equals
    never having fed the trimmed tokens; a discarded lease is gone from the cache."""
    prompt, draft = kit.prompt[:30], kit.prompt[40:44]
    together = _open(kit, _job(prompt, "together", reuse=False))
    _prefill(kit, together)
    rows = kit.runner.forward(together.lease, draft, len(draft)).clone()
    assert rows.shape[0] == len(draft)
    _assert_holds(kit, together.lease, prompt + draft)
    alone = _open(kit, _job(prompt, "alone", reuse=False))
    _prefill(kit, alone)
    for i, token in enumerate(draft):
        one = kit.runner.forward(alone.lease, [token], 1)[-1].clone()
        kit.assert_close(rows[i], one, f"draft row {i} vs one by one")
    kit.pool.discard(alone.lease)
    if not kit.runner.can_roll_back:
        kit.pool.discard(together.lease)
        return
    kit.runner.trim(together.lease, len(prompt) + 2)
    _assert_holds(kit, together.lease, prompt + draft[:2])
    other = kit.prompt[50]
    assert other != draft[2]
    after = kit.runner.forward(together.lease, [other], 1)[-1].clone()
    _assert_holds(kit, together.lease, [*prompt, *draft[:2], other])
    kit.assert_close(after, cold_logits(kit, [*prompt, *draft[:2], other]),
                     "trim then forward vs never fed")
    kit.pool.discard(together.lease)
    gone = kit.pool.acquire("together", [*prompt, other])
    assert gone.miss_reason == "evicted", (gone.miss_reason, gone.cached_tokens)
    kit.pool.discard(gone)


def check_cancel_mid_prefill_keeps_what_was_read(kit: RunnerKit) -> None:
    """Stop pressed while the second chunk is being read: the prefill ends within that chunk,
    the lease holds exactly what was read (its ids equal its KV), and a retry of the prompt
    reuses it and still gives the cold logits."""
    ids = kit.prompt[: 8 * SMALL_CHUNK]
    batcher = kit.batcher(lambda _j, _e: None, lambda _j, _r, _e: None, SMALL_CHUNK)
    job = _job(ids, "stopped")
    stopped_at: list[int] = []

    def emit(_job: ReplyJob, event: EngineEvent) -> None:
        if isinstance(event, PrefillProgress) and event.done_tokens > SMALL_CHUNK \
                and not stopped_at:
            stopped_at.append(event.done_tokens)
            job.cancel.set()  # inside the second chunk, or at its end

    batcher._emit = emit
    every_ns = prefill_progress.WITHIN_CHUNK_NS
    prefill_progress.WITHIN_CHUNK_NS = 0  # progress from inside each chunk too
    try:
        row, logits = batcher._prefill(job)
    finally:
        prefill_progress.WITHIN_CHUNK_NS = every_ns
    assert not logits.numel(), "a stopped prefill returned logits"
    read = len(row.lease.ids)
    assert stopped_at and SMALL_CHUNK <= read <= stopped_at[0] + SMALL_CHUNK < len(ids), \
        (stopped_at, read)
    _assert_holds(kit, row.lease, ids[:read])
    kit.pool.release(row.lease)
    retry = _open(kit, _job(ids, "stopped"))
    assert (retry.lease.cached_tokens, retry.lease.miss_reason) == (read, "none")
    warm = _prefill(kit, retry)
    kit.pool.release(retry.lease)
    kit.assert_close(warm, cold_logits(kit, ids), "retry after a stopped prefill vs cold")


def check_solo_progress_and_stop(kit: RunnerKit) -> None:
    """The solo runner's prefill progress rises and ends at the prompt's length. Stop before
    the prefill reads nothing; Stop during it ends it (with or without logits: the core's
    loop ends the reply either way) with the lease holding exactly what was read, which a
    retry reuses."""
    ids = kit.prompt[:60]
    events: list[EngineEvent] = []
    reply = _open(kit, _job(ids, "progress", reuse=False), events)
    _prefill(kit, reply)
    _assert_progress(events, len(ids))
    kit.pool.discard(reply.lease)
    job = _job(ids, "stopped early", reuse=False)
    job.cancel.set()
    reply = _open(kit, job)
    assert kit.runner.prefill(reply, ids) is None
    _assert_holds(kit, reply.lease, [])
    kit.pool.discard(reply.lease)
    job = _job(ids, "stopped")
    reply = open_reply(kit.model, kit.pool, job, kit.vocab,
                       lambda e: job.cancel.set() if isinstance(e, PrefillProgress) else None)
    every_ns = prefill_progress.WITHIN_CHUNK_NS
    prefill_progress.WITHIN_CHUNK_NS = 0  # progress from inside the chunk too
    try:
        kit.runner.prefill(reply, ids)
    finally:
        prefill_progress.WITHIN_CHUNK_NS = every_ns
    assert job.cancel.is_set()
    read = len(reply.lease.ids)
    _assert_holds(kit, reply.lease, ids[:read])
    kit.pool.release(reply.lease)
    retry = _open(kit, _job(ids, "stopped"))
    assert retry.lease.cached_tokens == min(read, len(ids) - 1), (read, retry.lease)
    kit.pool.discard(retry.lease)


def _common_start(a: list[int], b: list[int]) -> int:
    """How many tokens a and b (of one length) agree on from the start."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def _run_batch(kit: RunnerKit, tag: str, poison: int | None, ends_early: int | None = None
               ) -> tuple[dict[str, GenerationResult | str], list[int], dict[str, list[float]]]:
    """Three greedy rows (16, 20 and 24 prompt tokens) in one batch to their end: the results,
    the number of rows each step decoded, and each row's margin between its two best logits at
    each step (the k-th picks the row's token k + 1; token 0 comes from its prefill). With
    `poison`, that row's logits turn to NaN at the batch's third step (its sampler raises);
    `ends_early` instead ends that row by length at that step, so a clean run has the same rows
    at every step."""
    params = GREEDY  # sampled rows would tell llama.cpp's float noise apart (check's comment)
    short = SamplingParams(temperature=0.0, max_tokens=POISON_STEP + 2, ignore_eos=True)
    results: dict[str, GenerationResult | str] = {}
    rows_per_step: list[int] = []
    margins: dict[str, list[float]] = {}

    def done(job: ReplyJob, result: GenerationResult | None,
             error: BaseException | None) -> None:
        name = job.request.request_id.removeprefix(tag)
        results[name] = result if result is not None else repr(error)

    batcher = kit.batcher(lambda _j, _e: None, done, None)
    forward = batcher._forward_rows
    poisoned: list[Reply] = []

    def forward_rows() -> torch.Tensor:
        logits = forward()
        rows_per_step.append(len(batcher.rows))
        best = torch.topk(logits.float(), 2, dim=-1).values
        for row, (first, second) in zip(batcher.rows, best.tolist(), strict=True):
            margins.setdefault(row.request.request_id.removeprefix(tag), []).append(
                first - second)
        if poison is None or batcher.steps != POISON_STEP:
            return logits
        logits = logits.clone()
        logits[poison] = float("nan")
        poisoned.append(batcher.rows[poison])
        return logits

    batcher._forward_rows = forward_rows  # type: ignore[method-assign]  # the fault, per instance
    for i in range(3):
        batcher.admit([_job(kit.prompt[i * 10 : i * 14 + 16], f"{tag}row{i}", reuse=False,
                            params=short if i == ends_early else params)])
    assert len(batcher.rows) == 3
    while batcher.rows:
        batcher.step()
    if poison is not None:
        assert len(poisoned) == 1 and poisoned[0].request.request_id == f"{tag}row{poison}"
    return results, rows_per_step, margins


def check_an_error_in_one_row_leaves_the_others(kit: RunnerKit) -> None:
    """A row whose sampling raises (NaN logits) fails alone: its lease is discarded (its chat's
    next turn says "evicted"); the other rows run to their normal end, token for token as in
    a batch where nothing failed, and keep their KV for the next turn."""
    # The reference ends row 1 by length at the step where the fault hits it, so both runs
    # decode the same rows at every step. llama.cpp's logits still move with where a batch's
    # KV cells lie: on the bundled Q4_1, removing the failed row's cells instead of keeping
    # them moved the other rows' later logits by up to 0.9 (total variation up to 4%; likely
    # int8 activations turning float reordering into rounding steps). So the rows are greedy
    # (a seeded draw would tell that noise apart), and without batch invariance a row may
    # part from its reference only where the reference's two best logits were a near-tie.
    clean, clean_rows, clean_margins = _run_batch(kit, "clean-", None, ends_early=1)
    faulty, faulty_rows, _ = _run_batch(kit, "", 1)
    assert clean_rows == faulty_rows, (clean_rows, faulty_rows)
    # Every lease came back or was discarded: the ledger holds none out (a failed row's lease
    # left out would read the same "evicted" next turn, and keep its KV).
    assert not kit.pool._leased, kit.pool._leased
    failed = faulty.pop("row1")
    assert isinstance(failed, str) and "NaN" in failed, failed
    del clean["row1"]
    for name, result in faulty.items():
        reference = clean[name]
        assert isinstance(result, GenerationResult), (name, result)
        assert isinstance(reference, GenerationResult)
        assert (result.finish_reason, len(result.token_ids)) == ("length", 8), (name, result)
        same = _common_start(result.token_ids, reference.token_ids)
        if same < len(reference.token_ids):
            margin = clean_margins[name][same - 1] if same else None
            assert not kit.batch_invariant and margin is not None and margin < NEAR_TIE, \
                (name, result.token_ids, reference.token_ids, clean_margins[name])
        again = kit.pool.acquire(name, result.prompt_token_ids + result.token_ids)
        assert (again.miss_reason, again.cached_tokens) == \
            ("none", len(result.prompt_token_ids) + 7), name
        kit.pool.release(again)
    lost = kit.pool.acquire("row1", kit.prompt[10:30])  # its prompt
    assert lost.miss_reason == "evicted", (lost.miss_reason, lost.cached_tokens)
    kit.pool.discard(lost)


def check_alternatives_share_one_prefill(kit: RunnerKit) -> None:
    """Three alternatives of one prompt: it is read once, and each alternative reports that
    prefill as its own (its start, every prompt token cached) and decodes on a fork of its KV;
    greedy, all three say the same."""
    events: dict[str, list[EngineEvent]] = {}
    results: dict[str, GenerationResult | str] = {}

    def emit(job: ReplyJob, event: EngineEvent) -> None:
        events.setdefault(job.request.request_id, []).append(event)

    def done(job: ReplyJob, result: GenerationResult | None,
             error: BaseException | None) -> None:
        results[job.request.request_id] = result if result is not None else repr(error)

    ids = kit.prompt[:24]
    jobs = [DetachedJob(GenerationRequest([], GREEDY, request_id=f"alt{i}",
                                          conversation_id="alternatives",
                                          prompt_token_ids=ids, reuse_cache=False))
            for i in range(3)]
    batcher = kit.batcher(emit, done, None)
    batcher.admit(jobs)
    while batcher.rows:
        batcher.step()
    source_start = jobs[0].timeline.prefill_start_ns
    for i, job in enumerate(jobs):
        started = next(e for e in events[job.request.request_id] if isinstance(e, PrefillStarted))
        cached = 0 if i == 0 else len(ids)
        assert (started.t_ns, job.timeline.prefill_start_ns) == (source_start, source_start), i
        assert (started.prompt_tokens, started.cached_tokens) == (len(ids), cached), i
        result = results[job.request.request_id]
        assert isinstance(result, GenerationResult), result
        assert result.token_ids == results["alt0"].token_ids  # type: ignore[union-attr]
        assert len(result.token_ids) == GREEDY.max_tokens
        assert result.speculative is None  # none was asked for


def _batch_results(kit: RunnerKit, jobs: list[DetachedJob]) -> dict[str, GenerationResult]:
    """Admit the jobs one after another into one batch; step it until every row is done."""
    results: dict[str, GenerationResult | str] = {}

    def done(job: ReplyJob, result: GenerationResult | None,
             error: BaseException | None) -> None:
        results[job.request.request_id] = result if result is not None else repr(error)

    batcher = kit.batcher(lambda _job, _event: None, done, None)
    for job in jobs:
        batcher.admit([job])
    steps = 0
    while batcher.rows:
        batcher.step()
        steps += 1
    assert steps < sum(j.request.params.max_tokens for j in jobs), "the rows took turns"
    finished: dict[str, GenerationResult] = {}
    for name, result in results.items():
        assert isinstance(result, GenerationResult), (name, result)
        finished[name] = result
    return finished


def check_speculative_row_in_the_batch(kit: RunnerKit) -> None:
    """A prompt-lookup request beside a plain one in a batch. Its prompt repeats another, then
    the greedy reply to it cut short and other words, then the first again: a model continues
    it with that reply, so drafts come, agree, then part (a draft tail to cut). Where the batch
    verifies drafts, it keeps some, rejects some, and still says token for token what it says
    without speculation, its KV going back to the prefix cache holding exactly what it fed;
    where the batch cannot, it decodes plainly and says so."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = kit.prompt[20:44]

    def job(name: str, ids: list[int], run: str, speculative: bool = False) -> DetachedJob:
        return DetachedJob(GenerationRequest(
            [], params, request_id=name, conversation_id=f"{name}-{run}", prompt_token_ids=ids,
            reuse_cache=False, speculative="ngram" if speculative else None))

    said = _batch_results(kit, [job("plain", plain, "first")])["plain"].token_ids
    echo = plain + said[:8] + kit.prompt[50:58] + plain
    reference = _batch_results(kit, [job("plain", plain, "ref"), job("spec", echo, "ref")])
    results = _batch_results(kit, [job("plain", plain, "run"), job("spec", echo, "run", True)])
    drafts = kit.batcher(lambda _job, _event: None, lambda *_: None, None).drafts_in_batch
    # Without batch invariance a plain row's greedy reply beside a draft can part from its
    # reference at a near-tie (token 15 of 16 on the bundled GGUF, Zen 5): its start must hold.
    agree = len(said) if kit.batch_invariant or not drafts else len(said) // 2
    plain_row, spec = results["plain"], results["spec"]
    assert plain_row.token_ids[:agree] == reference["plain"].token_ids[:agree]
    assert spec.token_ids == reference["spec"].token_ids  # speculation changes nothing greedy
    assert (plain_row.finish_reason, spec.finish_reason) == ("length", "length")
    assert spec.speculative == ("ngram" if drafts else None), spec.speculative
    counts = (spec.spec_proposed, spec.spec_accepted)
    assert (0 < spec.spec_accepted < spec.spec_proposed) is drafts, counts
    fed = spec.prompt_token_ids + spec.token_ids[:-1]
    again = kit.pool.acquire("spec-run", fed + spec.token_ids[-1:])
    assert (again.miss_reason, again.cached_tokens) == ("none", len(fed)), again
    assert kit.cache_length(again) == len(fed)
    kit.pool.release(again)


def check_rows_that_end_early_report_and_keep_their_kv(kit: RunnerKit) -> None:
    """In a batch, a request that ends at its first token (max_tokens 1) never joins the rows
    and a row stopped mid-stream leaves at the next step: each reports its own end ("length",
    "cancelled") with what it took, gives its KV back to the prefix cache holding the prompt
    and what it fed, and the row beside them runs to its end."""
    results: dict[str, GenerationResult | str] = {}

    def done(job: ReplyJob, result: GenerationResult | None,
             error: BaseException | None) -> None:
        results[job.request.request_id] = result if result is not None else repr(error)

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompts = {"runs": kit.prompt[:20], "stopped": kit.prompt[10:34], "one": kit.prompt[30:50]}
    jobs = {name: _job(ids, f"early-{name}", reuse=False,
                       params=one if name == "one" else GREEDY)
            for name, ids in prompts.items()}
    batcher = kit.batcher(lambda _j, _e: None, done, None)
    for job in jobs.values():
        batcher.admit([job])
    assert len(batcher.rows) == 2 and "early-one" in results  # ended at its first token
    for _ in range(3):
        batcher.step()
    jobs["stopped"].cancel.set()
    while batcher.rows:
        batcher.step()
    ends: dict[str, GenerationResult] = {}
    for name in prompts:
        result = results[f"early-{name}"]
        assert isinstance(result, GenerationResult), (name, result)
        ends[name] = result
    finish = {name: r.finish_reason for name, r in ends.items()}
    taken = {name: len(r.token_ids) for name, r in ends.items()}
    assert finish == {"runs": "length", "stopped": "cancelled", "one": "length"}, finish
    assert taken == {"runs": GREEDY.max_tokens, "stopped": 4, "one": 1}, taken
    for name, result in ends.items():
        fed = result.prompt_token_ids + result.token_ids[:-1]
        again = kit.pool.acquire(f"early-{name}", fed + result.token_ids[-1:])
        assert (again.miss_reason, again.cached_tokens) == ("none", len(fed)), (name, again)
        kit.pool.release(again)


CHECKS: dict[str, Callable[[RunnerKit], None]] = {
    "prefill_equals_cold": check_prefill_equals_cold,
    "chunked_equals_one_pass": check_chunked_equals_one_pass,
    "forward_rows_and_trim": check_forward_rows_and_trim,
    "cancel_mid_prefill": check_cancel_mid_prefill_keeps_what_was_read,
    "solo_progress_and_stop": check_solo_progress_and_stop,
    "error_in_one_row": check_an_error_in_one_row_leaves_the_others,
    "alternatives_share_one_prefill": check_alternatives_share_one_prefill,
    "speculative_row_in_the_batch": check_speculative_row_in_the_batch,
    "rows_that_end_early": check_rows_that_end_early_report_and_keep_their_kv,
}


def run_checks(new_kit: Callable[[], RunnerKit], names: list[str]) -> dict[str, str | None]:
    """Each named check on a fresh kit (in the llama.cpp child: the model loads once): None
    where it passed, else its traceback, so one child reports every check."""
    import traceback

    outcome: dict[str, str | None] = {}
    for name in names:
        try:
            with torch.inference_mode():
                CHECKS[name](new_kit())
            outcome[name] = None
        except Exception:
            outcome[name] = traceback.format_exc()
    return outcome



# ----- the runtimes' kits --------------------------------------------------------------------
FP32_TOLERANCE = 1e-4  # torch on the CPU in fp32: chunking and cache reuse only reorder sums


def assert_fp_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """fp32 on the same kernels: equal within rounding, scaled to the logits' size."""
    scale = max(1.0, float(want.abs().max()))
    diff = float((got.float() - want.float()).abs().max())
    assert diff <= FP32_TOLERANCE * scale, f"{what}: logits differ by {diff:.3g}"


def torch_kit(loaded: Any) -> RunnerKit:
    """The torch runtime's runners on a loaded Hugging Face model, on a fresh prefix cache."""
    from engine.runtimes.torch.batching import Batcher
    from engine.runtimes.torch.generate import TorchRunner, torch_vocabulary
    from engine.tools.bench import fixed_prompt_ids

    pool = PrefixCache(loaded.model.config, budget_bytes=1 << 30)

    def batcher(emit: Emit, done: Done, lone_chunk: int | None) -> BatchCore:
        return Batcher(loaded, pool, emit, done, prefill_chunk=lone_chunk, interleave=False)

    return RunnerKit("torch", loaded, pool, torch_vocabulary(loaded), TorchRunner(loaded),
                     batcher, lambda lease: int(lease.cache.get_seq_length()), assert_fp_close,
                     fixed_prompt_ids(loaded, 64))


def fake_kit(tokenizer: Any) -> RunnerKit:
    """The fake third runtime (tests/support/fake_runtime.py) on the core's own ledger."""
    from tests.support.fake_runtime import FakeBatcher, FakeKvStore, FakeModel, FakeRunner

    model = FakeModel(tokenizer)
    pool: KvLedger[Any] = KvLedger(FakeKvStore(), budget_bytes=1 << 30)

    def batcher(emit: Emit, done: Done, lone_chunk: int | None) -> BatchCore:
        return FakeBatcher(model, pool, emit, done, lone_chunk)

    def exact(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        assert torch.equal(got, want), what

    ids = [i for i in range(3, len(tokenizer)) if i not in tokenizer.all_special_ids][:64]
    return RunnerKit("fake", model, pool, model.vocabulary(), FakeRunner(model), batcher,
                     lambda lease: len(lease.cache.states), exact, ids, batch_invariant=True)


def llama_kit(loaded: Any, assert_close: Callable[[torch.Tensor, torch.Tensor, str], None]
              = assert_fp_close) -> RunnerKit:
    """The llama.cpp runtime's runners on a loaded GGUF (in the child: tests/support/child.py),
    on a fresh prefix cache (a new pool clears the context's KV memory)."""
    from engine.runtimes.llamacpp.batcher import LlamaBatcher
    from engine.runtimes.llamacpp.prefix_pool import SeqPrefixCache
    from engine.runtimes.llamacpp.session import LlamaRunner, llama_vocabulary
    from engine.tools.bench import fixed_prompt_ids

    pool = SeqPrefixCache(loaded, 1 << 30)

    def batcher(emit: Emit, done: Done, lone_chunk: int | None) -> BatchCore:
        return LlamaBatcher(loaded, pool, emit, done, interleave=False, lone_chunk=lone_chunk)

    return RunnerKit("llama.cpp", loaded, pool, llama_vocabulary(loaded),
                     LlamaRunner(loaded, pool), batcher,
                     lambda lease: pool.store.length(lease.cache), assert_close,
                     fixed_prompt_ids(loaded, 64))
