"""The llama.cpp engine (engine/llamacpp) on the bundled GGUF.

Everything that runs llama.cpp runs in a spawned child process (tests/support/child.py's
run_in_child), so a crash in native code is a failed test naming the signal, not a dead test
run. Skipped, saying why, where llama-cpp-python is not installed (`make llama-cpp`).
"""

from __future__ import annotations

import itertools
import signal
from pathlib import Path
from typing import Any

import pytest

from engine.errors import ModelLoadError
from engine.runtimes import LLAMA_CPP, TORCH, resolve_engine
from tests.support.child import CHILD_TIMEOUT_S, needs_llama_cpp, run_in_child
from tests.support.llamacpp import (
    agree_until_near_tie,
    alone_with_margins,
    chat_ids,
    load_default,
)

pytestmark = pytest.mark.timeout(CHILD_TIMEOUT_S + 60)  # a child's own limit comes first
PROMPT = "Write two sentences about the sea."


def _crash() -> None:
    import os

    os.kill(os.getpid(), signal.SIGSEGV)


def test_a_native_crash_fails_with_the_signal_name() -> None:
    with pytest.raises(pytest.fail.Exception, match="SIGSEGV"):
        run_in_child(_crash)


# ----- helpers used inside the child ----------------------------------------------------------
def _greedy(runtime: Any, pool: Any, prompt_ids: list[int] | None = None, *, tokens: int = 24,
            messages: list | None = None, conversation: str | None = None,
            reuse: bool = True, speculative: str | None = None) -> Any:
    import threading

    from engine.metrics import RequestTimeline, now_ns
    from engine.params import GenerationRequest, SamplingParams


    request = GenerationRequest(
        messages=messages or [], prompt_token_ids=prompt_ids,
        params=SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=messages is None),
        conversation_id=conversation, reuse_cache=reuse, speculative=speculative)
    return runtime.new_session(pool).run(request, RequestTimeline(now_ns()), threading.Event(),
                                         lambda _e: None)


# ----- huge pages ------------------------------------------------------------------------------
def _huge_pages_body() -> dict:
    from pathlib import Path

    from engine.core import huge_pages
    from engine.params import ChatMessage

    runtime = load_default()
    chat = [ChatMessage("user", "Name a colour.")]

    def two_turns(move_between: bool) -> tuple[Any, Any, int]:
        """A chat's two turns in a new prefix cache (which clears the KV memory), the memory
        moved to huge pages between them or not: the second turn reads the first's KV."""
        pool = runtime.new_prefix_cache(1 << 30)
        first = _greedy(runtime, pool, messages=chat, conversation="a", tokens=16)
        pieces = 0
        while move_between and runtime.idle_work():
            pieces += 1
        turn = [*chat, ChatMessage("assistant", first.text), ChatMessage("user", "And a fruit?")]
        return first, _greedy(runtime, pool, messages=turn, conversation="a", tokens=16), pieces

    first, second, _ = two_turns(move_between=False)
    first_after, second_after, pieces = two_turns(move_between=True)
    path = runtime.info.path
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines()
              if line.endswith(path)]
    return {"supported": huge_pages.supported(), "pages": runtime.memory_pages,
            "pieces": pieces, "mapped": mapped,
            "turns": [[(r.metrics.cached_tokens, r.token_ids) for r in pair]
                      for pair in ((first, second), (first_after, second_after))]}


@needs_llama_cpp
def test_memory_moved_to_huge_pages_changes_no_token_and_no_cached_chat() -> None:
    out = run_in_child(_huge_pages_body)
    before, after = out["turns"]
    assert after == before  # the same tokens, and the second turn read the first's KV
    assert before[1][0] > 0
    if out["supported"]:  # the weights are read into the process's memory, which moves
        backed, _, tried = out["pages"].split()[:3]
        assert out["mapped"] == []
        assert int(backed) > 100 and out["pieces"] > 50  # MiB: the bundled model's ~100 MB
        assert int(backed) <= int(tried)
        assert not out["pages"].endswith("still moving")
    else:
        assert out["pages"] == "" and out["pieces"] == 0


# ----- exactness ------------------------------------------------------------------------------
def _parity_body() -> dict:
    import llama_cpp

    from engine.model_files import default_gguf_path

    runtime = load_default()
    loaded = runtime.model
    pool = runtime.new_prefix_cache(1 << 30)
    ids = chat_ids(loaded, PROMPT)
    ours = _greedy(runtime, pool, ids, reuse=False).token_ids
    lookup = _greedy(runtime, pool, ids, reuse=False, speculative="ngram")
    peer = llama_cpp.Llama(model_path=str(default_gguf_path()), n_ctx=512,
                           n_threads=loaded.n_threads, n_threads_batch=loaded.n_threads,
                           flash_attn=loaded.info.kernel.endswith("-fa"),  # our attention
                           verbose=False)
    theirs = []
    for token in peer.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                               repeat_penalty=1.0):
        theirs.append(token)
        if len(theirs) == len(ours):
            break
    peer.close()
    return {"ours": ours, "theirs": theirs, "lookup": lookup.token_ids,
            "proposed": lookup.spec_proposed, "engine": loaded.info.engine,
            "text": loaded.tokenizer.decode(ours)}


