"""Prompt-lookup speculative decoding: drafts, exact greedy output, cache bookkeeping."""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from pathlib import Path

import pytest
import torch

from engine import (
    ChatMessage,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    TokenEmitted,
)
from engine.core import speculative
from engine.core.speculative import PromptLookup
from engine.metrics import RequestTimeline, now_ns
from engine.runtimes.torch.generate import DecodeSession
from engine.runtimes.torch.loader import LoadedModel, load_model
from engine.runtimes.torch.prefix_cache import PrefixCache
from engine.runtimes.torch.runtime import TorchRuntime
from engine.tools.bench import fixed_prompt_ids, run_ours


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir))


def test_lookup_proposes_what_followed_the_latest_match() -> None:
    lookup = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3], max_ngram=3, min_ngram=2)
    assert lookup.propose(3) == [7, 8, 2]  # latest earlier "2 3" was followed by 7 8 2
    lookup.append(7)
    assert lookup.propose(2) == [8, 2]  # "2 3 7" matches with three tokens
    assert PromptLookup([1, 2, 3]).propose(4) == []
    assert PromptLookup([5, 6, 5, 6]).propose(0) == []
    assert PromptLookup([1, 1, 1, 1], min_ngram=1).propose(2) == [1]


class ScriptedLookup(PromptLookup):
    """Drafts that are right for a while, then wrong: exercises partial acceptance and the
    cache crop after a rejection."""

    def __init__(self, ids, **kw) -> None:
        super().__init__(ids, **kw)
        self.calls = 0

    def propose(self, max_tokens: int) -> list[int]:
        self.calls += 1
        right = super().propose(max_tokens)
        if self.calls % 3 == 0:
            return [t + 1 for t in right] or [7]  # rejected at the first token
        if self.calls % 3 == 1 and len(right) > 1:
            return [*right[:1], right[1] + 1, *right[2:]]  # first accepted, then rejected
        return right


def run(loaded: LoadedModel, pool: PrefixCache, request: GenerationRequest):
    events: list = []
    result = DecodeSession(loaded, pool).run(request, RequestTimeline(submitted_ns=now_ns()),
                                             threading.Event(), events.append)
    return result, events


@pytest.mark.parametrize("lookup_cls", [PromptLookup, ScriptedLookup])
def test_greedy_output_and_cache_match_plain_decoding(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, lookup_cls: type) -> None:
    monkeypatch.setattr(speculative, "PromptLookup", lookup_cls)
    prompt = fixed_prompt_ids(tiny, 48)
    outputs = {}
    for mode in (None, "ngram"):
        pool = PrefixCache(tiny.model.config, budget_bytes=1 << 30)
        request = GenerationRequest(
            [], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
            conversation_id="c", prompt_token_ids=prompt, speculative=mode)
        result, events = run(tiny, pool, request)
        tokens = [e for e in events if isinstance(e, TokenEmitted)]
        assert [e.index for e in tokens] == list(range(len(result.token_ids)))
        assert [e.token_id for e in tokens] == result.token_ids
        assert [e.t_ns for e in tokens] == sorted(e.t_ns for e in tokens)
        entry = pool._entries["c"]
        # the cache holds exactly prompt + reply minus its last token, and ids mirror it
        assert entry.ids == prompt + result.token_ids[:-1]
        assert entry.cache.get_seq_length() == len(entry.ids)
        outputs[mode] = result
    plain, spec = outputs[None], outputs["ngram"]
    assert spec.token_ids == plain.token_ids
    assert spec.text == plain.text and spec.finish_reason == plain.finish_reason
    assert plain.speculative is None and plain.spec_proposed == 0
    assert spec.speculative == "ngram" and spec.spec_proposed > 0
    assert 0 <= spec.spec_accepted <= spec.spec_proposed
    if lookup_cls is ScriptedLookup:
        assert spec.spec_accepted < spec.spec_proposed


