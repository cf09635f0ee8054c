"""Property tests (hypothesis): sampler, prefix matching, detokenizer, stop strings, Markdown."""

from __future__ import annotations

import html.parser
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoTokenizer

from engine.core import sampling
from engine.core.detok import ByteDetokenizer, IncrementalDetokenizer, StopMatcher
from engine.core.ledger import common_prefix_len
from engine.core.sampling import filtered_probs, make_generator, sample_token
from engine.errors import SamplingError
from engine.params import SamplingParams
from engine.runtimes.torch import prefix_cache
from engine.runtimes.torch.prefix_cache import PrefixCache
from ui.markdown import is_safe_link, render_markdown

# ----- sampler ------------------------------------------------------------------------------

logit = st.one_of(
    st.floats(-1e4, 1e4, allow_nan=False),
    st.sampled_from([float("-inf"), float("inf"), float("nan"), 0.0, 3e38, -3e38]),
)
sampling_params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(1e-6, 10.0)),
    top_p=st.floats(1e-3, 1.0),
    top_k=st.integers(0, 8),
    min_p=st.floats(0.0, 0.99),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.5]),
    max_tokens=st.just(8),
    seed=st.integers(0, 2**31),
)


def sampleable(values: Sequence[float]) -> bool:
    return not any(math.isnan(v) or v == math.inf for v in values) and any(
        v != -math.inf for v in values)


@given(st.lists(logit, min_size=1, max_size=16), sampling_params,
       st.lists(st.integers(0, 15), max_size=4))
def test_sampler_errors_clearly_or_draws_a_token_it_kept(
    values: list[float], params: SamplingParams, seen: list[int]
) -> None:
    logits = torch.tensor(values)
    seen = [i for i in seen if i < len(values)]
    if not sampleable(values):
        with pytest.raises(SamplingError):
            sample_token(logits, params, make_generator(params.seed), seen)
        return
    try:
        token = sample_token(logits, params, make_generator(params.seed), seen)
    except SamplingError:  # only an overflow from the penalty may still refuse
        assert params.repetition_penalty < 1.0
        return
    assert 0 <= token < len(values)
    assert values[token] != -math.inf
    if not params.greedy:
        from engine.core.sampling import apply_repetition_penalty

        penalised = apply_repetition_penalty(logits, seen, params.repetition_penalty)
        probs = filtered_probs(penalised, params)
        assert torch.isfinite(probs).all() and probs[token] > 0
        assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-4)


@pytest.mark.skipif(not sampling.native_exp, reason="no vector copy of engine/core/_weights.c")
@given(st.lists(logit, min_size=1, max_size=3000), st.floats(1e-6, 10.0))
def test_native_weights_are_numpys_within_rounding(values: list[float],
                                                   temperature: float) -> None:
    """The native pass against numpy's four on any logits a draw accepts: the same weights
    within float32's rounding of the scaled logit (the native pass multiplies by 1 / T, numpy
    divides), 0 where numpy's weight is below exp(-87) or 0, and its block sums."""
    logits = np.array(values, np.float32)
    if not sampleable(logits.tolist()):
        return
    top = float(logits.max())
    native, sums = sampling.exp_weights(logits, top, temperature)
    with mock.patch.object(sampling, "native_weights", False):
        reference, none = sampling.exp_weights(logits, top, temperature)
    assert sums is not None and none is None
    assert np.allclose(native, reference, rtol=2e-5, atol=1.7e-38)  # exp(-87): 1.65e-38
    assert np.all(native[reference == 0] == 0)
    expected = [float(native[i:i + sampling.BLOCK].sum(dtype=np.float64))
                for i in range(0, native.size, sampling.BLOCK)]
    assert np.allclose(sums, expected, rtol=1e-6, atol=0)


weight = st.one_of(st.sampled_from([0.0, 1.0, 0.5, 0.25, 1e-3, 1e-40, 3e-39]),
                   st.floats(0.0, 1.0, width=32))


def kept_by_a_full_sort(weights: np.ndarray, top_p: float,
                        rounding: float) -> np.ndarray | None:
    """What top-p keeps by a full sort: the tokens whose mass before them (by weight, then id)
    is short of top_p of the whole, the most likely always. None where there is no mass, or
    where the target lies within `rounding` (relative) of a token's start: which side it falls
    on is rounding's call."""
    if not weights.any():
        return None
    order = np.argsort(-weights, kind="stable")
    before = np.cumsum(weights[order], dtype=np.float64) - weights[order]
    target = top_p * float(weights.sum(dtype=np.float64))
    if np.any(np.abs(before - target) <= rounding * target):
        return None
    kept = np.zeros(weights.size, dtype=bool)
    kept[order] = before < target
    kept[order[0]] = True
    return kept