@needs_llama_cpp
def test_greedy_tokens_match_llama_cpps_own_greedy() -> None:
    out = run_in_child(_parity_body)
    assert out["engine"] == "llama.cpp"
    assert len(out["ours"]) == 24
    assert out["ours"] == out["theirs"]
    assert out["lookup"] == out["ours"]  # prompt-lookup speculation changes nothing greedy


def _host_views_body() -> dict:
    import numpy as np

    from engine.core import host_logits

    runtime = load_default()
    loaded = runtime.model
    _greedy(runtime, runtime.new_prefix_cache(1 << 30), chat_ids(loaded, PROMPT), tokens=4)
    view = loaded.logits(1)
    row = host_logits.row(view, 0)
    buffer = np.ctypeslib.as_array(loaded.llama_cpp.llama_get_logits(loaded.ctx),
                                   shape=(1, loaded.n_vocab))
    out = {"same_row": row is host_logits.row(view, 0),
           "reads_llama_cpps_buffer": bool(np.shares_memory(host_logits.array(row), buffer)),
           "row_equals_torchs": bool(np.array_equal(host_logits.array(row), view[0].numpy()))}
    loaded.close()
    out["forgotten"] = host_logits.array(row) is None and host_logits.array(view) is None
    return out


@needs_llama_cpp
def test_the_logits_view_is_registered_while_its_model_lives() -> None:
    """The core reads a decode step's logits through host_logits (no torch indexing or
    conversion in the step), from llama.cpp's own buffer, until the model closes."""
    assert run_in_child(_host_views_body) == {
        "same_row": True, "reads_llama_cpps_buffer": True, "row_equals_torchs": True,
        "forgotten": True}


def _cache_body() -> dict:
    from engine.params import ChatMessage


    runtime = load_default()


    pool = runtime.new_prefix_cache(1 << 30)
    chat = [ChatMessage("system", "You are terse."), ChatMessage("user", "Name a colour.")]
    first = _greedy(runtime, pool, messages=chat, conversation="a", tokens=16)
    chat += [ChatMessage("assistant", first.text), ChatMessage("user", "And a fruit?")]
    cached = _greedy(runtime, pool, messages=chat, conversation="a", tokens=16)
    cold = _greedy(runtime, pool, messages=chat, conversation="cold", tokens=16, reuse=False)
    other = [ChatMessage("system", "You are terse."), ChatMessage("user", "Name a city.")]
    shared = _greedy(runtime, pool, messages=other, conversation="b", tokens=16)
    alone = _greedy(runtime, pool, messages=other, conversation="c", tokens=16, reuse=False)
    return {
        "first": (first.metrics.cached_tokens, first.metrics.cache_miss_reason),
        "cached": (cached.metrics.cached_tokens, cached.metrics.cache_miss_reason,
                   cached.metrics.prompt_tokens, cached.token_ids),
        "cold": (cold.metrics.cached_tokens, cold.token_ids),
        "shared": (shared.metrics.cached_tokens, shared.metrics.cache_miss_reason,
                   shared.token_ids),
        "alone": alone.token_ids,
    }


@needs_llama_cpp
def test_a_cached_turn_equals_a_cold_one() -> None:
    out = run_in_child(_cache_body)
    assert out["first"] == (0, "first_turn")
    cached_tokens, reason, prompt_tokens, cached_ids = out["cached"]
    assert reason == "none" and 0 < cached_tokens < prompt_tokens
    assert out["cold"][0] == 0
    assert cached_ids == out["cold"][1]
    # another chat with the same system prompt borrows its prefix (seq_cp) and still agrees
    shared_tokens, shared_reason, shared_ids = out["shared"]
    assert shared_tokens > 0 and shared_reason == "first_turn"
    assert shared_ids == out["alone"]


