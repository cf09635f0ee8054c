"""Prefix KV cache: reuse across turns and conversations, the ledger, budget, exactness."""

import threading

import pytest
import torch

from engine import ChatMessage, GenerationRequest, SamplingParams, TokenEmitted
from engine.core.ledger import common_prefix_len
from engine.runtimes.torch.loader import load_model
from engine.runtimes.torch.prefix_cache import PrefixCache, cache_nbytes
from engine.worker import Engine
from tests.support.prefix_cache import assert_cached_matches_cold, feed

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
    from engine.core.prompt import prepare_prompt

    loaded = tiny_engine._runtime
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
    from engine.core.chat_template import encode_chat

    return len(encode_chat(loaded.tokenizer, messages)) + 1 <= loaded.info.context_length


# ----- the pool's record on its own (mutation testing, `make mutation`) -------------------------
# A stand-in for a model: a one-layer KV cache whose position i holds the token id fed there, so
# a test can read back which tokens a cache holds. 8 bytes a position (K + V, one float32 each).
POSITION_BYTES = 8


def held(cache) -> list[int]:
    return [int(v) for v in cache.layers[0].keys.flatten()] if cache.get_seq_length() else []


def run_turn(pool: PrefixCache, conv, prompt: list[int], layout=None, reply: int = 0):
    """acquire, prefill what is missing (plus `reply` fed-back tokens), release."""
    lease = pool.acquire(conv, prompt, layout)
    assert held(lease.cache) == lease.ids == prompt[: lease.cached_tokens]
    feed(lease, prompt[lease.cached_tokens :] + list(range(900, 900 + reply)))
    pool.release(lease)
    return lease