@given(st.lists(weight, min_size=1, max_size=3000), st.floats(1e-3, 1.0, exclude_max=True))
def test_top_p_keeps_what_a_full_sort_keeps(values: list[float], top_p: float) -> None:
    """Top-p's selection (native: a radix select on the weights' bits; else numpy's rounds) on
    any weights, ties, zeros and subnormals included: the set a full sort keeps (the mass before
    each token, by weight then id, against top_p of the whole), unless the target lies within
    float64 rounding of where a token's mass starts."""
    weights = np.array(values, np.float32)
    sorted_kept = kept_by_a_full_sort(weights, top_p, rounding=1e-9)
    if sorted_kept is None:
        return
    expected = ~sorted_kept
    assert np.array_equal(sampling.beyond_top_p(weights, top_p), expected)
    with mock.patch.object(sampling, "native_weights", False):
        assert np.array_equal(sampling.beyond_top_p(weights, top_p), expected)


# ----- prefix matching ----------------------------------------------------------------------

class FakeTensor:
    def __init__(self, n: int) -> None:
        self.n = n

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return 1


class FakeLayer:
    def __init__(self, cache: FakeCache) -> None:
        self.keys = FakeTensor(cache.length)
        self.values = FakeTensor(cache.length)


class FakeCache:
    """Stands in for new_cache()'s DynamicCache: a length, crop(-n), two bytes per token."""

    def __init__(self, config: object = None) -> None:
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, negative: int) -> None:
        self.length += negative

    @property
    def layers(self) -> list[FakeLayer]:
        return [FakeLayer(self)]


token_lists = st.lists(st.integers(0, 3), min_size=1, max_size=12)
turns = st.lists(st.tuples(st.sampled_from("abc"), token_lists, st.integers(0, 3)),
                 min_size=1, max_size=12)


def brute_force_reuse(history: dict[str, list[int]], prompt: list[int]) -> int:
    """The most tokens any conversation's last computed ids share with the prompt."""
    limit = len(prompt) - 1
    best = 0
    for ids in history.values():
        n = 0
        while n < min(len(ids), len(prompt)) and ids[n] == prompt[n]:
            n += 1
        best = max(best, min(n, limit))
    return best


@given(token_lists, token_lists)
def test_common_prefix_len_matches_reference(a: list[int], b: list[int]) -> None:
    expected = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                    min(len(a), len(b)))
    assert common_prefix_len(a, b) == expected


def run_turns(pool: PrefixCache, script: list[tuple[str, list[int], int]]) -> Iterator:
    """Acquire, 'compute' the prompt plus a few generated tokens, release. Yields each lease
    (before release) and the ids its conversation holds afterwards."""
    for conv, prompt, generated in script:
        lease = pool.acquire(conv, prompt)
        computed = prompt + [9] * generated
        yield conv, prompt, lease, computed
        lease.ids.extend(computed[lease.cached_tokens :])
        lease.cache.length = len(lease.ids)
        pool.release(lease)


@given(turns)
def test_prefix_cache_reuses_the_longest_prefix(script: list) -> None:
    history: dict[str, list[int]] = {}
    with mock.patch.object(prefix_cache, "new_cache", FakeCache):
        pool = PrefixCache(config=None, budget_bytes=1 << 30)
        for conv, prompt, lease, computed in run_turns(pool, script):
            assert lease.cached_tokens == brute_force_reuse(history, prompt)
            assert lease.ids == prompt[: lease.cached_tokens]
            assert lease.cache.length == len(lease.ids)
            history[conv] = computed


@given(turns, st.integers(0, 40))
def test_prefix_cache_stays_within_budget_and_never_overclaims(script: list, budget: int) -> None:
    history: dict[str, list[int]] = {}
    with mock.patch.object(prefix_cache, "new_cache", FakeCache):
        pool = PrefixCache(config=None, budget_bytes=budget)
        for conv, prompt, lease, computed in run_turns(pool, script):
            assert lease.cached_tokens <= brute_force_reuse(history, prompt)
            assert lease.ids == prompt[: lease.cached_tokens]
            assert pool.used_bytes <= budget
            history[conv] = computed
        assert pool.used_bytes <= budget


# ----- detokenizer and stop strings ---------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def stream(tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    return [detok.push(i) for i in ids] + [detok.flush()]


@given(text=st.text(max_size=40))
def test_detokenizer_streams_valid_text_exactly(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    if "\ufffd" not in text:
        assert all("\ufffd" not in p for p in pieces)


@given(data=st.data())
def test_detokenizer_matches_whole_decode_for_any_ids(tokenizer, data: st.DataObject) -> None:
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=24))
    assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids, skip_special_tokens=True)


