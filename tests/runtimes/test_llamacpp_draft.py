"""Draft-model speculation on the llama.cpp engine (engine/runtimes/llamacpp/draft.py).

The bundled GGUF drafts for itself (a self-draft is a valid draft: the same vocabulary, and
its proposals are the target's own one-token choices). Everything that runs llama.cpp runs
in a spawned child (run_in_child).

llama.cpp's multi-row verify pass is not bitwise equal to its one-token step on this CPU
(measured on the bundled Q4_1 file: the gap between the top two logits moved by up to 0.38,
mean 0.12), so greedy output with a draft equals plain greedy token for token up to the
first step whose top-two margin is within VERIFY_TIE; after it, either token is right.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support.child import CHILD_TIMEOUT_S, needs_llama_cpp, run_in_child

pytestmark = [needs_llama_cpp, pytest.mark.timeout(CHILD_TIMEOUT_S + 60)]
VERIFY_TIE = 0.5  # logits: a margin this small may flip between one-row and multi-row passes
PROMPT = "What is the capital of France? Answer in one sentence."  # no near-tie in 18 tokens
TOKENS = 32


def _request(ids: list[int], *, temperature: float = 0.0, conversation: str | None = None,
             reuse: bool = False, seed: int | None = None) -> Any:
    from engine.params import GenerationRequest, SamplingParams

    return GenerationRequest(
        [], SamplingParams(temperature=temperature, max_tokens=TOKENS, ignore_eos=True,
                           seed=seed),
        prompt_token_ids=ids, conversation_id=conversation, reuse_cache=reuse,
        speculative="draft")


def _run(runtime: Any, pool: Any, draft: Any, request: Any, cancel: Any = None,
         on_token: Any = None) -> Any:
    import threading

    from engine.events import TokenEmitted
    from engine.metrics import RequestTimeline, now_ns


    def emit(event: Any) -> None:
        if on_token is not None and isinstance(event, TokenEmitted):
            on_token()

    return runtime.new_session(pool, draft).run(
        request, RequestTimeline(now_ns()), cancel or threading.Event(), emit)


def _agree_until_tie(got: list[int], want: list[int], margins: list[float]) -> int:
    """How many leading tokens were compared before the first tie (-1: they differ)."""
    for i, (a, b, margin) in enumerate(zip(got, want, margins, strict=True)):
        if margin < VERIFY_TIE:
            return i
        if a != b:
            return -1
    return len(want)


# ----- greedy exactness, acceptance, the draft's KV in step -----------------------------------
def _greedy_body() -> dict:
    from engine.runtimes import LLAMA_CPP, load
    from tests.support.llamacpp import alone_with_margins, chat_ids

    runtime = load("default", LLAMA_CPP)
    loaded = runtime.model
    draft = runtime.load_draft("default")
    pool = runtime.new_prefix_cache(1 << 30)
    ids = chat_ids(loaded, PROMPT)
    plain, margins = alone_with_margins(loaded, pool, ids, TOKENS)
    first = _run(runtime, pool, draft, _request(ids, conversation="c", reuse=True))
    # a follow-up turn on the cached sequence: the draft re-syncs its own KV to the new prompt
    follow = ids + first.token_ids[:-1]
    follow_plain, follow_margins = alone_with_margins(loaded, pool, follow, TOKENS)
    second = _run(runtime, pool, draft, _request(follow, conversation="c", reuse=True))
    return {"plain": plain, "margins": margins, "first": first.token_ids,
            "proposed": first.spec_proposed, "accepted": first.spec_accepted,
            "method": first.speculative, "json": first.to_json_dict(),
            "second": second.token_ids, "second_cached": second.metrics.cached_tokens,
            "follow_plain": follow_plain, "follow_margins": follow_margins,
            "second_accepted": second.spec_accepted, "second_proposed": second.spec_proposed,
            "draft_ids": len(draft.ids), "follow_len": len(follow)}


def test_self_draft_greedy_equals_plain_and_counts_acceptance() -> None:
    out = run_in_child(_greedy_body)
    assert out["method"] == "draft"
    compared = _agree_until_tie(out["first"], out["plain"], out["margins"])
    assert compared >= 12, out  # the first tokens of this prompt are no near-ties
    assert 0 < out["accepted"] <= out["proposed"]
    # a self-draft is rejected only where the two passes disagree on a near-tie
    assert out["accepted"] >= 0.5 * out["proposed"], out
    assert out["json"]["spec_proposed"] == out["proposed"]
    assert out["json"]["spec_accepted"] == out["accepted"]
    assert out["second_cached"] > 0
    assert _agree_until_tie(out["second"], out["follow_plain"], out["follow_margins"]) != -1
    assert 0 < out["second_accepted"] <= out["second_proposed"]
    # the draft's sequence holds the accepted tokens of the last turn, never more
    assert out["follow_len"] < out["draft_ids"] <= out["follow_len"] + TOKENS


# ----- sampled requests: the speculative sampling rule, reproducible with a seed ---------------
def _sampled_body() -> dict:
    from engine.runtimes import LLAMA_CPP, load
    from tests.support.llamacpp import chat_ids

    runtime = load("default", LLAMA_CPP)
    loaded = runtime.model
    draft = runtime.load_draft("default")
    ids = chat_ids(loaded, PROMPT)
    runs = []
    for _ in range(2):
        draft.reset()
        pool = runtime.new_prefix_cache(1 << 30)  # a new pool clears the context's memory
        runs.append(_run(runtime, pool, draft, _request(ids, temperature=0.8, seed=7)))
    return {"tokens": [r.token_ids for r in runs],
            "accepted": [r.spec_accepted for r in runs],
            "proposed": [r.spec_proposed for r in runs]}


def test_sampled_self_draft_accepts_and_repeats_with_the_seed() -> None:
    out = run_in_child(_sampled_body)
    first, again = out["tokens"]
    assert len(first) == TOKENS and first == again
    assert out["accepted"][0] > 0 and out["accepted"][0] <= out["proposed"][0]


# ----- Stop within a step -----------------------------------------------------------------------
def _cancel_body() -> dict:
    import threading

    from engine.runtimes import LLAMA_CPP, load
    from tests.support.llamacpp import chat_ids

    runtime = load("default", LLAMA_CPP)
    loaded = runtime.model
    draft = runtime.load_draft("default")
    pool = runtime.new_prefix_cache(1 << 30)
    ids = chat_ids(loaded, PROMPT)
    reference = _run(runtime, pool, draft, _request(ids)).token_ids
    # Stop pressed as the third token is shown: no later row of the verified draft is emitted
    cancel, seen = threading.Event(), []

    def third() -> None:
        seen.append(1)
        if len(seen) == 3:
            cancel.set()

    emitted = _run(runtime, pool, draft, _request(ids, conversation="s", reuse=True), cancel,
                   third)
    # Stop pressed while the draft model proposes: the verify pass never runs
    cancel = threading.Event()
    original = draft.propose

    def propose_then_stop(*args: Any, **kwargs: Any) -> list[int]:
        tokens: list[int] = original(*args, **kwargs)
        cancel.set()
        return tokens

    draft.propose = propose_then_stop  # type: ignore[method-assign]
    proposing = _run(runtime, pool, draft, _request(ids), cancel)
    draft.propose = original  # type: ignore[method-assign]
    after = _run(runtime, pool, draft, _request(ids, conversation="s", reuse=True))
    return {"reference": reference,
            "emitted": (emitted.finish_reason, emitted.token_ids),
            "proposing": (proposing.finish_reason, proposing.token_ids,
                          proposing.spec_proposed),
            "after": (after.token_ids, after.metrics.cached_tokens)}


def test_cancel_stops_within_a_step_and_the_sequence_stays_exact() -> None:
    out = run_in_child(_cancel_body)
    finish, tokens = out["emitted"]
    assert finish == "cancelled" and tokens == out["reference"][:3]
    finish, tokens, proposed = out["proposing"]
    assert finish == "cancelled" and tokens == out["reference"][:1] and proposed == 0
    after, cached = out["after"]
    assert cached > 0 and after == out["reference"]  # the cancelled turn left a clean prefix


# ----- refused in one line ------------------------------------------------------------------------
def _patch_a_token(path: Path) -> str:
    """Rewrite one sampled token's text in place (same length): another vocabulary."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path), "r+")
    field = reader.fields["tokenizer.ggml.tokens"]
    token = 768  # one of the evenly spaced ids the check compares
    piece = field.parts[field.data[token]]
    known = {bytes(field.parts[i]) for i in field.data}
    for filler in b"~^`|":
        text = bytes([filler]) * len(piece)
        if text not in known:
            piece[:] = list(text)
            break
    reader.data.flush()
    return text.decode()


