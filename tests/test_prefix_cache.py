"""Prefix KV cache: reuse across turns and conversations, the ledger, budget, exactness."""

import threading

import pytest
import torch

from engine import ChatMessage, Engine, GenerationRequest, SamplingParams, TokenEmitted
from engine.loader import load_model
from engine.prefix_cache import PrefixCache, cache_nbytes, common_prefix_len

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
SYSTEM = ChatMessage("system", "You are terse.")


def turn(engine: Engine, conv: str, messages: list[ChatMessage], params=GREEDY, **kw):
    return engine.submit(GenerationRequest(list(messages), params, conversation_id=conv,
                                           **kw)).wait(60)


def chat_two_turns(engine: Engine, conv: str = "c1"):
    first = [SYSTEM, ChatMessage("user", "Hello there")]
    r1 = turn(engine, conv, first)
    second = [*first, ChatMessage("assistant", r1.text), ChatMessage("user", "And then?")]
    return r1, second, turn(engine, conv, second)


def test_second_turn_prefills_only_new_tokens(tiny_engine: Engine) -> None:
    r1, _, r2 = chat_two_turns(tiny_engine)
    assert r1.metrics.cache_miss_reason == "first_turn"
    assert r1.metrics.cached_tokens == 0
    m = r2.metrics
    assert m.cache_miss_reason in ("none", "template_mismatch")
    assert m.cached_tokens >= r1.metrics.prompt_tokens
    assert m.prompt_tokens == m.cached_tokens + m.prefilled_tokens


def test_regenerate_reuses_all_but_the_last_prompt_token(tiny_engine: Engine) -> None:
    _, second, r2 = chat_two_turns(tiny_engine)
    again = turn(tiny_engine, "c1", second)
    assert again.metrics.cached_tokens == again.metrics.prompt_tokens - 1
    assert again.metrics.cache_miss_reason == "none"
    assert again.token_ids == r2.token_ids


def test_edit_earlier_message_reuses_up_to_the_edit(tiny_engine: Engine) -> None:
    _, second, _ = chat_two_turns(tiny_engine)
    edited = [SYSTEM, ChatMessage("user", "Hello here"), *second[2:]]
    before = turn(tiny_engine, "c1", second).prompt_token_ids
    r = turn(tiny_engine, "c1", edited)
    assert r.metrics.cache_miss_reason == "edited_history"
    assert r.metrics.cached_tokens == common_prefix_len(before, r.prompt_token_ids) > 0


def test_changed_system_prompt_is_named(tiny_engine: Engine) -> None:
    _, second, _ = chat_two_turns(tiny_engine)
    changed = [ChatMessage("system", "You are verbose."), *second[1:]]
    assert turn(tiny_engine, "c1", changed).metrics.cache_miss_reason == "system_prompt_changed"


def test_new_chat_with_same_system_prompt_reuses_it(tiny_engine: Engine) -> None:
    turn(tiny_engine, "a", [SYSTEM, ChatMessage("user", "Hello there")])
    r = turn(tiny_engine, "b", [SYSTEM, ChatMessage("user", "Something else")])
    assert r.metrics.cache_miss_reason == "first_turn"
    assert r.metrics.cached_tokens > 5  # at least the system turn
    # the donor chat is still warm
    assert "a" in tiny_engine.prefix_cache.conversations()


def test_budget_evicts_lru_and_says_so(tiny_model_dir) -> None:
    with Engine(cache_budget_bytes=12_000) as engine:
        engine.load_model_sync(str(tiny_model_dir))
        pool = engine.prefix_cache
        turn(engine, "a", [ChatMessage("user", "Hello there")])
        turn(engine, "b", [ChatMessage("user", "Something else entirely")])
        assert pool.used_bytes <= pool.budget_bytes
        assert pool.evictions >= 1
        r = turn(engine, "a", [ChatMessage("user", "Hello there"),
                               ChatMessage("assistant", "x"), ChatMessage("user", "more")])
        assert r.metrics.cache_miss_reason == "evicted"
        assert pool.used_bytes <= pool.budget_bytes