@given(st.lists(st.binary(max_size=5), max_size=24))
def test_byte_detokenizer_streams_what_decoding_the_whole_gives(pieces: list[bytes]) -> None:
    """Any bytes in any pieces (llama.cpp's tokens): the text is the whole's, and a valid
    character never shows half-done."""
    detok = ByteDetokenizer(pieces.__getitem__)
    shown = [detok.push(i) for i in range(len(pieces))] + [detok.flush()]
    whole = b"".join(pieces).decode("utf-8", "replace")
    assert "".join(shown) == whole
    if "\ufffd" not in whole:
        assert all("\ufffd" not in piece for piece in shown)


alphabet_text = st.text(alphabet="ab<>\n", max_size=30)


@given(alphabet_text, st.lists(st.text(alphabet="ab<>\n", min_size=1, max_size=4), max_size=3),
       st.lists(st.integers(1, 6), max_size=30))
def test_stop_matcher_shows_text_up_to_the_first_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    matcher = StopMatcher(stops)
    shown, pos = [], 0
    for n in [*cuts, len(text)]:
        shown.append(matcher.feed(text[pos : pos + n]))
        pos += n
    shown.append(matcher.flush())
    # the stop completed first ends the text (then the earlier start), as when streamed
    hits = [(i + len(s), i) for i, s in ((text.find(s), s) for s in stops) if i >= 0]
    expected = text[: min(hits)[1]] if hits else text
    assert "".join(shown) == expected == matcher.emitted
    assert matcher.stopped == bool(hits)


# ----- Markdown -----------------------------------------------------------------------------

HOSTILE_PIECES = [
    "<script>alert(1)</script>", "<img src=http://x.example/a.png>", "![a](http://x.example/a.png)",
    "[l](javascript:alert(1))", "[f](file:///etc/passwd)", "<a href='http://x.example'>x</a>",
    "[ok](https://ok.example)", "<style>*{}</style>", "<iframe src=x>", "`code`", "```\n<b>\n```",
    "<http://auto.example>", "<javascript:alert(1)>", "[r]: javascript:alert(1)\n[x][r]",
    "[d](data:text/html,<b>)", " onerror=alert(1) ", "\u202eevil", "e\u0301", "\u200b", "&lt;",
    "**b**", "| a | b |\n|---|---|\n| <i> | x |", "\n\n", "> q", "- item",
    "[s](  HTTPS://ok.example/a?b=\"c\"  )", "[v](vbscript:x)", "[rel](/etc/passwd)",
]
ALLOWED_TAGS = {"p", "a", "span", "b", "strong", "em", "i", "code", "pre", "table", "tr", "td",
                "th", "thead", "tbody", "ul", "ol", "li", "h1", "h2", "h3", "h4", "h5", "h6",
                "blockquote", "hr", "br", "s", "del"}
ALLOWED_ATTRS = {"href", "style", "width", "cellspacing", "cellpadding", "colspan", "align",
                 "start"}


class Inspector(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


@given(st.lists(st.one_of(st.sampled_from(HOSTILE_PIECES), st.text(max_size=12)), max_size=12))
def test_markdown_never_emits_active_content(pieces: list[str]) -> None:
    rendered = render_markdown("".join(pieces), message_id=7)
    inspector = Inspector()
    inspector.feed(rendered.html)
    for tag, attrs in inspector.tags:
        assert tag in ALLOWED_TAGS, tag
        assert set(attrs) <= ALLOWED_ATTRS, attrs
        href = attrs.get("href")
        if href is not None:
            assert is_safe_link(href) or href.startswith("pw-copy:7/"), href
            assert href.lower().startswith(("http://", "https://", "pw-copy:"))


@given(st.lists(weight, min_size=1, max_size=3000), st.floats(1e-3, 1.0, exclude_max=True),
       st.sampled_from([1, 16, 256, sampling.BLOCK]))
def test_a_drawn_tokens_top_p_check_keeps_what_a_full_sort_keeps(values: list[float],
                                                                  top_p: float,
                                                                  block: int) -> None:
    """A top-p draw by rejection checks its token alone (`top_p_keeps`: the mass of the heavier
    weights and the equal ones before it, read block by block until the verdict is sure): the
    same verdict as a full sort for every token, whatever the blocks, unless the target lies
    within the check's float32-lane rounding of a token's start."""
    weights = np.array(values, np.float32)
    kept = kept_by_a_full_sort(weights, top_p, rounding=1e-6)
    if kept is None:
        return
    with mock.patch.object(sampling, "BLOCK", block):
        sums = sampling._block_sums(weights)
        for native in (True, False):
            with mock.patch.object(sampling, "native_weights", native):
                verdicts = [sampling.top_p_keeps(weights, i, top_p, sums)
                            for i in range(weights.size)]
            assert np.array_equal(verdicts, kept), native
