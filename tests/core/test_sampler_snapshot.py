"""The sampler panel's candidates read as text: byte-fallback tokens of ASCII bytes become
their character (issue 20's leftover: <0x0A> shown raw)."""

from __future__ import annotations

import torch

from engine import ChatMessage, GenerationRequest, SamplingParams
from engine.core.reply import readable_piece, sampler_snapshot
from ui.hud.panels import short_token

PIECES = {0: "<0x0A>", 1: "<0xE2>", 2: "Hello", 3: "<0x20>", 4: "<0x0a>"}


class ByteFallbackTokenizer:
    """Decodes single tokens the way a byte-fallback vocabulary's pieces read."""

    def decode(self, ids: list[int]) -> str:
        return PIECES[ids[0]]


def test_ascii_byte_tokens_read_as_their_character() -> None:
    assert readable_piece("<0x0A>") == "\n"
    assert readable_piece("<0x0a>") == "\n"
    assert readable_piece("<0x20>") == " "
    assert readable_piece("<0xE2>") == "<0xE2>"  # part of a multi-byte character
    assert readable_piece("<0x7F>") == "\x7f" and readable_piece("<0x80>") == "<0x80>"  # edge
    assert readable_piece("x<0x0A>") == "x<0x0A>"  # only a whole piece is a byte token
    assert readable_piece("Hello") == "Hello"


def test_the_snapshot_carries_readable_candidates_and_the_hud_shows_them() -> None:
    request = GenerationRequest([ChatMessage("user", "hi")],
                                SamplingParams(temperature=0.7, top_p=0.9))
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    snapshot = sampler_snapshot(ByteFallbackTokenizer(), request, logits, 0, 0, 0)
    # the HUD files it under its reply and shows the settings it was drawn with
    assert snapshot.request_id == request.request_id
    assert (snapshot.temperature, snapshot.top_p) == (0.7, 0.9)
    texts = {tid: text for tid, text, _p in snapshot.candidates}
    assert texts[0] == "\n" and texts[3] == " " and texts[4] == "\n"
    assert texts[1] == "<0xE2>" and texts[2] == "Hello"
    assert short_token(texts[0]) == "\\n" and short_token(texts[3]) == "·"
    assert "<0x0A>" not in {short_token(text) for text in texts.values()}