def test_model_switch_drops_the_pool(tiny_engine: Engine, tiny_model_dir) -> None:
    turn(tiny_engine, "c1", [ChatMessage("user", "Hello there")])
    tiny_engine.load_model_sync(str(tiny_model_dir))
    assert tiny_engine.prefix_cache.used_bytes == 0
    r = turn(tiny_engine, "c1", [ChatMessage("user", "Hello there"),
                                 ChatMessage("assistant", "x"), ChatMessage("user", "more")])
    assert r.metrics.cache_miss_reason == "model_changed"


def test_context_overflow_drop_oldest_keeps_system(tiny_engine: Engine) -> None:
    history = [SYSTEM]
    for i in range(12):
        history += [ChatMessage("user", f"Question {i} about Paris and Berlin?"),
                    ChatMessage("assistant", "The capital of France is Paris. " * 2)]
    history.append(ChatMessage("user", "Last question"))
    with pytest.raises(Exception, match="over the model's context"):
        turn(tiny_engine, "long", history)
    r = turn(tiny_engine, "long", history, overflow="drop_oldest")
    assert r.metrics.cache_miss_reason in ("dropped_old_turns", "first_turn")
    assert r.metrics.prompt_tokens < 256
    assert r.dropped_messages > 0 and r.to_json_dict()["dropped_messages"] == r.dropped_messages
    # Alternatives share the prompt, so each says the same turns were left out.
    request = GenerationRequest(history, SamplingParams(temperature=0.8, max_tokens=3, seed=1),
                                conversation_id="long-alts", overflow="drop_oldest")
    alternatives = [h.wait(60) for h in tiny_engine.submit_alternatives(request, 2)]
    assert [a.dropped_messages for a in alternatives] == [r.dropped_messages] * 2
    # A speculative request runs alone (not in the batch): it counts them too.
    alone = turn(tiny_engine, "long-spec", history, overflow="drop_oldest", speculative="ngram")
    assert alone.dropped_messages == r.dropped_messages
    assert turn(tiny_engine, "short", [SYSTEM, ChatMessage("user", "Hi")],
                overflow="drop_oldest").dropped_messages == 0
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tiny_engine.model_info.path).decode(r.prompt_token_ids)
    assert "You are terse." in prompt and "Last question" in prompt
    assert "Question 0 " not in prompt


def test_cancelled_reply_leaves_cache_consistent(tiny_engine: Engine, tiny_model_dir) -> None:
    request = GenerationRequest([SYSTEM, ChatMessage("user", "Hello there")],
                                SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                                conversation_id="c")
    tiny_engine.add_listener(
        lambda e: isinstance(e, TokenEmitted) and e.request_id == request.request_id
        and e.index == 3 and tiny_engine.cancel(request.request_id))
    partial = tiny_engine.submit(request).wait(60)
    assert partial.finish_reason == "cancelled"
    follow = [SYSTEM, ChatMessage("user", "Hello there"),
              ChatMessage("assistant", partial.text), ChatMessage("user", "Go on")]
    warm = turn(tiny_engine, "c", follow, SamplingParams(temperature=0, max_tokens=12))
    with Engine() as other:
        other.load_model_sync(str(tiny_model_dir))
        cold = turn(other, "c", follow, SamplingParams(temperature=0, max_tokens=12))
    assert warm.metrics.cached_tokens > 0 and cold.metrics.cached_tokens == 0
    assert warm.token_ids == cold.token_ids


def cold_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1]


