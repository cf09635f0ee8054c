"""Draft-model speculative decoding: exact greedy output, cache sync, acceptance, errors.

The shared tiny model's tied random embeddings make it repeat its last token, which any
draft predicts; these tests build an untied target whose greedy replies vary, and drafts
from its tokenizer: the target itself, a noisy copy (agrees often, not always) and a smaller
model (agrees rarely).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from app.cli import main as cli_main
from engine import (
    ChatMessage,
    DraftModelChanged,
    GenerationRequest,
    ModelLoadError,
    ModelLoadFailed,
    PhasewiseError,
    SamplingParams,
    TokenEmitted,
)
from engine.core.sampling import make_generator
from engine.core.speculative import MAX_DRAFT, START_DRAFT, DraftProposer, accept_or_resample
from engine.metrics import RequestTimeline, now_ns
from engine.runtimes.torch.draft import DraftModel, load_draft
from engine.runtimes.torch.generate import DecodeSession
from engine.runtimes.torch.loader import LoadedModel, load_model
from engine.runtimes.torch.prefix_cache import PrefixCache
from engine.runtimes.torch.runtime import TorchRuntime
from engine.tools.bench import bench_decode, fixed_prompt_ids
from engine.worker import Engine
from tests.support.tiny_model import build_tiny_tokenizer

CHAT = [ChatMessage("user", "Hello, how are you today? The capital of France is Paris.")]


def save_model(folder: Path, tokenizer_dir: Path, *, hidden: int, seed: int,
               noise_from: Path | None = None, noise: float = 0.0) -> Path:
    """A random untied Llama with tokenizer_dir's tokenizer; with noise_from, that model's
    weights plus Gaussian noise of the given scale instead."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(seed)
    if noise_from is not None:
        model = LlamaForCausalLM.from_pretrained(noise_from)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise * p.std().clamp(min=1e-3))
    else:
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False, initializer_range=0.2)
        model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec-draft")
    target = save_model(root / "target", tiny_model_dir, hidden=64, seed=0)
    return {
        "self": target,
        "noisy": save_model(root / "noisy", tiny_model_dir, hidden=64, seed=1,
                            noise_from=target, noise=0.05),
        "small": save_model(root / "small", tiny_model_dir, hidden=32, seed=2),
    }


@pytest.fixture(scope="module")
def target(model_dirs: dict[str, Path]) -> LoadedModel:
    return load_model(str(model_dirs["self"]))


@pytest.fixture(scope="module")
def drafts(model_dirs: dict[str, Path], target: LoadedModel) -> dict[str, DraftModel]:
    return {name: load_draft(str(folder), target, kernel="fp32-eager")
            for name, folder in model_dirs.items()}


def run(target: LoadedModel, request: GenerationRequest, draft: DraftModel | None = None,
        pool: PrefixCache | None = None, eos_ids: set[int] | None = None):
    pool = pool or PrefixCache(target.model.config, budget_bytes=1 << 30)
    session = DecodeSession(target, pool, draft=draft)
    if eos_ids is not None:
        session.vocab = dataclasses.replace(session.vocab, eos_ids=frozenset(eos_ids))
    events: list = []
    result = session.run(request, RequestTimeline(submitted_ns=now_ns()), threading.Event(),
                         events.append)
    return result, events, pool


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.mark.parametrize("name", ["self", "noisy", "small"])
def test_greedy_output_matches_plain_decoding(target: LoadedModel,
                                              drafts: dict[str, DraftModel], name: str) -> None:
    draft = drafts[name]
    proposed = accepted = 0
    for prompt_len, max_tokens in ((5, 40), (40, 9), (23, 2), (40, 1)):
        prompt = fixed_prompt_ids(target, prompt_len)
        outputs = {}
        for mode in (None, "draft"):
            request = GenerationRequest([], greedy(max_tokens, ignore_eos=True),
                                        conversation_id="c", prompt_token_ids=prompt,
                                        speculative=mode)
            result, events, pool = run(target, request, draft)
            tokens = [e for e in events if isinstance(e, TokenEmitted)]
            assert [e.token_id for e in tokens] == result.token_ids
            assert [e.index for e in tokens] == list(range(max_tokens))
            entry = pool._entries["c"]  # the target's cache mirrors prompt + reply[:-1]
            assert entry.ids == prompt + result.token_ids[:-1]
            assert entry.cache.get_seq_length() == len(entry.ids)
            outputs[mode] = result
        plain, spec = outputs[None], outputs["draft"]
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        assert spec.speculative == "draft" and spec.finish_reason == "length"
        assert 0 <= spec.spec_accepted <= spec.spec_proposed
        proposed += spec.spec_proposed
        accepted += spec.spec_accepted
    assert proposed > 0
    if name == "self":
        assert accepted == proposed  # the target agrees with itself on every token
    elif name == "noisy":
        assert 0 < accepted < proposed  # partial acceptance: the crop paths ran
    # the draft's cache still mirrors its ids after all those crops
    assert draft.cache.get_seq_length() == len(draft.ids)