def _batch_body() -> dict:
    from engine.core.reply import DetachedJob
    from engine.params import GenerationRequest, SamplingParams


    runtime = load_default()


    loaded = runtime.model
    pool = runtime.new_prefix_cache(1 << 30)
    prompts = [chat_ids(loaded, t) for t in
               ("Count to five.", "What is the capital of France?", "Say hello in French.")]
    alone = [_greedy(runtime, pool, ids, tokens=12, reuse=False).token_ids for ids in prompts]
    measured = [alone_with_margins(loaded, pool, ids, 12) for ids in prompts]
    results: dict[str, Any] = {}

    def done(job: Any, result: Any, error: Any) -> None:
        results[job.request.request_id] = result.token_ids if result else repr(error)

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batcher = runtime.new_batcher(pool, lambda _j, _e: None, done)
    batcher.interleave = False  # prompts join between steps (mixed steps: the test below)
    for i, ids in enumerate(prompts):
        batcher.admit([DetachedJob(GenerationRequest([], params, request_id=f"r{i}",
                                                     prompt_token_ids=ids, reuse_cache=False))])
    # alternatives of one prompt share its prefill (seq_cp); greedy ones all equal alone
    alt = GenerationRequest([], params, request_id="alt", prompt_token_ids=prompts[1],
                            conversation_id="alts", reuse_cache=False)
    batcher.admit([DetachedJob(r) for r in alt.alternatives(2)])
    while batcher.rows:
        batcher.step()
    batched = [results[f"r{i}"] for i in range(3)]
    alternatives = [results["alt.0"], results["alt.1"]]
    return {"alone": alone, "measured": [tokens for tokens, _ in measured],
            "agree": [agree_until_near_tie(b, *m) for b, m in zip(batched, measured,
                                                                  strict=True)],
            "alternatives_agree": [agree_until_near_tie(a, *measured[1])
                                   for a in alternatives],
            "first_tokens": [b[:4] for b in batched] == [a[:4] for a in alone],
            "steps": batcher.steps}


@needs_llama_cpp
def test_batched_rows_and_alternatives_each_equal_alone() -> None:
    """llama.cpp is not bitwise batch-invariant: in the unified KV a row's cells sit at other
    indices than alone, so attention sums in another order (about 1e-3 on a logit). Each row
    must equal its alone run token for token up to the first near-tie."""
    out = run_in_child(_batch_body)
    assert out["measured"] == out["alone"]  # the margin probe decodes what the session does
    assert all(out["agree"]), out
    assert all(out["alternatives_agree"]), out
    assert out["first_tokens"]
    assert out["steps"] == 11  # one llama_decode per step for all five rows


def _mixed_body() -> dict:
    import threading

    from engine.core import prefill_progress
    from engine.core.reply import DetachedJob
    from engine.events import PrefillProgress, TokenEmitted
    from engine.metrics import RequestTimeline, now_ns
    from engine.params import GenerationRequest, SamplingParams
    from engine.runtimes.llamacpp.batcher import LlamaBatcher
    from engine.tools.bench import fixed_prompt_ids

    prefill_progress.WITHIN_CHUNK_NS = 1 << 62  # progress at chunk ends only: counted here
    runtime = load_default()
    loaded = runtime.model
    pool = runtime.new_prefix_cache(1 << 30)
    stream_ids, long_ids = chat_ids(loaded, "Count to five."), fixed_prompt_ids(loaded, 150)
    stream_alone = alone_with_margins(loaded, pool, stream_ids, 24)
    long_alone = alone_with_margins(loaded, pool, long_ids, 6)
    events: list = []
    results: dict[str, Any] = {}

    def emit(_job: Any, event: Any) -> None:
        if isinstance(event, (PrefillProgress, TokenEmitted)):
            events.append((type(event).__name__, event.request_id,
                           getattr(event, "done_tokens", 0)))

    def done(job: Any, result: Any, error: Any) -> None:
        results[job.request.request_id] = ((result.finish_reason, result.token_ids) if result
                                           else repr(error))

    def job(name: str, ids: list[int], tokens: int) -> Any:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        return DetachedJob(GenerationRequest([], params, request_id=name, prompt_token_ids=ids,
                                             reuse_cache=False))

    def stream_then(long: Any, sink: Any = emit, **options: Any) -> LlamaBatcher:
        batcher = LlamaBatcher(loaded, pool, sink, done, **options)
        batcher.admit([job(f"stream-{long.request.request_id}", stream_ids, 24)])
        batcher.step()
        batcher.admit([long])
        while batcher.rows:
            batcher.step()
        return batcher

    mixed = stream_then(job("long", long_ids, 6), mixed_chunk=16).mixed_steps
    schedule = [e for e in events if e[1] in ("long", "stream-long")]
    events.clear()
    lone = LlamaBatcher(loaded, pool, emit, done, lone_chunk=64)
    lone.admit([job("lone", long_ids, 6)])
    while lone.rows:
        lone.step()
    lone_progress = [e[2] for e in events if e[0] == "PrefillProgress"]
    stop = job("stop", long_ids, 6)

    def stop_on_progress(_job: Any, event: Any) -> None:
        if isinstance(event, PrefillProgress) and event.request_id == "stop":
            stop.cancel.set()  # Stop pressed while the first mixed chunk ran
            events.append(("stopped", "stop", event.done_tokens))

    stream_then(stop, stop_on_progress, mixed_chunk=16)
    session_progress: list[int] = []
    runtime.new_session(pool).run(
        job("session", long_ids, 2).request, RequestTimeline(now_ns()), threading.Event(),
        lambda e: session_progress.append(e.done_tokens) if isinstance(e, PrefillProgress)
        else None)
    return {
        "session_progress": session_progress,
        "mixed_steps": mixed, "schedule": schedule, "lone_progress": lone_progress,
        "stream_agrees": agree_until_near_tie(results["stream-long"][1], *stream_alone),
        "long_agrees": agree_until_near_tie(results["long"][1], *long_alone),
        "lone_agrees": agree_until_near_tie(results["lone"][1], *long_alone),
        "stop": results["stop"], "stopped_at": [e[2] for e in events if e[0] == "stopped"],
        "stream_beside_stop": results["stream-stop"],
        "stream_beside_stop_agrees": agree_until_near_tie(results["stream-stop"][1],
                                                           *stream_alone),
    }