def test_speculative_stops_at_eos_and_budget_like_plain(tiny: LoadedModel) -> None:
    prompt = fixed_prompt_ids(tiny, 32)
    for max_tokens in (1, 2, 7):
        plain = run_ours(TorchRuntime(tiny), prompt, max_tokens)
        spec = run_ours(TorchRuntime(tiny), prompt, max_tokens, speculative="ngram")
        assert spec.token_ids == plain.token_ids and len(spec.token_ids) == max_tokens
    chat = [ChatMessage("user", "Hello, how are you today?")]
    results = []
    for mode in (None, "ngram"):
        pool = PrefixCache(tiny.model.config, budget_bytes=1 << 30)
        request = GenerationRequest(chat, SamplingParams(temperature=0.0, max_tokens=60),
                                    speculative=mode)
        results.append(run(tiny, pool, request)[0])
    assert results[0].token_ids == results[1].token_ids
    assert results[0].finish_reason == results[1].finish_reason
    assert results[0].text == results[1].text


def test_sampled_requests_decode_plainly(tiny: LoadedModel) -> None:
    pool = PrefixCache(tiny.model.config, budget_bytes=1 << 30)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    prompt = fixed_prompt_ids(tiny, 16)
    spec, _ = run(tiny, pool, GenerationRequest([], params, prompt_token_ids=prompt,
                                                speculative="ngram"))
    plain, _ = run(tiny, pool, GenerationRequest([], params, prompt_token_ids=prompt))
    assert spec.speculative is None and spec.spec_proposed == 0
    assert spec.token_ids == plain.token_ids


def test_unknown_method_is_refused() -> None:
    request = GenerationRequest([ChatMessage("user", "hi")],
                                speculative="medusa")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="unknown speculative method"):
        request.validate()


def test_json_reports_acceptance(tiny: LoadedModel) -> None:
    spec = run_ours(TorchRuntime(tiny), fixed_prompt_ids(tiny, 32), 24, speculative="ngram")
    data = spec.to_json_dict()
    assert data["speculative"] == "ngram"
    assert data["spec_proposed"] == spec.spec_proposed > 0
    assert data["spec_accept_rate"] == pytest.approx(spec.spec_accepted / spec.spec_proposed)


class NoDraftModel:
    """A Drafter that must never be asked: drafter_for only wraps it."""

    def __init__(self) -> None:
        self.context = 64
        self.last_probs: list[torch.Tensor] = []

    def prefill(self, prompt_ids: Sequence[int], cancel: threading.Event) -> bool:
        raise AssertionError("drafter_for must not run the draft model")

    def propose(self, history: Sequence[int], k: int, stop_ids: Collection[int] = (),
                params: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> list[int]:
        raise AssertionError("drafter_for must not run the draft model")


def test_the_drafter_each_request_gets() -> None:
    """Which drafter a request speculates with, alone or in a batch (drafter_for): none for a
    plain request even with a draft model loaded, none where the cache cannot take a rejected
    draft back, prompt lookup for greedy requests only; a draft model's drafts stop at the end
    tokens unless the request ignores them."""
    from engine.core.speculative import DraftProposer, drafter_for
    from engine.params import Speculative

    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    sampled = SamplingParams(temperature=0.8, max_tokens=8, seed=1)
    draft_model = NoDraftModel()

    def choose(params: SamplingParams, method: Speculative | None, rolls_back: bool = True,
               draft: NoDraftModel | None = draft_model) -> object:
        request = GenerationRequest([], params, prompt_token_ids=[5, 6, 7], speculative=method)
        return drafter_for(request, [5, 6, 7], rolls_back, draft, {2}, None)

    assert choose(greedy, None) is None
    assert choose(greedy, "ngram", rolls_back=False) is None
    assert choose(greedy, "draft", rolls_back=False) is None
    assert isinstance(choose(greedy, "ngram"), PromptLookup)
    assert choose(sampled, "ngram") is None
    assert choose(greedy, "draft", draft=None) is None
    stops = choose(greedy, "draft")
    assert isinstance(stops, DraftProposer) and stops.stop_ids == {2}
    ignoring = choose(SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), "draft")
    assert isinstance(ignoring, DraftProposer) and ignoring.stop_ids == frozenset()
    assert ignoring.draft is draft_model and ignoring.history == [5, 6, 7]