def _draft_error(spec: str) -> str:
    from engine.errors import ModelLoadError
    from engine.runtimes import LLAMA_CPP, load

    runtime = load("default", LLAMA_CPP)
    try:
        runtime.load_draft(spec)
    except ModelLoadError as exc:
        return str(exc)
    return "loaded"


def test_a_draft_with_another_vocabulary_is_refused_in_one_line(tmp_path: Path) -> None:
    from engine.model_files import default_gguf_path

    other = tmp_path / "other-vocab.gguf"
    shutil.copy(default_gguf_path(), other)
    text = _patch_a_token(other)
    message = run_in_child(_draft_error, str(other))
    assert "does not share the vocabulary" in message and "\n" not in message
    assert "token 768" in message and text in message
    message = run_in_child(_draft_error, str(tmp_path))  # a folder: not a GGUF
    assert ".gguf" in message and "\n" not in message


# ----- the engine thread: LoadDraft, capabilities, events ----------------------------------------
def _engine_body() -> dict:
    from engine import GenerationRequest, SamplingParams
    from engine.events import DraftModelChanged
    from engine.params import ChatMessage
    from engine.runtimes import LLAMA_CPP
    from engine.worker import Engine

    changes: list[Any] = []
    with Engine() as engine:
        engine.add_listener(lambda e: changes.append(e) if isinstance(e, DraftModelChanged)
                            else None)
        engine.load_model_sync("default", engine=LLAMA_CPP)
        engine.load_draft_sync("default", engine=LLAMA_CPP, kernel="auto")
        caps = engine.capabilities
        request = GenerationRequest(
            [ChatMessage("user", "What is the capital of France? Answer in one sentence.")],
            SamplingParams(temperature=0.0, max_tokens=24), speculative="draft")
        result = engine.submit(request).wait(300)
    return {"caps": (caps.speculative, caps.draft_model), "text": result.text,
            "method": result.speculative, "accepted": result.spec_accepted,
            "changes": [(c.name, c.kernel) for c in changes]}


def test_engine_loads_a_gguf_draft_for_a_llama_cpp_model() -> None:
    out = run_in_child(_engine_body)
    assert out["caps"] == (("ngram", "draft"), True)
    assert out["changes"][0][0] == "SmolLM2-135M-Instruct"
    assert "llama.cpp" in out["changes"][0][1]
    assert out["method"] == "draft" and out["accepted"] > 0
    assert "Paris" in out["text"]