def cached_logits(model, pool: PrefixCache, conv: str, ids: list[int]) -> tuple[torch.Tensor, int]:
    """Logits of ids computed on top of whatever prefix the pool can lend; returns them and
    how many tokens came from cache. The computed cache goes back to the pool."""
    lease = pool.acquire(conv, ids)
    rest = ids[lease.cached_tokens :]
    out = model(input_ids=torch.tensor([rest]), cache=lease.cache, use_cache=True,
                logits_to_keep=1)
    lease.ids.extend(rest)
    pool.release(lease)
    return out.logits[0, -1], lease.cached_tokens


def assert_cached_matches_cold(loaded, prompt: list[int], cut: int) -> None:
    model = loaded.model
    pool = PrefixCache(model.config, budget_bytes=1 << 34)
    other = prompt[:cut] + prompt[cut + 1 :][::-1]
    with torch.inference_mode():
        _, cached = cached_logits(model, pool, "a", prompt)
        assert cached == 0
        # regenerate: everything but the last token comes from cache
        warm, cached = cached_logits(model, pool, "a", prompt)
        assert cached == len(prompt) - 1
        assert torch.allclose(warm, cold_logits(model, prompt), atol=1e-4)
        # another chat sharing `cut` tokens: a cropped copy of chat a's cache
        warm, cached = cached_logits(model, pool, "b", other)
        assert cached == cut
        assert torch.allclose(warm, cold_logits(model, other), atol=1e-4)


def test_cached_and_cold_logits_agree_tiny(tiny_model_dir) -> None:
    loaded = load_model(str(tiny_model_dir))
    prompt = loaded.tokenizer("The capital of France is Paris. Hello there!")["input_ids"]
    assert_cached_matches_cold(loaded, prompt, cut=5)


def test_cache_bytes_are_counted(tiny_model_dir) -> None:
    loaded = load_model(str(tiny_model_dir))
    pool = PrefixCache(loaded.model.config, budget_bytes=1 << 30)
    lease = pool.acquire("x", [1, 2, 3, 4])
    with torch.inference_mode():
        loaded.model(input_ids=torch.tensor([[1, 2, 3]]), cache=lease.cache, use_cache=True)
    lease.ids.extend([1, 2, 3])
    # 2 layers x (K + V) x 2 kv heads x 16 head dim x 3 positions x 4 bytes
    assert cache_nbytes(lease.cache) == 2 * 2 * 2 * 16 * 3 * 4
    pool.release(lease)
    assert pool.used_bytes == cache_nbytes(lease.cache)


def test_engine_thread_is_the_only_cache_user(tiny_engine: Engine) -> None:
    names = set()
    tiny_engine.add_listener(lambda e: names.add(threading.current_thread().name))
    turn(tiny_engine, "c", [ChatMessage("user", "Hello")])
    assert "phasewise-engine" in names


def test_drop_oldest_drops_the_fewest_messages(tiny_engine: Engine) -> None:
    """Binary search finds the same cut as dropping one message at a time would."""
    from engine.generate import prepare_prompt

    loaded = tiny_engine._loaded
    history = [SYSTEM]
    for i in range(10):
        history += [ChatMessage("user", f"Question {i} about Paris?"),
                    ChatMessage("assistant", "The capital of France is Paris.")]
    history.append(ChatMessage("user", "Last question"))
    request = GenerationRequest(history, GREEDY, overflow="drop_oldest")
    prompt = prepare_prompt(loaded, request)
    # brute force: the first count of oldest droppable messages whose prompt fits
    droppable = [i for i, m in enumerate(history[:-1]) if m.role != "system"]
    for count in range(len(droppable) + 1):
        kept = [m for i, m in enumerate(history) if i not in set(droppable[:count])]
        if _fits(loaded, kept):
            assert prompt.ids == prepare_prompt(loaded, GenerationRequest(kept, GREEDY)).ids
            assert prompt.dropped_messages == count > 0
            return
    raise AssertionError("nothing fits")


def _fits(loaded, messages) -> bool:
    from engine.chat_template import encode_chat

    return len(encode_chat(loaded.tokenizer, messages)) + 1 <= loaded.info.context_length