@needs_llama_cpp
def test_a_prompt_prefilled_in_the_rows_steps_changes_no_row() -> None:
    """Sarathi-style mixed batches: a joining 150-token prompt rides in the streaming row's
    decode steps, 16 tokens per llama_decode; the row gets a token every step, its greedy
    tokens are its alone run's (up to a near-tie, as for any batch), and so are the prompt's.
    Stop during a mixed prefill ends it within one chunk; the row streams on."""
    out = run_in_child(_mixed_body)
    assert out["mixed_steps"] == 10  # ceil(150 / 16): one chunk per step, none on its own
    progress = [i for i, (kind, rid, _) in enumerate(out["schedule"])
                if kind == "PrefillProgress" and rid == "long"]
    assert [out["schedule"][i][2] for i in progress] == [*range(16, 150, 16), 150]
    for start, end in itertools.pairwise(progress):
        between = out["schedule"][start + 1 : end]
        assert between == [("TokenEmitted", "stream-long", 0)]  # one token per mixed step
    assert out["stream_agrees"] and out["long_agrees"], out
    assert out["lone_progress"] == [64, 128, 150]  # nothing streaming: lone chunks
    assert out["session_progress"] == [150]  # a lone request: one batch (the graph is known)
    assert out["lone_agrees"], out
    assert out["stopped_at"] == [16]
    assert out["stop"] == ("cancelled", [])
    finish, tokens = out["stream_beside_stop"]
    assert finish == "length" and len(tokens) == 24
    assert out["stream_beside_stop_agrees"], out


def _meter_body() -> dict:
    """Lone prefills of three 700-token prompts (no prefix in common) with every progress event
    seen: in a session (the first, while the graph's size is unknown) and in the batcher, the
    second and third also stopped inside a 512-token chunk, then asked again."""
    import threading

    from engine.core import prefill_progress
    from engine.core.reply import DetachedJob
    from engine.events import PrefillProgress
    from engine.metrics import RequestTimeline, now_ns
    from engine.params import GenerationRequest, SamplingParams
    from engine.runtimes.llamacpp.batcher import LlamaBatcher
    from engine.tools.bench import fixed_prompt_ids

    prefill_progress.WITHIN_CHUNK_NS = 0  # every node's progress is reported
    runtime = load_default()
    loaded = runtime.model
    pool = runtime.new_prefix_cache(1 << 30)
    base = fixed_prompt_ids(loaded, 702)
    prompts = {name: base[i : i + 700] for i, name in enumerate("abc")}
    assert len({ids[0] for ids in prompts.values()}) == 3  # nothing for one to lend another
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out: dict[str, Any] = {}

    def reply(result: Any) -> tuple[str, list[int], int]:
        return result.finish_reason, result.token_ids, result.metrics.cached_tokens

    def in_session(name: str, stop_past: int | None = None) -> tuple[list[int], Any]:
        done: list[int] = []
        cancel = threading.Event()

        def emit(event: Any) -> None:
            if isinstance(event, PrefillProgress):
                done.append(event.done_tokens)
                if stop_past is not None and event.done_tokens > stop_past:
                    cancel.set()  # Stop pressed inside the chunk

        request = GenerationRequest([], params, prompt_token_ids=prompts[name],
                                    conversation_id=name)
        result = runtime.new_session(pool).run(request, RequestTimeline(now_ns()), cancel,
                                               emit)
        return done, reply(result)

    def in_batcher(name: str, stop_past: int | None = None) -> tuple[list[int], Any]:
        done: list[int] = []
        results: list[Any] = []
        job = DetachedJob(GenerationRequest([], params, prompt_token_ids=prompts[name],
                                            conversation_id=name))

        def emit(_job: Any, event: Any) -> None:
            if isinstance(event, PrefillProgress):
                done.append(event.done_tokens)
                if stop_past is not None and event.done_tokens > stop_past:
                    job.cancel.set()

        batcher = LlamaBatcher(loaded, pool, emit, lambda _j, r, e: results.append(r or e))
        batcher.admit([job])
        while batcher.rows:
            batcher.step()
        return done, reply(results[0])

    out["a"], out["a_reply"] = in_session("a")
    out["graph_nodes"] = loaded.graph_nodes
    out["b_stop"], out["b_stopped"] = in_session("b", stop_past=100)
    _, out["b_reply"] = in_session("b")
    out["c_stop"], out["c_stopped"] = in_batcher("c", stop_past=600)
    out["c"], out["c_reply"] = in_batcher("c")
    for name, ids in prompts.items():
        out[f"{name}_agrees"] = agree_until_near_tie(out[f"{name}_reply"][1],
                                                      *alone_with_margins(loaded, pool, ids, 6))
    return out


