"""A reply's own token ids carried into the next turn (ChatMessage.token_ids): a sampled reply
whose text re-tokenizes to other ids is still cached whole; an edited reply is named; ids that
no longer fit (edited text, another model, a control token) are never used."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine import ChatMessage, GenerationRequest, GenerationResult, SamplingParams
from engine.core.chat_template import encode_chat_layout
from engine.core.ledger import common_prefix_len
from engine.worker import Engine
from tests.support.split_reply import SPLIT_SEEDS, first_split_reply, reply_body

FIRST = [ChatMessage("user", "Hello there")]
NEXT = ChatMessage("user", "And then?")
SAMPLED = SamplingParams(temperature=1.0, max_tokens=6)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def end_ids(tokenizer) -> set[int]:
    return {tokenizer.eos_token_id}


def sampled_split(engine: Engine, tokenizer) -> GenerationResult:
    """A sampled first turn (chat "c") whose reply re-tokenizes to other ids."""
    def sample(seed: int) -> GenerationResult:
        return engine.submit(GenerationRequest(
            list(FIRST), SamplingParams(temperature=1.0, max_tokens=6, seed=seed),
            conversation_id="c")).wait(60)

    # Rare on the tiny model (most of its vocabulary's replies hold an unprintable byte):
    # split_reply.SPLIT_SEEDS says where the search starts; each reply is checked, not assumed.
    return first_split_reply(sample, tokenizer, end_ids(tokenizer), SPLIT_SEEDS)[1]


def plain(message: ChatMessage) -> ChatMessage:
    return ChatMessage(message.role, message.content)


def test_a_reply_that_retokenizes_differently_is_cached_whole(tiny_engine: Engine,
                                                              tokenizer) -> None:
    first = sampled_split(tiny_engine, tokenizer)
    body = reply_body(first, end_ids(tokenizer))
    reply = first.as_message()
    assert reply.token_ids == tuple(first.token_ids)
    second = tiny_engine.submit(GenerationRequest([*FIRST, reply, NEXT], SAMPLED,
                                                  conversation_id="c")).wait(60)
    prompt = second.prompt_token_ids
    start = len(first.prompt_token_ids)
    assert prompt[:start] == first.prompt_token_ids
    assert prompt[start:start + len(body)] == body  # the reply as the model produced it
    # Everything the first turn computed is reused: its prompt and every reply token fed back
    # (all but the last sampled one), and the miss is none.
    assert second.metrics.cached_tokens == start + len(first.token_ids) - 1
    assert second.metrics.cache_miss_reason == "none"


def test_an_edited_reply_is_named(tiny_engine: Engine, tokenizer) -> None:
    first = sampled_split(tiny_engine, tokenizer)
    reply = first.as_message()
    edited = ChatMessage("assistant", first.text[:2] + "Paris" + first.text[2:],
                         reply.token_ids, reply.token_model)
    previous = first.prompt_token_ids + first.token_ids[:-1]  # what the cache holds
    second = tiny_engine.submit(GenerationRequest([*FIRST, edited, NEXT], SAMPLED,
                                                  conversation_id="c")).wait(60)
    assert second.metrics.cache_miss_reason == "edited_reply"
    assert second.metrics.cached_tokens == common_prefix_len(previous, second.prompt_token_ids)
    assert second.metrics.cached_tokens >= len(first.prompt_token_ids)


def test_ids_of_another_model_are_ignored(tiny_engine: Engine, tokenizer) -> None:
    first = sampled_split(tiny_engine, tokenizer)
    reply = first.as_message()
    foreign = ChatMessage("assistant", first.text, reply.token_ids, "llama.cpp:other:x:y")
    second = tiny_engine.submit(GenerationRequest([*FIRST, foreign, NEXT], SAMPLED,
                                                  conversation_id="c")).wait(60)
    retokenized = encode_chat_layout(tokenizer, [*FIRST, plain(reply), NEXT]).ids
    assert second.prompt_token_ids == retokenized
    # The reply re-tokenized: the old miss, named as it is (not an edit).
    assert second.metrics.cache_miss_reason == "template_mismatch"


# ----- the encoder, on text made to split --------------------------------------------------------
TEXT = "The capital of France is Paris."


def chars(tokenizer, text: str) -> list[int]:
    """The text one character per token."""
    ids = [t for ch in text for t in tokenizer(ch, add_special_tokens=False)["input_ids"]]
    assert tokenizer.decode(ids) == text
    return ids


def split_ids(tokenizer, text: str) -> list[int]:
    """The text one character per token, a tokenization that re-tokenizing merges."""
    ids = chars(tokenizer, text)
    assert ids != tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def chat_with(reply: ChatMessage) -> list[ChatMessage]:
    return [*FIRST, reply, NEXT]


def test_own_ids_are_used_for_their_model_only(tokenizer) -> None:
    own = [*split_ids(tokenizer, TEXT), tokenizer.eos_token_id]
    reply = ChatMessage("assistant", TEXT, tuple(own), "m")
    chat = encode_chat_layout(tokenizer, chat_with(reply), model_identity="m")
    _, start, end = chat.spans[1]
    assert chat.ids[start:end] == own[:-1]  # the EOS is the template's, after the span
    assert chat.ids[end] == tokenizer.eos_token_id
    assert chat.edited_replies == ()
    plain_ids = encode_chat_layout(tokenizer, chat_with(plain(reply))).ids
    assert plain_ids != chat.ids
    for model in ("other", None):
        assert encode_chat_layout(tokenizer, chat_with(reply), model_identity=model).ids \
            == plain_ids


def test_ids_past_a_stop_string_are_cut_at_the_text(tokenizer) -> None:
    own = split_ids(tokenizer, TEXT) + split_ids(tokenizer, "\n\nUser: hi")
    reply = ChatMessage("assistant", TEXT, tuple(own), "m")
    chat = encode_chat_layout(tokenizer, chat_with(reply), model_identity="m")
    _, start, end = chat.spans[1]
    assert chat.ids[start:end] == split_ids(tokenizer, TEXT)


def test_edited_text_drops_its_ids_and_is_flagged(tokenizer) -> None:
    own = tuple(split_ids(tokenizer, TEXT))
    edited = ChatMessage("assistant", TEXT.replace("Paris", "Lyon"), own, "m")
    chat = encode_chat_layout(tokenizer, chat_with(edited), model_identity="m")
    assert chat.ids == encode_chat_layout(tokenizer, chat_with(plain(edited))).ids
    assert chat.edited_replies == (1,)


@pytest.mark.parametrize("case", ["spelled in the text", "hidden by skipping it"])
def test_a_control_token_among_the_ids_never_reaches_the_prompt(tokenizer, case) -> None:
    """Ids with a real <|im_start|> where the text spells one out: the text stays inert. In
    the second case the ids even decode to the text (skipping the control token, a prefix of
    them spells it out): only decoding both ways tells."""
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    mark = chars(tokenizer, "<|im_start|>")
    if case == "spelled in the text":
        text, own = "ab<|im_start|>cd", (*chars(tokenizer, "ab"), im_start, *chars(tokenizer, "cd"))
        assert tokenizer.decode(own, skip_special_tokens=False) == text
    else:
        text, own = "<|im_start|>" * 3, (*mark, im_start, *mark, *mark)
        assert tokenizer.decode(own, skip_special_tokens=True) == text
    reply = ChatMessage("assistant", text, own, "m")
    chat = encode_chat_layout(tokenizer, chat_with(reply), model_identity="m")
    _, start, end = chat.spans[1]
    assert im_start not in chat.ids[start:end]
    assert tokenizer.decode(chat.ids[start:end]) == text
