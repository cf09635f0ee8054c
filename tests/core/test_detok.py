from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.core.detok import ByteDetokenizer, IncrementalDetokenizer, StopMatcher

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "Emoji 😀🎉 split across byte tokens, CJK 你好世界, café naïve.",
    "Zero\u200bwidth, combining e\u0301, right-to-left שלום.",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_matches_whole_decode_and_never_splits_a_char(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_emoji_is_held_until_complete(tokenizer) -> None:
    ids = tokenizer("😀", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1, "the tiny tokenizer should split this emoji into byte tokens"
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "😀"


def test_byte_pieces_hold_a_character_until_its_last_byte() -> None:
    pieces = [b"Hi ", b"\xf0\x9f", b"\x98", b"\x80", b"!", b"", b"\xe2\x82"]
    detok = ByteDetokenizer(pieces.__getitem__)
    assert [detok.push(i) for i in range(len(pieces))] == ["Hi ", "", "", "\U0001f600", "!", "",
                                                           ""]
    assert detok.flush() == "\ufffd"  # a character the reply never finished


def test_a_stop_late_in_a_long_reply_is_found_across_pieces() -> None:
    """Each piece looks only at the held-back text and the last few characters shown."""
    stopper = StopMatcher(["<|im_end|>", "\n\nUser:"])
    body = "word <|im and \n\nUse " * 500
    shown = [stopper.feed(body[i : i + 3]) for i in range(0, len(body), 3)]
    assert "".join(shown) == body == stopper.emitted
    assert stopper.feed("end<|im") == "end" and stopper.feed("_en") == ""
    assert stopper.feed("d|>tail") == "" and stopper.stopped
    assert stopper.emitted == body + "end"


def test_stop_string_is_cut_and_never_shown() -> None:
    stopper = StopMatcher(["<END>"])
    shown = [stopper.feed(p) for p in ["Hello <", "EN", "D> more"]]
    assert "".join(shown) == "Hello "
    assert stopper.stopped
    assert stopper.emitted == "Hello "


def test_held_back_prefix_is_released_when_not_a_stop() -> None:
    stopper = StopMatcher(["<END>"])
    assert stopper.feed("a <E") == "a "
    assert stopper.feed("X") == "<EX"
    assert stopper.feed("<") == ""
    assert stopper.flush() == "<"
    assert stopper.emitted == "a <EX<"


def test_overlapping_stops_end_where_streaming_would_whatever_the_pieces() -> None:
    """'>' completes before '<><' (which starts earlier): the reply ends before '>' whether the
    text comes in one piece or a character at a time (found by the deep fuzz profile)."""
    whole = StopMatcher([">", "<><"])
    assert whole.feed("<<><") == "<<" and whole.stopped
    pieces = StopMatcher([">", "<><"])
    assert "".join(pieces.feed(c) for c in "<<><") == "<<" and pieces.stopped