@needs_llama_cpp
def test_a_lone_prefill_reports_and_stops_inside_its_chunks() -> None:
    """llama.cpp's graph meter (engine/runtimes/llamacpp/graph_meter.py): progress from inside each
    512-token chunk, and Stop inside one, after which the prompt's sequence holds exactly the
    chunks before it: asked again, it resumes there and replies as a cold prompt does."""
    out = run_in_child(_meter_body)
    assert out["graph_nodes"] > 100  # learned from the first, 16-token chunk
    progress = out["a"]
    assert progress == sorted(set(progress)) and progress[0] == 16 and progress[-1] == 700
    assert len([done for done in progress if 16 < done < 528]) > 100  # node by node
    assert 528 in progress  # that chunk's end, once its tokens are in
    assert out["a_reply"][0] == "length" and len(out["a_reply"][1]) == 6
    # b: stopped inside its first chunk (0-512): none of it stays
    assert out["b_stop"][-1] == 101 and out["b_stopped"][:2] == ("cancelled", [])
    assert out["b_reply"][0] == "length" and out["b_reply"][2] == 0
    # c: stopped inside its second chunk (512-700): the first stays cached
    assert out["c_stop"][-1] == 601 and out["c_stopped"][:2] == ("cancelled", [])
    assert out["c_reply"][0] == "length" and out["c_reply"][2] == 512
    # asked again, only the 188 tokens after the cached chunk are read, node by node
    assert out["c"] == sorted(set(out["c"])) and out["c"][-1] == 188 and len(out["c"]) > 20
    assert out["a_agrees"] and out["b_agrees"] and out["c_agrees"], out


def _ctrl_c_body() -> dict:
    """A 512-token chunk decoded under the meter on the main thread, as `phasewise bench` does,
    with SIGINT sent from another thread once the graph is under way: the Python handler then
    runs at the next bytecode, at the entry of the meter's callback, inside llama_decode."""
    import os
    import sys
    import threading

    from engine.runtimes.llamacpp.graph_meter import GraphMeter
    from engine.tools.bench import fixed_prompt_ids

    # Ctrl+C as in a terminal: a test runner started in the background (`cmd &`) ignores
    # SIGINT, and this child would inherit that.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    runtime = load_default()
    loaded = runtime.model
    ids = fixed_prompt_ids(loaded, loaded.n_batch)
    under_way = threading.Event()
    fractions: list[float] = []
    unraisable: list[str] = []
    sys.unraisablehook = lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.err_msg}")

    def on_fraction(fraction: float) -> None:
        fractions.append(fraction)
        under_way.set()

    def interrupt() -> None:
        under_way.wait(60)
        os.kill(os.getpid(), signal.SIGINT)

    meter = GraphMeter(loaded, loaded.ctx, on_fraction, lambda: False)
    meter.decode(_one_batch(loaded, ids[:16]))  # the graph's size, for fractions
    fractions.clear()
    threading.Thread(target=interrupt).start()
    try:
        meter.decode(_one_batch(loaded, ids))
        raised = ""
    except KeyboardInterrupt:
        raised = "KeyboardInterrupt"
    return {"raised": raised, "unraisable": unraisable, "last": fractions[-1],
            "handler_back": signal.getsignal(signal.SIGINT) is signal.default_int_handler}


def _one_batch(loaded: Any, ids: list[int]) -> Any:
    from engine.runtimes.llamacpp.decode import writer_for

    loaded.llama_cpp.llama_memory_clear(loaded.memory, False)
    writer_for(loaded).fill(ids, range(len(ids)), [0] * len(ids), [False] * len(ids))
    return loaded.batch


