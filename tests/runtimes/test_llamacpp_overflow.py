"""A chat over the context on the llama.cpp engine: overflow="drop_oldest" leaves the oldest
turns out, and the result says how many (the window's one-line note reads it). In a child
process, as every llama.cpp test (tests/support/child.py's run_in_child)."""

from __future__ import annotations

from typing import Any

from tests.support.child import needs_llama_cpp, run_in_child

CONTEXT = 256  # a small context for the default model, so a few turns outgrow it


def _overflow_body() -> dict[str, Any]:
    from engine import ChatMessage, GenerationRequest, SamplingParams
    from engine.errors import PhasewiseError
    from engine.worker import Engine

    history = [ChatMessage("system", "You are terse.")]
    for i in range(12):
        history += [ChatMessage("user", f"Question {i} about Paris and Berlin?"),
                    ChatMessage("assistant", "The capital of France is Paris. " * 2)]
    history.append(ChatMessage("user", "Last question"))
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with Engine() as engine:
        info = engine.load_model_sync("default", engine="llama.cpp", context_length=CONTEXT)
        try:
            engine.submit(GenerationRequest(history, greedy, conversation_id="a")).wait(120)
            refused = ""
        except PhasewiseError as exc:
            refused = str(exc)
        one = engine.submit(GenerationRequest(history, greedy, conversation_id="a",
                                              overflow="drop_oldest")).wait(120)
        sampled = SamplingParams(temperature=0.8, max_tokens=3, seed=1)
        request = GenerationRequest(history, sampled, conversation_id="b", overflow="drop_oldest")
        alternatives = [h.wait(120) for h in engine.submit_alternatives(request, 2)]
        alone = engine.submit(GenerationRequest(history, greedy, conversation_id="d",
                                                overflow="drop_oldest", speculative="ngram"))
        alone_dropped = alone.wait(120).dropped_messages  # run alone, not in the batch
        short = engine.submit(GenerationRequest(history[:2], greedy, conversation_id="c",
                                                overflow="drop_oldest")).wait(120)
        prompt = engine._runtime.tokenizer.decode(one.prompt_token_ids)
    return {"engine": info.engine, "context": info.context_length, "refused": refused,
            "dropped": one.dropped_messages, "prompt_tokens": one.metrics.prompt_tokens,
            "prompt": prompt, "alternatives": [a.dropped_messages for a in alternatives],
            "short": short.dropped_messages, "alone": alone_dropped,
            "capable": engine.capabilities.drop_oldest_turns}


@needs_llama_cpp
def test_drop_oldest_on_llama_cpp_fits_the_prompt_and_counts_what_it_left_out() -> None:
    out = run_in_child(_overflow_body)
    assert (out["engine"], out["context"], out["capable"]) == ("llama.cpp", CONTEXT, True)
    assert f"over the model's context of {CONTEXT} tokens" in out["refused"]
    assert out["dropped"] > 0 and out["prompt_tokens"] + 1 <= CONTEXT
    assert "You are terse." in out["prompt"] and "Last question" in out["prompt"]
    assert "Question 0 " not in out["prompt"]
    assert out["alternatives"] == [out["dropped"]] * 2  # one prompt, the same turns left out
    assert out["alone"] == out["dropped"]
    assert out["short"] == 0