def test_stop_string_and_eos_end_the_reply_like_plain(target: LoadedModel,
                                                      drafts: dict[str, DraftModel]) -> None:
    plain, _, _ = run(target, GenerationRequest(CHAT, greedy(40, ignore_eos=True)))
    eos = {plain.token_ids[6]}  # pretend a token mid-reply is EOS
    stop = plain.text[len(plain.text) // 2 :][:3]
    assert stop.strip()
    for name in ("self", "noisy"):
        for params, eos_ids in ((greedy(40), eos), (greedy(40, stop=(stop,)), None)):
            base, _, _ = run(target, GenerationRequest(CHAT, params), eos_ids=eos_ids)
            spec, _, _ = run(target, GenerationRequest(CHAT, params, speculative="draft"),
                             drafts[name], eos_ids=eos_ids)
            assert base.finish_reason == "stop"
            assert spec.token_ids == base.token_ids
            assert spec.text == base.text and spec.finish_reason == "stop"


def test_follow_up_turn_reuses_the_prefix_cache(model_dirs: dict[str, Path]) -> None:
    with Engine(cache_budget_bytes=64 << 20) as engine:
        engine.load_model_sync(str(model_dirs["self"]), kernel="fp32-eager")
        engine.load_draft_sync(str(model_dirs["noisy"]), kernel="fp32-eager")
        replies: dict[str | None, list] = {}
        for mode in (None, "draft"):
            messages = list(CHAT)
            replies[mode] = []
            for question in ("Say more.", "And then?"):
                result = engine.submit(GenerationRequest(
                    list(messages), greedy(24), conversation_id=f"conv-{mode}",
                    speculative=mode)).wait(60)
                replies[mode].append(result)
                messages += [ChatMessage("assistant", result.text),
                             ChatMessage("user", question)]
        for plain, spec in zip(replies[None], replies["draft"], strict=True):
            assert spec.token_ids == plain.token_ids
        # turn 2 reused turn 1's prompt and reply (the first turns share a prefix pool too)
        second = replies["draft"][1]
        assert second.metrics.cached_tokens > len(replies["draft"][0].token_ids)
        assert second.spec_proposed > 0


def test_draft_length_adapts_to_acceptance(target: LoadedModel,
                                           drafts: dict[str, DraftModel]) -> None:
    proposer = DraftProposer(drafts["self"], fixed_prompt_ids(target, 12))
    sizes = []
    for _ in range(MAX_DRAFT):
        draft = proposer.propose(100)
        sizes.append(len(draft))
        for token in draft:  # all accepted, then the target's own next token
            proposer.append(token)
        proposer.append(0)
    assert sizes[0] == START_DRAFT and sizes[-1] == MAX_DRAFT
    assert sizes == sorted(sizes)
    draft = proposer.propose(100)
    proposer.append((draft[0] + 1) % len(target.tokenizer))  # rejected at once
    assert len(proposer.propose(100)) == MAX_DRAFT - 1
    assert len(proposer.propose(3)) == 3  # never past the room it is given


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0  # never a token the target gives probability 0
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


@pytest.mark.parametrize("q", [
    [0.1, 0.1, 0.2, 0.3, 0.2, 0.1],  # a poor draft, with mass where the target has none
    [0.0, 0.0, 0.0, 1.0, 0.0, 0.0],  # a deterministic draft (as prompt lookup's)
])
def test_speculative_sampling_rule_draws_from_the_target(q: list[float]) -> None:
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    q_t = torch.tensor(q)
    drafts, gen = torch.Generator().manual_seed(0), make_generator(0)
    counts = torch.zeros(6)
    draws = 12_000
    for _ in range(draws):
        drafted = int(torch.multinomial(q_t, 1, generator=drafts))
        counts[accept_or_resample(p, q_t, drafted, gen)] += 1
    # 4 degrees of freedom: 35 is far out in the tail (p < 1e-6) for the right distribution;
    # keeping the draft's distribution or resampling from p instead of the residual lands
    # in the thousands
    assert chi_square(counts, p) < 35


def sampled(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=7, max_tokens=max_tokens, ignore_eos=True,
                          **kw)


def test_sampled_self_draft_accepts_all_and_repeats_with_the_seed(
        target: LoadedModel, drafts: dict[str, DraftModel]) -> None:
    prompt = fixed_prompt_ids(target, 16)
    request = GenerationRequest([], sampled(30), prompt_token_ids=prompt, speculative="draft")
    first, _, _ = run(target, request, drafts["self"])
    again, _, _ = run(target, request, drafts["self"])
    assert first.speculative == "draft" and first.spec_proposed > 0
    assert first.spec_accepted == first.spec_proposed  # p == q: min(1, p/q) is 1
    assert again.token_ids == first.token_ids and len(first.token_ids) == 30


def test_sampled_drafts_repeat_with_the_seed_whatever_torchs_own_state(
        target: LoadedModel, drafts: dict[str, DraftModel]) -> None:
    """The acceptance draws come from the request's generator, not torch's global one: a
    noisy draft (some proposals rejected) gives the same reply after other global seeds."""
    prompt = fixed_prompt_ids(target, 16)
    request = GenerationRequest([], sampled(30), prompt_token_ids=prompt, speculative="draft")
    torch.manual_seed(1)
    first, _, _ = run(target, request, drafts["noisy"])
    torch.manual_seed(2)
    again, _, _ = run(target, request, drafts["noisy"])
    assert 0 < first.spec_accepted < first.spec_proposed
    assert again.token_ids == first.token_ids


@torch.inference_mode()
def test_sampled_drafts_stay_in_the_targets_filtered_support(
        target: LoadedModel, drafts: dict[str, DraftModel]) -> None:
    prompt = fixed_prompt_ids(target, 16)
    request = GenerationRequest([], sampled(40, top_k=3), prompt_token_ids=prompt,
                                speculative="draft")
    result, _, _ = run(target, request, drafts["noisy"])
    assert 0 < result.spec_accepted < result.spec_proposed
    # teacher-forced: each reply token is among the target's top 3 at its position
    ids = torch.tensor([prompt + result.token_ids])
    logits = target.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    top3 = logits.topk(3).indices.tolist()
    assert all(t in top for t, top in zip(result.token_ids, top3, strict=True))


def copy_with_tokenizer(source: Path, folder: Path, tokenizer_dir: Path) -> Path:
    """source's weights with another tokenizer."""
    shutil.copytree(source, folder)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def swap_two_tokens(folder: Path) -> tuple[int, int]:
    """Swap the ids of the last two ordinary tokens in folder's tokenizer.json: same size,
    same special tokens, different meaning."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    by_id = sorted(vocab, key=vocab.get)
    a, b = by_id[-1], by_id[-2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(data), encoding="utf-8")
    return vocab[a], vocab[b]


def test_vocabulary_mismatch_is_a_clear_error(model_dirs: dict[str, Path], tmp_path: Path
                                              ) -> None:
    other_tokens = build_tiny_tokenizer(tmp_path / "tok", ["<s>", "</s>"], "{{ 'x' }}",
                                        bos="<s>", eos="</s>")
    smaller = copy_with_tokenizer(model_dirs["small"], tmp_path / "smaller", other_tokens)
    swapped = tmp_path / "swapped"
    shutil.copytree(model_dirs["small"], swapped)
    swap_two_tokens(swapped)
    failures: list[ModelLoadFailed] = []
    with Engine(cache_budget_bytes=64 << 20) as engine:
        engine.add_listener(lambda e: failures.append(e) if isinstance(e, ModelLoadFailed)
                            else None)
        with pytest.raises(ModelLoadError, match="before its draft"):
            engine.load_draft_sync(str(model_dirs["small"]))
        engine.load_model_sync(str(model_dirs["self"]), kernel="fp32-eager")
        engine.load_draft_sync(str(model_dirs["self"]), kernel="fp32-eager")
        for folder, reason in ((smaller, "tokens vs the model's"), (swapped, r"token \d+ is")):
            with pytest.raises(ModelLoadError, match="does not share the vocabulary") as info:
                engine.load_draft_sync(str(folder), kernel="fp32-eager")
            message = str(info.value)
            assert "\n" not in message and reason.split()[0] in message
        # the engine still serves, with the draft it had
        result = engine.submit(GenerationRequest(CHAT, greedy(8), speculative="draft")).wait(60)
        assert result.speculative == "draft" and len(result.token_ids) > 0
    # each failure reached listeners marked as the draft's, so the window can say so
    assert len(failures) == 3 and all(f.draft for f in failures)


def test_draft_requests_need_a_draft_which_a_new_model_drops(model_dirs: dict[str, Path]
                                                             ) -> None:
    request = GenerationRequest(CHAT, greedy(4), speculative="draft")
    changes: list[DraftModelChanged] = []
    with Engine(cache_budget_bytes=64 << 20) as engine:
        engine.add_listener(lambda e: changes.append(e) if isinstance(e, DraftModelChanged)
                            else None)
        engine.load_model_sync(str(model_dirs["self"]), kernel="fp32-eager")
        with pytest.raises(PhasewiseError, match="needs one: load it first"):
            engine.submit(request).wait(60)
        engine.load_draft_sync(str(model_dirs["noisy"]), kernel="fp32-eager")
        assert engine.submit(request).wait(60).speculative == "draft"
        engine.load_model_sync(str(model_dirs["small"]), kernel="fp32-eager")
        with pytest.raises(PhasewiseError, match="needs one"):
            engine.submit(GenerationRequest(CHAT, greedy(4), speculative="draft")).wait(60)
        engine.load_draft_sync(str(model_dirs["self"]), kernel="fp32-eager")
        engine.load_draft_sync(None)  # dropped on request too
        with pytest.raises(PhasewiseError, match="needs one"):
            engine.submit(GenerationRequest(CHAT, greedy(4), speculative="draft")).wait(60)
    # Listeners (the window) hear each change: loaded, dropped by the new model, loaded, dropped.
    assert [(c.name is not None, c.kernel) for c in changes] == [
        (True, "fp32-eager"), (False, None), (True, "fp32-eager"), (False, None)]


def test_cancel_mid_run_then_decode_exactly_again(model_dirs: dict[str, Path],
                                                  target: LoadedModel) -> None:
    prompt = fixed_prompt_ids(target, 20)
    params = greedy(200, ignore_eos=True)
    with Engine(cache_budget_bytes=64 << 20) as engine:
        engine.load_model_sync(str(model_dirs["self"]), kernel="fp32-eager")
        engine.load_draft_sync(str(model_dirs["noisy"]), kernel="fp32-eager")
        handle = engine.submit(GenerationRequest([], params, prompt_token_ids=prompt,
                                                 speculative="draft"))
        for event in handle.events(timeout=60):
            if isinstance(event, TokenEmitted):
                handle.cancel()
        result = handle.wait(60)
        assert result.finish_reason == "cancelled"
        assert 0 < len(result.token_ids) < 200
        short = GenerationRequest([], greedy(30, ignore_eos=True), prompt_token_ids=prompt)
        plain = engine.submit(short).wait(60)
        again = engine.submit(GenerationRequest([], short.params, prompt_token_ids=prompt,
                                                speculative="draft")).wait(60)
        assert again.token_ids == plain.token_ids and again.spec_proposed > 0


def test_bench_reports_ngram_and_draft(target: LoadedModel,
                                       drafts: dict[str, DraftModel]) -> None:
    report = bench_decode(TorchRuntime(target), prompt_tokens=24, max_tokens=12, repeats=1,
                          speculative=True, draft=drafts["self"])
    assert report["spec_method"] == "ngram" and report["draft_method"] == "draft"
    assert report["draft_output_identical"] is True and report["spec_output_identical"] is True
    assert report["draft_accepted"] == report["draft_proposed"] > 0
    assert report["draft_accept_rate"] == 1.0 and report["draft_speedup"] > 0


def test_cli_ask_json_and_bench_with_a_draft_model(capsys, model_dirs: dict[str, Path]
                                                   ) -> None:
    target, noisy = str(model_dirs["self"]), str(model_dirs["noisy"])
    code = cli_main(["ask", "--model", target, "--kernel", "fp32-eager", "--draft-model", noisy,
                     "--draft-kernel", "fp32-eager", "--temperature", "0", "--max-tokens",
                     "12", "--json", "Hello there"])
    assert code == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["speculative"] == "draft"
    assert data["spec_proposed"] >= data["spec_accepted"] >= 0 and data["spec_proposed"] > 0
    code = cli_main(["bench", "--model", target, "--kernel", "fp32-eager", "--draft-model",
                     target, "--draft-kernel", "fp32-eager", "--max-tokens", "8",
                     "--prompt-tokens", "16", "--repeats", "1", "--json"])
    assert code == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["draft_output_identical"] is True and "spec_proposed" in report
    assert "speculative (draft" in out


def test_cli_refuses_draft_method_without_a_draft_model(capsys, model_dirs: dict[str, Path]
                                                        ) -> None:
    code = cli_main(["ask", "--model", str(model_dirs["self"]), "--speculative", "draft", "hi"])
    assert code == 1
    assert "--speculative draft needs --draft-model" in capsys.readouterr().err


@pytest.mark.real_model
def test_int8_copy_drafts_exactly_for_the_real_model() -> None:
    """The useful draft on a CPU: the default model through int8-dynamic (which fails the
    kernel quality guard as a target) drafts for fp32; verification keeps the output exact."""
    from engine.core.chat_template import encode_chat_with_spans
    from engine.tools.bench import run_ours

    target = load_model("default")
    draft = load_draft("default", target, kernel="int8-dynamic")
    question = [ChatMessage("user", "Explain in two sentences why the sky is blue.")]
    ids = encode_chat_with_spans(target.tokenizer, question)[0]
    plain = run_ours(TorchRuntime(target), ids, 40)
    spec = run_ours(TorchRuntime(target), ids, 40, speculative="draft", draft=draft)
    assert spec.token_ids == plain.token_ids
    assert spec.spec_accepted > spec.spec_proposed / 2