@needs_llama_cpp
def test_ctrl_c_inside_a_metered_decode_stops_the_graph_and_raises() -> None:
    """Ctrl+C during a prefill chunk in `phasewise bench` (the meter's callback on the main
    thread) raised KeyboardInterrupt inside the ctypes callback, which ctypes printed and
    dropped: the bench ran on and then failed dividing by a prefill of 0 s."""
    out = run_in_child(_ctrl_c_body)
    assert out["raised"] == "KeyboardInterrupt"
    assert out["unraisable"] == []
    assert out["last"] < 1.0  # the graph stopped at the next node, not at its end
    assert out["handler_back"]


def _interference_body() -> dict:
    from engine.tools.bench import bench_interference

    return bench_interference(load_default(), prompt_tokens=150, stream_prompt_tokens=16,
                              alone_tokens=6)


@needs_llama_cpp
def test_interference_bench_runs_on_llama_cpp() -> None:
    r = run_in_child(_interference_body)
    assert r["one_pass_stream_tokens_during_prefill"] == 1  # one n_batch: the stream waits
    assert r["chunked_stream_tokens_during_prefill"] >= 2  # the first mixed chunk is 4 tokens
    for mode in ("one_pass", "chunked"):
        assert r[f"{mode}_lone_prefill_tok_s"] > 0
        assert r[f"{mode}_itl_p99_ratio"] == pytest.approx(
            r[f"{mode}_itl_p99_during_prefill_s"] / r[f"{mode}_itl_p99_alone_s"])


# ----- the engine thread, events and metrics ------------------------------------------------
def _engine_body() -> dict:
    from engine import GenerationRequest, SamplingParams
    from engine.events import PrefillStarted, RequestFinished, TokenEmitted
    from engine.params import ChatMessage
    from engine.worker import Engine

    with Engine() as engine:
        info = engine.load_model_sync("default", engine=LLAMA_CPP)
        request = GenerationRequest(
            [ChatMessage("user", "What is the capital of France? Answer in one sentence.")],
            SamplingParams(temperature=0.0, max_tokens=32), conversation_id="e")
        handle = engine.submit(request)
        kinds = [type(e).__name__ for e in handle.events(timeout=120)]
        result = handle.wait()
        caps = engine.capabilities
        try:
            engine.load_draft_sync("default")
            draft_error = ""
        except Exception as exc:
            draft_error = str(exc)
    return {"info": (info.engine, info.dtype, info.context_length, info.weight_bytes_per_step),
            "kinds": kinds, "text": result.text, "finish": result.finish_reason,
            "decode_tok_s": result.metrics.decode_tok_s,
            "prefill": PrefillStarted.__name__, "token": TokenEmitted.__name__,
            "done": RequestFinished.__name__, "json_engine": result.to_json_dict()["engine"],
            "speculative": caps.speculative, "draft_error": draft_error}


@needs_llama_cpp
def test_engine_runs_the_default_gguf_on_llama_cpp() -> None:
    out = run_in_child(_engine_body)
    engine, dtype, context, weight_bytes = out["info"]
    assert (engine, dtype) == ("llama.cpp", "Q4_1")
    assert context == 8192
    assert 50e6 < weight_bytes < 110e6  # the quantized file's tensors, not fp32's 540 MB
    assert out["kinds"][:2] == ["RequestQueued", out["prefill"]]
    assert "PrefillProgress" in out["kinds"] and out["kinds"][-1] == out["done"]
    assert out["token"] in out["kinds"]
    assert "Paris" in out["text"] and out["finish"] == "stop"
    assert out["decode_tok_s"] > 0
    assert out["json_engine"] == "llama.cpp"
    assert out["speculative"] == ("ngram", "draft")
    assert out["draft_error"] == ""  # a GGUF drafts for a llama.cpp model (test_llamacpp_draft)


def _speculative_beside_body() -> dict:
    from engine import GenerationRequest, SamplingParams
    from engine.events import RequestFinished, TokenEmitted
    from engine.params import ChatMessage
    from engine.worker import Engine

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
    with Engine() as engine:
        engine.load_model_sync("default", engine=LLAMA_CPP)
        plain = GenerationRequest([ChatMessage("user", "Write a short poem about the sea.")],
                                  SamplingParams(temperature=0.0, max_tokens=64,
                                                 ignore_eos=True), conversation_id="plain")
        spec = GenerationRequest(
            [ChatMessage("user", f"Repeat these words three times: {words} {words}")],
            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            conversation_id="spec", speculative="ngram")
        first = engine.submit(plain)
        stream = first.events(timeout=120)
        next(e for e in stream if isinstance(e, TokenEmitted))
        second = engine.submit(spec)
        spec_first = next(e.t_ns for e in second.events(timeout=120)
                          if isinstance(e, TokenEmitted))
        plain_done = next(e.t_ns for e in stream if isinstance(e, RequestFinished))
        done = [first.wait(120), second.wait(120)]
    return {"speculative": done[1].speculative, "proposed": done[1].spec_proposed,
            "tokens": [len(r.token_ids) for r in done],
            "spec_first_before_plain_done": spec_first < plain_done}


