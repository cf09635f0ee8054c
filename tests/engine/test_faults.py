"""Engine faults: out of memory mid-prefill/decode, send/stop storms, empty input, no prompt
text in logs, and multi-byte characters split across tokens."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from transformers import AutoTokenizer

from engine import ChatMessage, GenerationRequest, RequestFailed, SamplingParams, TokenEmitted
from engine.errors import PhasewiseError
from engine.worker import OUT_OF_MEMORY_MESSAGE, Engine
from tests.support.fault_injection import ForwardFault, ScriptedTokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
HISTORY = [ChatMessage("system", "You are terse."), ChatMessage("user", "Hello there")]
FOLLOW_UP = [*HISTORY, ChatMessage("assistant", "Hi."), ChatMessage("user", "And Paris?")]
OOM_ERRORS = {
    "cuda": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "cpu": RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"),
}


def turn(engine: Engine, messages: list[ChatMessage], **kw) -> GenerationRequest:
    return GenerationRequest(list(messages), kw.pop("params", GREEDY), conversation_id="c", **kw)


@pytest.mark.parametrize("kind", sorted(OOM_ERRORS))
@pytest.mark.parametrize(("phase", "at"), [("prefill", 1), ("decode", 3)])
def test_out_of_memory_ends_the_reply_frees_the_cache_and_recovers(
    tiny_engine: Engine, kind: str, phase: str, at: int
) -> None:
    tiny_engine.submit(turn(tiny_engine, HISTORY)).wait(60)
    assert tiny_engine.prefix_cache.used_bytes > 0
    fault = ForwardFault(tiny_engine)
    fault.arm(OOM_ERRORS[kind], at=at)
    handle = tiny_engine.submit(turn(tiny_engine, FOLLOW_UP))

    with pytest.raises(PhasewiseError) as failure:
        handle.wait(60)
    assert fault.fired == 1
    assert str(failure.value) == OUT_OF_MEMORY_MESSAGE and "\n" not in OUT_OF_MEMORY_MESSAGE
    assert tiny_engine.prefix_cache.used_bytes == 0  # every cached prefix was freed
    fault.remove()
    again = tiny_engine.submit(turn(tiny_engine, FOLLOW_UP)).wait(60)
    cold = tiny_engine.submit(turn(tiny_engine, FOLLOW_UP, reuse_cache=False)).wait(60)
    assert again.metrics.cache_miss_reason == "evicted"
    assert again.token_ids == cold.token_ids


def test_other_forward_errors_fail_in_one_line_and_keep_the_pool(tiny_engine: Engine) -> None:
    tiny_engine.submit(turn(tiny_engine, HISTORY)).wait(60)
    other = GenerationRequest(HISTORY, GREEDY, conversation_id="other")
    fault = ForwardFault(tiny_engine)
    fault.arm(ValueError("bad shape\nsecond line"), at=2)
    with pytest.raises(PhasewiseError, match=r"^generation failed: ValueError: bad shape$"):
        tiny_engine.submit(other).wait(60)
    fault.remove()
    assert tiny_engine.prefix_cache.conversations() == ["c"]
    assert tiny_engine.submit(turn(tiny_engine, HISTORY)).wait(60).metrics.cached_tokens > 0


def test_hundred_send_stop_cycles_leave_the_engine_consistent(tiny_engine: Engine) -> None:
    def stop_at_first_token(event) -> None:
        if isinstance(event, TokenEmitted) and event.index == 0:
            tiny_engine.cancel(event.request_id)

    tiny_engine.add_listener(stop_at_first_token)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    handles = []
    for i in range(100):
        handle = tiny_engine.submit(turn(tiny_engine, HISTORY, params=long))
        if i % 2:
            handle.cancel()  # stopped before it even starts
        handles.append(handle)
    results = [h.wait(60) for h in handles]

    assert {r.finish_reason for r in results} == {"cancelled"}
    assert max(r.metrics.output_tokens for r in results) <= 1
    assert tiny_engine._active == {}
    assert tiny_engine.prefix_cache.used_bytes <= tiny_engine.prefix_cache.budget_bytes
    tiny_engine._listeners.remove(stop_at_first_token)
    warm = tiny_engine.submit(turn(tiny_engine, FOLLOW_UP)).wait(60)
    cold = tiny_engine.submit(turn(tiny_engine, FOLLOW_UP, reuse_cache=False)).wait(60)
    assert warm.metrics.cached_tokens > 0 and warm.token_ids == cold.token_ids


@pytest.mark.parametrize("text", ["", "   ", "\n\t \u3000"])
def test_empty_or_whitespace_message_is_refused(tiny_engine: Engine, text: str) -> None:
    handle = tiny_engine.submit(GenerationRequest([ChatMessage("user", text)], GREEDY))
    with pytest.raises(PhasewiseError, match="prompt is empty"):
        handle.wait(60)
    assert isinstance(list(handle.events(timeout=5))[-1], RequestFailed)


def test_logs_hold_no_prompt_text(tiny_engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    secret = "zebra-secret-7f3a"
    caplog.set_level(logging.DEBUG)
    messages = [ChatMessage("system", f"system {secret}"), ChatMessage("user", f"hi {secret}")]
    tiny_engine.submit(GenerationRequest(messages, GREEDY)).wait(60)
    fault = ForwardFault(tiny_engine)
    for error in (RuntimeError("kernel fault"), OOM_ERRORS["cpu"]):
        fault.arm(error, at=2)
        with pytest.raises(PhasewiseError):
            tiny_engine.submit(GenerationRequest(messages, GREEDY)).wait(60)
    fault.remove()
    assert caplog.records, "the failures were logged"
    assert secret not in caplog.text
    assert all(secret not in r.getMessage() for r in caplog.records)


def test_emoji_and_cjk_split_across_tokens_stream_without_replacement_chars(
    tiny_engine: Engine,
) -> None:
    text = "😀🎉 你好世界 𝔘𝔫𝔦 é done"
    tokenizer = AutoTokenizer.from_pretrained(tiny_engine.model_info.path)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split()), "multi-byte characters span several tokens"
    script = ScriptedTokens(tiny_engine, ids)
    params = SamplingParams(temperature=0.0, max_tokens=len(ids), ignore_eos=True)
    handle = tiny_engine.submit(GenerationRequest([ChatMessage("user", "Hi")], params))
    pieces = [e.text for e in handle.events(timeout=60) if hasattr(e, "text")]
    script.remove()
    assert handle.wait().token_ids == ids
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == handle.wait().text == text


def test_cancel_from_many_threads_at_once_is_safe(tiny_engine: Engine) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    handle = tiny_engine.submit(turn(tiny_engine, HISTORY, params=long))
    threads = [threading.Thread(target=handle.cancel) for _ in range(8)]
    threads += [threading.Thread(target=tiny_engine.cancel_all) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert handle.wait(60).finish_reason == "cancelled"