def test_common_prefix_len_of_lists_and_tuples() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 3]) == 3
    assert common_prefix_len([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix_len([1, 2, 3], (1, 2, 4)) == 2  # a list and a tuple: the slow walk
    assert common_prefix_len([1, 2], (1, 2, 3)) == 2
    assert common_prefix_len([7], [8]) == 0
    assert common_prefix_len([], [1]) == 0


def test_first_turn_then_regenerate_then_next_turn() -> None:
    pool = PrefixCache(None, budget_bytes=1 << 20)
    first = run_turn(pool, "c", [1, 2, 3, 4, 5], reply=2)
    assert (first.cached_tokens, first.miss_reason, first.conversation_id) == (0, "first_turn", "c")
    assert first.checkpoint_at is None and first.checkpoint is None  # not a recurrent model
    assert pool.conversations() == ["c"]
    assert pool.used_bytes == 7 * POSITION_BYTES
    again = pool.acquire("c", [1, 2, 3, 4, 5])  # regenerate: all but the last prompt token
    assert (again.cached_tokens, again.miss_reason, again.ids) == (4, "none", [1, 2, 3, 4])
    assert held(again.cache) == [1, 2, 3, 4]
    assert again.cache is first.cache  # its own entry, cut back, not a copy
    assert pool.conversations() == []  # leased out
    feed(again, [5, 900])
    pool.release(again)
    following = pool.acquire("c", [1, 2, 3, 4, 5, 900, 6, 7])  # the next turn: all it holds
    assert (following.cached_tokens, following.miss_reason) == (6, "none")


def test_a_prompt_of_one_token_reuses_nothing() -> None:
    """At most len - 1 tokens come from the cache: the model must run one for logits."""
    pool = PrefixCache(None, budget_bytes=1 << 20)
    run_turn(pool, "c", [1, 2])
    lease = pool.acquire("c", [1])
    assert (lease.cached_tokens, lease.ids, lease.miss_reason) == (0, [], "none")
    assert lease.cache.get_seq_length() == 0


def test_an_edit_reuses_up_to_the_edit_and_names_where_it_was() -> None:
    from engine.core.ledger import PromptLayout

    pool = PrefixCache(None, budget_bytes=1 << 20)
    old = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    layout = PromptLayout(spans=(("system", 0, 3), ("user", 3, 5), ("assistant", 5, 7)),
                          generated_span=(5, 7))
    expected = {0: "system_prompt_changed", 1: "system_prompt_changed",
                2: "system_prompt_changed", 3: "edited_history", 4: "edited_history",
                5: "template_mismatch", 6: "template_mismatch", 7: "edited_history"}
    for at, reason in expected.items():
        run_turn(pool, "c", old)
        edited = [*old[:at], 50 + at, *old[at + 1 :]]
        lease = pool.acquire("c", edited, layout)
        assert (lease.cached_tokens, lease.miss_reason) == (at, reason), at
        assert held(lease.cache) == old[:at]
        pool.release(lease)  # nothing fed: the entry is the cut-back cache (none at 0)
        assert pool.conversations() == (["c"] if at else [])
    run_turn(pool, "c", old)
    assert pool.acquire("c", [1, 99, 3, 4], None).miss_reason == "edited_history"


def test_an_edited_reply_is_named_where_its_span_is() -> None:
    """Spans of replies whose text changed since their model produced them (the encoder
    flags them) say edited_reply, the last reply's or an earlier one's; elsewhere the reasons
    stay as they were."""
    from engine.core.ledger import PromptLayout

    pool = PrefixCache(None, budget_bytes=1 << 20)
    old = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    spans = (("user", 0, 2), ("assistant", 2, 4), ("user", 4, 5), ("assistant", 5, 7))
    for edited, at, reason in [((3,), 5, "edited_reply"), ((3,), 2, "edited_history"),
                               ((1,), 2, "edited_reply"), ((1,), 5, "template_mismatch"),
                               ((1, 3), 4, "edited_history")]:
        layout = PromptLayout(spans=spans, generated_span=(5, 7), edited_replies=edited)
        run_turn(pool, "c", old)
        lease = pool.acquire("c", [*old[:at], 50, *old[at + 1:]], layout)
        assert (lease.cached_tokens, lease.miss_reason) == (at, reason), (edited, at)
        pool.release(lease)


def test_an_edit_with_no_generated_span_is_an_edit() -> None:
    from engine.core.ledger import PromptLayout

    pool = PrefixCache(None, budget_bytes=1 << 20)
    run_turn(pool, "c", [1, 2, 3, 4])
    layout = PromptLayout(spans=(("user", 0, 4),))
    assert pool.acquire("c", [1, 9, 3, 4], layout).miss_reason == "edited_history"


def test_dropped_old_turns_is_named_unless_it_is_the_first_turn() -> None:
    from engine.core.ledger import PromptLayout

    pool = PrefixCache(None, budget_bytes=1 << 20)
    dropped = PromptLayout(dropped_messages=2)
    assert run_turn(pool, "c", [1, 2, 3], dropped).miss_reason == "first_turn"
    lease = pool.acquire("c", [1, 2, 3, 4], dropped)
    assert (lease.cached_tokens, lease.miss_reason) == (3, "dropped_old_turns")


def test_a_new_chat_borrows_a_copy_of_the_longest_shared_prefix() -> None:
    pool = PrefixCache(None, budget_bytes=1 << 20)
    run_turn(pool, "a", [1, 2, 3, 9])
    b = run_turn(pool, "b", [1, 2, 3, 4, 5, 6])
    run_turn(pool, "z", [7, 7])
    assert pool.conversations() == ["a", "b", "z"]
    lease = pool.acquire("new", [1, 2, 3, 4, 5, 8])
    assert (lease.cached_tokens, lease.miss_reason, lease.ids) == (5, "first_turn",
                                                                  [1, 2, 3, 4, 5])
    assert held(lease.cache) == [1, 2, 3, 4, 5]
    assert lease.cache is not b.cache and held(b.cache) == [1, 2, 3, 4, 5, 6]  # donor intact
    assert pool.conversations() == ["a", "z", "b"]  # the donor is now the most recently used
    assert pool.acquire("other", [6, 6]).cached_tokens == 0
    assert pool.acquire("one", [1, 6]).cached_tokens == 1  # one shared token is lent too


def test_own_entry_wins_a_tie_and_a_longer_donor_wins_over_it() -> None:
    pool = PrefixCache(None, budget_bytes=1 << 20)
    run_turn(pool, "d", [1, 2, 3, 4, 5])
    own = run_turn(pool, "c", [1, 2, 3, 7])
    tie = pool.acquire("c", [1, 2, 3, 8])
    assert (tie.cached_tokens, tie.cache is own.cache) == (3, True)
    feed(tie, [8])
    pool.release(tie)
    longer = pool.acquire("c", [1, 2, 3, 4, 6])
    assert (longer.cached_tokens, longer.miss_reason) == (4, "edited_history")
    assert held(longer.cache) == [1, 2, 3, 4]  # a copy of d's


def test_the_budget_evicts_the_least_recently_used_first() -> None:
    pool = PrefixCache(None, budget_bytes=10 * POSITION_BYTES)
    run_turn(pool, "a", [1, 2, 3, 4])
    run_turn(pool, "b", [5, 6, 7])
    run_turn(pool, "a", [1, 2, 3, 4, 5])  # a is used again: b is now the oldest
    assert (pool.used_bytes, pool.evictions) == (8 * POSITION_BYTES, 0)
    run_turn(pool, "c", [8, 9, 10])  # 11 positions: b goes
    assert pool.conversations() == ["a", "c"]
    assert (pool.used_bytes, pool.evictions) == (8 * POSITION_BYTES, 1)
    lease = pool.acquire("b", [5, 6, 7, 1])
    assert (lease.cached_tokens, lease.miss_reason) == (0, "evicted")
    feed(lease, [5, 6, 7, 1])
    pool.release(lease)  # b is back: a (5 positions) goes, c (3) + b (4) fit
    assert pool.conversations() == ["c", "b"] and pool.evictions == 2
    assert pool.acquire("b", [5, 6, 7, 1, 2]).miss_reason == "none"  # back: no longer evicted


def test_a_cache_just_at_the_budget_stays() -> None:
    pool = PrefixCache(None, budget_bytes=4 * POSITION_BYTES)
    run_turn(pool, "a", [1, 2, 3, 4])
    assert (pool.conversations(), pool.evictions) == (["a"], 0)


def test_release_keeps_only_a_cache_that_matches_its_ids() -> None:
    pool = PrefixCache(None, budget_bytes=1 << 20)
    empty = pool.acquire("e", [1, 2])
    pool.release(empty)  # nothing computed
    assert pool.conversations() == []
    broken = pool.acquire("x", [1, 2, 3])
    feed(broken, [1, 2, 3])
    broken.ids.append(4)  # ids no longer mirror the cache
    pool.release(broken)
    assert pool.conversations() == []
    assert pool.acquire("x", [1, 2, 3]).miss_reason == "first_turn"  # released: not lost


def test_a_request_that_never_came_back_lost_its_cache() -> None:
    pool = PrefixCache(None, budget_bytes=1 << 20)
    run_turn(pool, "c", [1, 2, 3])
    pool.acquire("c", [1, 2, 3, 4])  # fails: never released
    lease = pool.acquire("c", [1, 2, 3, 4])
    assert (lease.cached_tokens, lease.miss_reason) == (0, "evicted")


def test_anonymous_requests_get_distinct_entries() -> None:
    pool = PrefixCache(None, budget_bytes=1 << 20)
    a, b = run_turn(pool, None, [1, 2, 3]), run_turn(pool, None, [1, 2, 3])
    assert a.conversation_id.startswith("anon-") and b.conversation_id.startswith("anon-")
    assert a.conversation_id != b.conversation_id
    assert (a.miss_reason, b.miss_reason, b.cached_tokens) == ("first_turn", "first_turn", 2)
    assert pool.cold_lease(None).conversation_id.startswith("anon-")


def test_cold_lease_drops_the_entry_and_says_disabled() -> None:
    pool = PrefixCache(None, budget_bytes=1 << 20)
    run_turn(pool, "c", [1, 2, 3])
    lease = pool.cold_lease("c")
    assert (lease.cached_tokens, lease.ids, lease.miss_reason) == (0, [], "disabled")
    assert lease.cache.get_seq_length() == 0 and pool.conversations() == []
    pool.acquire("c", [1, 2, 3])
    assert pool.acquire("c", [1, 2]).miss_reason == "evicted"  # the cold lease never came back


def test_evict_all_names_every_chat_it_freed() -> None:
    pool = PrefixCache(None, budget_bytes=4 * POSITION_BYTES)
    run_turn(pool, "x", [1, 2, 3])
    run_turn(pool, "a", [1, 2])  # x goes over the budget
    run_turn(pool, "b", [3, 4])
    pool.acquire("leased", [5, 6])
    assert pool.evictions == 1
    pool.evict_all()
    assert (pool.conversations(), pool.used_bytes, pool.evictions) == ([], 0, 3)
    for conv in ("a", "b", "leased", "x"):
        assert pool.acquire(conv, [1, 2, 3]).miss_reason == "evicted"
    assert pool.acquire("new", [1, 2, 3]).miss_reason == "first_turn"


def test_a_chat_back_in_the_pool_is_no_longer_evicted_or_switched() -> None:
    """What the ledger says once a chat's entry is gone again without an eviction."""
    pool = PrefixCache(None, budget_bytes=3 * POSITION_BYTES)
    run_turn(pool, "a", [1, 2, 3])
    run_turn(pool, "b", [4, 5, 6])  # a is evicted
    run_turn(pool, "a", [1, 2, 3])  # a is back (b goes)
    pool.drop("a")
    assert pool.acquire("a", [1, 2, 3]).miss_reason == "first_turn"
    switched = PrefixCache(None, budget_bytes=1 << 20)
    run_turn(switched, "a", [1, 2, 3])
    switched.reset(model_changed=True)
    run_turn(switched, "a", [1, 2, 3])
    switched.drop("a")
    assert switched.acquire("a", [1, 2, 3]).miss_reason == "first_turn"


def test_a_cache_that_cannot_go_back_says_why() -> None:
    """A chat whose sliding-window cache has rolled past the edit gets a cold prefill, and the
    ledger names the window rather than the edit."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    pool = PrefixCache(None, budget_bytes=1 << 20)
    lease = pool.acquire("c", [1, 2, 3, 4, 5, 6])
    lease.cache = DynamicCache()
    lease.cache.layers = [DynamicSlidingWindowLayer(sliding_window=3)]
    feed(lease, [1, 2, 3, 4, 5])
    pool.release(lease)
    edited = pool.acquire("c", [1, 2, 3, 9, 9])
    assert (edited.cached_tokens, edited.miss_reason) == (0, "sliding_window")
    assert edited.cache is not lease.cache


def test_a_checkpoint_goes_with_the_cache_only_while_it_is_within_it() -> None:
    from engine.runtimes.torch.prefix_cache import Checkpoint

    pool = PrefixCache(None, budget_bytes=1 << 20)
    lease = pool.acquire("c", [1, 2, 3, 4, 5, 6])
    feed(lease, [1, 2, 3, 4, 5])
    lease.checkpoint = Checkpoint(3, [])
    pool.release(lease)
    again = pool.acquire("c", [1, 2, 3, 4, 5, 6])
    assert again.cached_tokens == 5 and again.checkpoint is lease.checkpoint
    pool.release(again)
    edited = pool.acquire("c", [1, 2, 7, 7])
    assert edited.cached_tokens == 2 and edited.checkpoint is None  # 3 is past the cut
    late = pool.acquire("d", [1, 2, 3])
    feed(late, [1, 2])
    late.checkpoint = Checkpoint(4, [])  # beyond what the cache holds: dropped
    pool.release(late)
    assert pool._entries["d"].checkpoint is None


def test_reset_with_a_new_config_makes_caches_for_that_model() -> None:
    from transformers import LlamaConfig

    pool = PrefixCache(None, budget_bytes=1 << 20)
    assert len(pool.acquire("a", [1, 2]).cache.layers) == 0  # no config: layers on first use
    config = LlamaConfig(num_hidden_layers=3, hidden_size=16, intermediate_size=32,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=50)
    pool.reset(config=config)
    assert len(pool.acquire("b", [1, 2]).cache.layers) == 3
    assert len(pool.cold_lease("c").cache.layers) == 3


def test_reset_on_a_model_switch_names_it_for_every_chat() -> None:
    pool = PrefixCache(None, budget_bytes=5 * POSITION_BYTES)
    run_turn(pool, "a", [1, 2, 3])
    run_turn(pool, "b", [4, 5, 6])  # a is evicted
    pool.reset(model_changed=True)
    assert pool.conversations() == []
    assert pool.acquire("a", [1, 2, 3]).miss_reason == "model_changed"
    assert pool.acquire("b", [4, 5, 6]).miss_reason == "model_changed"
    plain = PrefixCache(None, budget_bytes=1 << 20)
    run_turn(plain, "a", [1, 2, 3])
    plain.reset()
    assert plain.acquire("a", [1, 2, 3]).miss_reason == "first_turn"


def test_a_released_turn_clears_model_changed() -> None:
    pool = PrefixCache(None, budget_bytes=1 << 20)
    run_turn(pool, "a", [1, 2, 3])
    pool.reset(model_changed=True)
    assert run_turn(pool, "a", [1, 2, 3]).miss_reason == "model_changed"
    assert run_turn(pool, "a", [1, 2, 3, 4]).miss_reason == "none"
    pool.reset(model_changed=True)
    pool.reset(model_changed=True)  # a second switch: still the model
    assert pool.acquire("a", [1, 2]).miss_reason == "model_changed"


def pool_with_a_ledger(names: str) -> PrefixCache:
    """A small pool whose ledger remembers names[0] as model_changed and names[1] as evicted
    (by names[2], which stays cached)."""
    pool = PrefixCache(None, budget_bytes=3 * POSITION_BYTES)
    run_turn(pool, names[0], [1, 2])
    pool.reset(model_changed=True)
    run_turn(pool, names[1], [1, 2, 3])
    run_turn(pool, names[2], [4, 5, 6])  # names[1] is evicted
    return pool


def test_a_new_pool_takes_over_the_ledger() -> None:
    """On a model switch every chat the old pool knew of, live or evicted, says model_changed
    on its next turn (its cache is gone because the model changed)."""
    old = pool_with_a_ledger("mef")
    new = PrefixCache(None, budget_bytes=1 << 20)
    new.take_over(old)
    assert new.acquire("m", [1, 2]).miss_reason == "model_changed"
    assert new.acquire("e", [1, 2]).miss_reason == "model_changed"
    assert new.acquire("f", [1, 2]).miss_reason == "model_changed"
    assert new.acquire("x", [1, 2]).miss_reason == "first_turn"
    assert old.conversations() == []


def test_adopt_makes_an_alternative_the_chat_own_entry() -> None:
    pool = PrefixCache(None, budget_bytes=1 << 20)
    run_turn(pool, "other", [7, 7, 7])
    alt = run_turn(pool, "c~alt1", [1, 2, 3], reply=2)
    pool.evict_all()  # c's own entry and the alternative's are gone
    pool.release(alt)  # back again (as if released after the eviction)
    pool.adopt("c~alt1", "c")
    assert pool.conversations() == ["c"]
    lease = pool.acquire("c", [1, 2, 3, 900, 901, 4])
    assert (lease.cached_tokens, lease.miss_reason, lease.cache is alt.cache) == (5, "none", True)
    pool.adopt("missing", "c")  # nothing to adopt: nothing changes
    assert pool.acquire("c", [1]).miss_reason == "evicted"  # c's lease is still out


def test_adopt_moves_the_entry_to_most_recently_used_and_clears_the_ledger() -> None:
    pool = PrefixCache(None, budget_bytes=7 * POSITION_BYTES)
    run_turn(pool, "c", [1, 2])
    pool.reset(model_changed=True)  # c: "model_changed"
    run_turn(pool, "src", [1, 2, 3])
    run_turn(pool, "x", [4, 5, 6])
    pool.adopt("src", "c")
    assert pool.conversations() == ["x", "c"]
    run_turn(pool, "y", [7, 8])  # over budget: x is the oldest now
    assert pool.conversations() == ["c", "y"]
    pool.drop("c")
    assert pool.acquire("c", [1, 2, 3, 4]).miss_reason == "first_turn"
    evicted = PrefixCache(None, budget_bytes=3 * POSITION_BYTES)
    run_turn(evicted, "c", [1, 2, 3])
    run_turn(evicted, "src", [4, 5, 6])  # c is evicted
    evicted.adopt("src", "c")
    evicted.drop("c")
    assert evicted.acquire("c", [1, 2]).miss_reason == "first_turn"


def test_drop_forgets_a_chat_entry() -> None:
    pool = PrefixCache(None, budget_bytes=1 << 20)
    run_turn(pool, "a", [1, 2, 3])
    run_turn(pool, "b", [1, 2, 3])
    pool.drop("a")
    pool.drop("missing")
    assert pool.conversations() == ["b"]


def test_chunk_limit_ends_a_chunk_where_a_checkpoint_is_due() -> None:
    from engine.core.ledger import CacheLease

    lease = CacheLease("c", [1, 2, 3], None, 3, "none", checkpoint_at=10)
    assert [lease.chunk_limit(n) for n in (1, 6, 7, 8, 100)] == [1, 6, 7, 7, 7]
    lease.ids.extend(range(7))
    assert lease.chunk_limit(5) == 5  # reached: no limit
    assert CacheLease("c", [1], None, 1, "none").chunk_limit(64) == 64


def test_a_checkpoint_is_taken_only_at_its_length_only_at_its_length() -> None:
    from transformers import DynamicCache

    from engine.core.ledger import CacheLease
    from engine.runtimes.torch.prefix_cache import checkpoint_if_due

    lease = CacheLease("c", [1, 2], DynamicCache(), 2, "none", checkpoint_at=3)
    checkpoint_if_due(lease)
    assert lease.checkpoint is None
    lease.ids.append(3)
    checkpoint_if_due(lease)
    assert lease.checkpoint is not None and lease.checkpoint.length == 3
    plain = CacheLease("c", [1, 2], DynamicCache(), 2, "none")
    checkpoint_if_due(plain)
    assert plain.checkpoint is None


def test_a_rolled_sliding_window_cache_lends_nothing_it_cannot_cut_back_to() -> None:
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from engine.core.ledger import CacheEntry
    from engine.runtimes.torch.prefix_cache import Checkpoint

    cache = DynamicCache()
    cache.layers = [DynamicSlidingWindowLayer(sliding_window=3)]
    values = torch.zeros(1, 1, 5, 1)
    cache.update(values, values.clone(), 0)
    entry = CacheEntry([1, 2, 3, 4, 5], cache, 0)
    reach = PrefixCache(None, budget_bytes=1 << 20)._reach
    assert reach(entry, 5) == 5 and reach(entry, 7) == 7  # no cut needed
    assert reach(entry, 4) == 0
    entry.checkpoint = Checkpoint(3, [])
    assert (reach(entry, 4), reach(entry, 3), reach(entry, 2)) == (3, 3, 0)
    rollable = CacheEntry([1, 2, 3, 4, 5], DynamicCache(), 0)
    assert reach(rollable, 2) == 2


def recurrent_config() -> object:
    """A model whose layers keep a recurrent state (linear attention): caches cannot be cut
    back, so each prefill keeps a checkpoint one token short of the prompt's end."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32,
                           num_attention_heads=2, num_key_value_heads=1, vocab_size=50)


def test_a_recurrent_model_checkpoints_one_token_before_the_end() -> None:
    pool = PrefixCache(recurrent_config(), budget_bytes=1 << 20)
    lease = pool.acquire("c", [1, 2, 3, 4, 5])
    assert (lease.cached_tokens, lease.checkpoint_at) == (0, 4)
    assert pool.acquire("one", [1]).checkpoint_at is None  # nothing before the last token
    switched = PrefixCache(None, budget_bytes=1 << 20)
    assert switched.acquire("c", [1, 2, 3]).checkpoint_at is None
    switched.reset(config=recurrent_config())
    assert switched.acquire("d", [1, 2, 3]).checkpoint_at == 2
    switched.reset(config=None)  # no new model: the pool stays as it was
    assert switched.acquire("e", [1, 2, 3]).checkpoint_at == 2


def test_taking_over_a_ledger_keeps_the_pool_own() -> None:
    old, new = pool_with_a_ledger("mef"), pool_with_a_ledger("ngh")
    new.take_over(old)
    reasons = {conv: new.acquire(conv, [1, 2]).miss_reason for conv in "menghfx"}
    assert reasons == {"m": "model_changed", "n": "model_changed", "e": "model_changed",
                       "g": "evicted", "h": "edited_history", "f": "model_changed",
                       "x": "first_turn"}


def test_a_cold_lease_that_never_comes_back_makes_the_next_turn_evicted() -> None:
    """A request that must not reuse the cache (a cold lease) and then fails: its chat's old
    entry is gone, and the next turn says "evicted", as for any lost lease."""
    from engine.runtimes.torch.prefix_cache import PrefixCache

    pool = PrefixCache(None, 1 << 20)
    pool.cold_lease("chat")  # never released: the request failed
    lease = pool.acquire("chat", [1, 2, 3])
    assert (lease.cached_tokens, lease.miss_reason) == (0, "evicted")