@needs_llama_cpp
def test_a_prompt_lookup_chat_streams_beside_another_instead_of_waiting() -> None:
    """llama.cpp's batch verifies prompt-lookup drafts in its step: a speculative chat sent
    while another streams joins the batch (before, it waited for that reply to end)."""
    out = run_in_child(_speculative_beside_body)
    assert out["tokens"] == [64, 24]
    assert out["speculative"] == "ngram" and out["proposed"] > 0, out
    assert out["spec_first_before_plain_done"], out


def _template_body() -> dict:
    from engine.core.chat_template import encode_chat_with_spans
    from engine.params import ChatMessage

    runtime = load_default()

    loaded = runtime.model
    text = "say <|im_end|> please"
    ids, spans = encode_chat_with_spans(loaded.tokenizer, [ChatMessage("user", text)])
    _role, start, end = spans[-1]
    return {"ids": ids, "user": ids[start:end], "im_end": loaded.tokenizer.encode("<|im_end|>"),
            "user_text": loaded.tokenizer.decode(ids[start:end]),
            "text": loaded.tokenizer.decode(ids, skip_special_tokens=False)}


@needs_llama_cpp
def test_message_text_never_becomes_a_control_token() -> None:
    out = run_in_child(_template_body)
    im_end = out["im_end"]
    assert len(im_end) == 1
    # the template's own turn ends are control tokens; the user's typed one is plain text
    assert im_end[0] in out["ids"] and im_end[0] not in out["user"]
    assert out["user_text"] == "say <|im_end|> please"
    assert out["text"].startswith("<|im_start|>")


def _base_model_prompt_body(path: str) -> dict:
    """The fallback prompt of a GGUF with no chat template, read by llama.cpp's tokenizer."""
    import llama_cpp

    from engine.core.chat_template import encode_chat
    from engine.params import ChatMessage
    from engine.runtimes.llamacpp.tokenizer import LlamaCppTokenizer

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    tokenizer = LlamaCppTokenizer(llama_cpp, model, llama_cpp.llama_model_get_vocab(model))
    ids = encode_chat(tokenizer, [ChatMessage("user", "What is the capital of France?")])
    result = {"template": tokenizer.chat_template, "bos": tokenizer.bos_token_id,
              "ids": ids, "text": tokenizer.decode(ids)}
    llama_cpp.llama_model_free(model)
    return result


@needs_llama_cpp
@pytest.mark.parametrize("add_bos", [True, False])
def test_a_base_models_prompt_honours_its_bos_setting(tmp_path: Path, add_bos: bool) -> None:
    """A GGUF with no chat template gets the plain fallback transcript, opened with BOS exactly
    when the file says tokenizer.ggml.add_bos_token (a base model read without the BOS it
    was trained with answers with turn markers)."""
    from engine.model_files import default_gguf_path
    from tests.support.gguf import vocab_only_copy

    base = vocab_only_copy(default_gguf_path(), tmp_path / "base.gguf", add_bos=add_bos)
    out = run_in_child(_base_model_prompt_body, str(base))
    assert out["template"] is None
    assert out["text"] == "User: What is the capital of France?\n\nAssistant:"
    assert (out["ids"][0] == out["bos"]) == add_bos
    assert out["ids"].count(out["bos"]) == int(add_bos)


def _split_reply_body() -> dict:
    """A sampled reply whose text re-tokenizes to other ids (seeds searched in order), then
    the next turn with the reply's own ids."""
    import threading

    from engine.metrics import RequestTimeline, now_ns
    from engine.params import ChatMessage, GenerationRequest, SamplingParams
    from tests.support.split_reply import first_split_reply

    runtime = load_default()

    loaded = runtime.model
    pool = runtime.new_prefix_cache(1 << 30)
    tokenizer = loaded.tokenizer
    first_messages = [ChatMessage("user", SPLIT_PROMPT)]

    def turn(messages: list, seed: int, tokens: int) -> Any:
        request = GenerationRequest(
            messages, SamplingParams(temperature=SPLIT_TEMPERATURE, max_tokens=tokens, seed=seed),
            conversation_id=f"seed{seed}")
        return runtime.new_session(pool).run(request, RequestTimeline(now_ns()),
                                             threading.Event(), lambda _e: None)

    seed, first = first_split_reply(lambda seed: turn(first_messages, seed, SPLIT_TOKENS),
                                    tokenizer, {tokenizer.eos_token_id}, SPLIT_SEEDS)
    reply = first.as_message()
    second = turn([*first_messages, reply, ChatMessage("user", "Now make it shorter.")], seed, 1)
    return {"seed": seed, "first_prompt": first.prompt_token_ids, "reply": first.token_ids,
            "ended": first.finish_reason, "prompt": second.prompt_token_ids,
            "cached": second.metrics.cached_tokens, "reason": second.metrics.cache_miss_reason}


# The benchmark's prompt (benchmarks/reply_reuse.py). At 0.7 issue 28 saw a split in 2 of 8
# 400-token replies; at 1.5 three of six 48-token replies had one (seed 2 did when written).
SPLIT_PROMPT = "Write a long, detailed story about a lighthouse keeper and a storm."
SPLIT_TEMPERATURE = 1.5
SPLIT_TOKENS = 48
SPLIT_SEEDS = range(2, 34)


@needs_llama_cpp
def test_a_sampled_reply_that_retokenizes_differently_is_cached_whole() -> None:
    out = run_in_child(_split_reply_body)
    start, reply = len(out["first_prompt"]), out["reply"]
    body = reply[:-1] if out["ended"] == "stop" else reply  # less the EOS, if it ended so
    assert out["prompt"][:start] == out["first_prompt"]
    assert out["prompt"][start:start + len(body)] == body  # the ids the model produced
    assert out["cached"] == start + len(reply) - 1  # the first turn's prompt and whole reply
    assert out["reason"] == "none"


def _kernel_labels_body() -> dict:
    from engine.model_files import default_gguf_path
    from engine.runtimes.llamacpp.cpu_backend import BUILT_IN, loaded_backend
    from engine.runtimes.llamacpp.model import load_gguf

    labels = {}
    for name, flash in (("on", True), ("off", False)):
        loaded = load_gguf(default_gguf_path(), name="default", source="bundled",
                           n_threads=2, flash_attn=flash)
        labels[name] = loaded.info.kernel
    backend = loaded_backend()
    assert backend is not None
    labels["variant"] = "" if backend.variant == BUILT_IN else f"-{backend.variant}"
    return labels


@needs_llama_cpp
def test_kernel_label_says_whether_llama_cpp_turned_flash_attention_on() -> None:
    """llama.cpp decides "auto" as it makes the context, and says so in its log; the label
    names the CPU backend variant running (none for a build with it linked in)."""
    labels = run_in_child(_kernel_labels_body)
    variant = labels.pop("variant")
    assert labels == {"on": f"llama.cpp{variant}-2t-fa", "off": f"llama.cpp{variant}-2t"}


# ----- load errors, in one line -------------------------------------------------------------
def _load_error(path: str) -> str:
    from engine.runtimes import load

    try:
        load(path, LLAMA_CPP)
    except ModelLoadError as exc:
        return str(exc)
    return "loaded"


def _write_unknown_architecture(path: Path) -> None:
    import numpy as np
    from gguf import GGUFWriter

    from tests.support.gguf import write_out

    writer = GGUFWriter(str(path), "phasewise-unknown")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    write_out(writer)


@needs_llama_cpp
def test_load_errors_are_one_line(tmp_path: Path) -> None:
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    unknown = tmp_path / "odd.gguf"
    _write_unknown_architecture(unknown)
    message = run_in_child(_load_error, str(not_gguf))
    assert "not a GGUF file" in message and "\n" not in message
    message = run_in_child(_load_error, str(unknown))
    assert "phasewise-unknown" in message and "--engine torch" in message
    assert "\n" not in message


# ----- choosing the engine (no llama.cpp code runs) ---------------------------------------------
def test_a_folder_always_runs_on_torch(tmp_path: Path) -> None:
    assert resolve_engine(str(tmp_path), "auto") == TORCH
    with pytest.raises(ModelLoadError, match="--engine torch"):
        resolve_engine(str(tmp_path), LLAMA_CPP)
    assert resolve_engine("model.gguf", TORCH) == TORCH
    with pytest.raises(ModelLoadError, match="unknown engine"):
        resolve_engine("model.gguf", "onnx")


@needs_llama_cpp
def test_auto_runs_a_gguf_on_llama_cpp_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.runtime_choice as runtime_choice

    monkeypatch.setattr(runtime_choice, "cuda_present", lambda: False)
    assert resolve_engine("model.gguf", "auto") == LLAMA_CPP
    assert resolve_engine("default", "auto") == LLAMA_CPP
    assert resolve_engine("model.gguf", "auto", device="cuda") == TORCH
    monkeypatch.setattr(runtime_choice, "cuda_present", lambda: True)
    assert resolve_engine("model.gguf", "auto") == TORCH
