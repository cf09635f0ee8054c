"""Every architecture a user may bring: tiny random models built from real transformers config
classes (tests/support/tiny_model.py), each run through the engine exactly as a downloaded
folder is.

Sliding-window models (Mistral, Qwen2/3 with sliding layers, Gemma 2/3, Phi-3) get chats far
longer than their 16-token window, so every rollback (regenerate, edit, a rejected draft, the
batcher's re-packing) reaches back past it; LFM2 mixes short-convolution layers with attention,
Qwen3-Next linear attention, whose recurrent state cannot roll back (the ledger says so).
Each must give exactly the tokens transformers' own generate() and a cold prompt give.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import ChatMessage, GenerationRequest, SamplingParams
from engine.errors import ModelLoadError
from engine.runtimes.torch.layer_progress import LayerProgress, decoder_layers
from engine.runtimes.torch.prefix_cache import (
    PrefixCache,
    RollbackError,
    checkpoint_if_due,
    crop_to,
    cut_to,
    model_rollback_blocker,
    new_cache,
)
from engine.worker import Engine
from tests.support.tiny_model import ARCHITECTURES, TINY_WINDOW, build_tiny_architecture

SYSTEM = ChatMessage("system", "You are a helpful assistant. The capital of France is Paris.")
QUESTION = ChatMessage("user", "Hello, how are you today? Tell me about the capital of Germany.")


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


class Arch:
    """One architecture's tiny model: a started engine, and transformers' own model."""

    def __init__(self, model_type: str, folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model_type = model_type
        self.folder = folder
        self.engine = Engine(cache_budget_bytes=64 << 20).start()
        self.engine.load_model_sync(str(folder), kernel="fp32-eager")
        self.reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.reference.eval()
        self.rolls_back = model_rollback_blocker(self.reference.config) is None

    def ask(self, messages: list[ChatMessage], conv: str | None = None, params=None, **kw):
        request = GenerationRequest(list(messages), params or greedy(), conversation_id=conv,
                                    **kw)
        return self.engine.submit(request).wait(120)

    def cold(self, messages: list[ChatMessage], params=None):
        return self.ask(messages, None, params, reuse_cache=False)

    def generate(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = self.reference.generate(torch.tensor([prompt_ids]), do_sample=False,
                                          max_new_tokens=max_tokens)
        return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         ) -> Iterator[Arch]:
    model_type = request.param
    folder = build_tiny_architecture(tmp_path_factory.mktemp(model_type), model_type)
    built = Arch(model_type, folder)
    yield built
    built.engine.shutdown()


def chat(arch: Arch, conv: str, turns: int = 3, params=None) -> list:
    """A cached multi-turn chat; returns each turn's (messages, result)."""
    messages = [SYSTEM, QUESTION]
    out = []
    for i in range(turns):
        result = arch.ask(messages, conv, params)
        out.append((list(messages), result))
        messages += [ChatMessage("assistant", result.text),
                     ChatMessage("user", f"Thank you. And question {i}: what about Paris?")]
    return out


def test_greedy_reply_matches_transformers_generate(arch: Arch) -> None:
    result = arch.ask([SYSTEM, QUESTION], params=greedy(24))
    assert len(result.prompt_token_ids) > TINY_WINDOW
    expected = arch.generate(result.prompt_token_ids, 24)
    assert result.token_ids == expected[: len(result.token_ids)]
    assert result.finish_reason == "stop" or result.token_ids == expected


def test_prefill_progress_comes_after_each_decoder_layer(arch: Arch) -> None:
    """Progress within a prefill chunk (engine.runtimes.torch.layer_progress) finds every layer, in
    order."""
    seen: list[float] = []
    layers = decoder_layers(arch.reference)
    assert len(layers) == arch.reference.config.num_hidden_layers
    with torch.inference_mode(), LayerProgress(layers, seen.append):
        arch.reference(input_ids=torch.tensor([[5, 6, 7, 8]]))
    assert seen == [(i + 1) / len(layers) for i in range(len(layers))]


def test_cached_chat_matches_cold_prompts_past_the_window(arch: Arch) -> None:
    turns = chat(arch, "chat")
    for messages, warm in turns:
        assert warm.token_ids == arch.cold(messages).token_ids
    last = turns[-1][1].metrics
    if arch.rolls_back:
        assert last.cached_tokens > 2 * TINY_WINDOW
        assert last.cache_miss_reason in ("none", "template_mismatch")
    else:  # at least the last prompt but one token comes back, from its checkpoint
        assert last.cache_miss_reason in ("none", "recurrent_state")
        assert last.cached_tokens >= turns[-2][1].metrics.prompt_tokens - 1


def test_regenerate_and_edit_match_cold(arch: Arch) -> None:
    turns = chat(arch, "edit", turns=2)
    messages, first = turns[-1]
    again = arch.ask(messages, "edit")  # regenerate: the cache goes back past a whole reply
    assert again.token_ids == first.token_ids
    assert again.metrics.cached_tokens == again.metrics.prompt_tokens - 1
    assert again.metrics.cache_miss_reason == "none"
    edited = [SYSTEM, ChatMessage("user", "Hello, how are you? Tell me about Berlin."),
              *messages[2:]]
    warm = arch.ask(edited, "edit")
    assert warm.token_ids == arch.cold(edited).token_ids
    if not arch.rolls_back:  # the edit is before the checkpoint: computed cold, and said why
        assert warm.metrics.cache_miss_reason == "recurrent_state"
        return
    assert warm.metrics.cache_miss_reason == "edited_history"
    assert 0 < warm.metrics.cached_tokens < warm.metrics.prompt_tokens - TINY_WINDOW


def test_alternatives_and_concurrent_requests_match_alone(arch: Arch) -> None:
    long_chat = chat(arch, "alone", turns=2)[-1][0]
    alone = [arch.cold(messages).token_ids for messages in ([SYSTEM, QUESTION], long_chat)]
    request = GenerationRequest([SYSTEM, QUESTION], greedy(), conversation_id="alts")
    handles = arch.engine.submit_alternatives(request, 3)
    assert [h.wait(120).token_ids for h in handles] == [alone[0]] * 3
    both = [arch.engine.submit(GenerationRequest(messages, greedy(), conversation_id=conv))
            for conv, messages in (("a", [SYSTEM, QUESTION]), ("b", long_chat))]
    assert [h.wait(120).token_ids for h in both] == alone


class FlawedOracle:
    """A drafter that knows the plain reply and drafts it with mistakes: three right tokens
    then a wrong one, and every other step four wrong ones, so each verification keeps part
    of a draft and the cache must roll the rest back (past the window, in a long chat)."""

    draft_probs = None

    def __init__(self, truth: list[int], prompt_ids: list[int], vocab: int) -> None:
        self.truth, self.vocab, self.generated, self.steps = truth, vocab, 0, 0
        self.prompt_len = len(prompt_ids)

    def prepare(self, cancel: threading.Event) -> bool:
        return not cancel.is_set()

    def append(self, token: int) -> None:
        self.generated += 1

    def propose(self, max_tokens: int) -> list[int]:
        self.steps += 1
        right = self.truth[self.generated : self.generated + min(max_tokens, 4)]
        wrong = [(t + 1) % self.vocab for t in right]
        return wrong if self.steps % 2 else right[:3] + wrong[3:]


def test_speculation_matches_plain_and_rolls_back(arch: Arch, monkeypatch) -> None:
    story = ChatMessage("user", "Hello world. Hello world. The capital of France is Paris. "
                                "The capital of Germany is Berlin. Hello world.")
    messages = [*chat(arch, "spec", turns=2)[-1][0][:-1], story]
    params = greedy(24, ignore_eos=True)
    plain = arch.cold(messages, params)
    lookup = arch.ask(messages, params=params, speculative="ngram")
    assert lookup.token_ids == plain.token_ids  # prompt lookup as shipped
    if not arch.rolls_back:
        assert lookup.speculative is None  # it needs a rollback: decoded plainly, and says so
        return
    vocab = arch.reference.config.vocab_size
    monkeypatch.setattr("engine.core.speculative.PromptLookup",
                        lambda ids: FlawedOracle(plain.token_ids, ids, vocab))
    spec = arch.ask(messages, "spec", params=params, speculative="ngram")
    assert spec.token_ids == plain.token_ids
    assert 0 < spec.spec_accepted < spec.spec_proposed


def test_cache_crops_back_past_the_window_exactly(arch: Arch) -> None:
    """The cache itself: cut back past the window (a recurrent one: to its checkpoint), then
    extended, gives cold logits."""
    model = arch.reference
    ids = torch.randint(3, model.config.vocab_size, (3 * TINY_WINDOW,)).tolist()
    pool = PrefixCache(model.config, budget_bytes=1 << 30)
    lease = pool.acquire("x", ids)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:-1]]), cache=lease.cache, use_cache=True)
        lease.ids.extend(ids[:-1])
        checkpoint_if_due(lease)
        keep = TINY_WINDOW // 2
        if not arch.rolls_back:
            with pytest.raises(RollbackError, match="recurrent_state"):
                crop_to(lease.cache, keep)
            keep = len(ids) - 1  # its checkpoint, taken when the prefill passed there
            model(input_ids=torch.tensor([[1, 2, 3]]), cache=lease.cache, use_cache=True)
            cut_to(lease.cache, lease.checkpoint, keep)
        else:
            crop_to(lease.cache, keep)
        assert lease.cache.get_seq_length() == keep
        warm = model(input_ids=torch.tensor([ids[keep:]]), cache=lease.cache,
                     use_cache=True).logits[0, -1]
        cold = model(input_ids=torch.tensor([ids]), cache=new_cache(model.config),
                     use_cache=True).logits[0, -1]
    assert torch.allclose(warm, cold, atol=1e-4)


def test_architecture_the_engine_cannot_run_is_refused_in_one_line(tmp_path: Path) -> None:
    from transformers import T5Config

    folder = build_tiny_architecture(tmp_path / "llama", "llama")
    T5Config(vocab_size=400, d_model=32, d_ff=64, num_layers=1, num_heads=2).save_pretrained(
        folder)
    with Engine() as engine, pytest.raises(ModelLoadError) as err:
        engine.load_model_sync(str(folder), kernel="fp32-eager")
    message = str(err.value)
    assert "\n" not in message
    assert "t5" in message and "text-generation" in message


def test_architecture_transformers_does_not_know_is_refused_in_one_line(tmp_path: Path) -> None:
    import json

    folder = build_tiny_architecture(tmp_path / "llama", "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "futurenet"}))
    with Engine() as engine, pytest.raises(ModelLoadError) as err:
        engine.load_model_sync(str(folder), kernel="fp32-eager")
    assert "\n" not in str(err.value) and "does not know the 'futurenet'" in str(err.value)


def test_model_sampling_defaults_come_from_its_generation_config(tmp_path: Path) -> None:
    from transformers import GenerationConfig

    from engine.events import SamplingDefaults

    folder = build_tiny_architecture(tmp_path / "qwen3", "qwen3")
    with Engine() as engine:
        assert engine.load_model_sync(str(folder), kernel="fp32-eager").sampling_defaults \
            == SamplingDefaults()  # it ships none: the window keeps its own
        GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20,
                         repetition_penalty=1.1).save_pretrained(folder)
        info = engine.load_model_sync(str(folder), kernel="fp32-eager")
    assert info.sampling_defaults == SamplingDefaults(0.6, 0.95, 20, 1.1)


def _turn_after_restart(arch: Arch, shelf: Path, messages: list[ChatMessage]):
    """Chat "c"'s turn in a new engine whose snapshots are in `shelf`."""
    with Engine(snapshot_dir=shelf) as engine:
        engine.load_model_sync(str(arch.folder), kernel="fp32-eager")
        return engine.submit(GenerationRequest(messages, greedy(8), conversation_id="c")
                             ).wait(120)


def test_a_chat_resumes_from_disk_on_every_architecture(arch: Arch, tmp_path: Path) -> None:
    """After a restart a chat's next turn reads its KV snapshot back and says so, on every
    architecture: attention keys and values, a convolution layer's recorded input, a
    recurrent state and its checkpoint. The snapshot goes back as far as the cache in memory
    would: a regenerate to all of the prompt but its last token (a recurrent cache: from its
    checkpoint); an edit before that, on a recurrent cache, runs cold and says why. Every
    reply is the cold one."""
    shelf, first = tmp_path / "kv", [SYSTEM, QUESTION]
    r1 = _turn_after_restart(arch, shelf, first)
    assert len(list(shelf.rglob("*.kv"))) == 1
    tail = [r1.as_message(), ChatMessage("user", "And then?")]
    second = [*first, *tail]
    edited = [SYSTEM, ChatMessage("user", "Hello, how are you? Tell me about Berlin."), *tail]
    for name, messages in (("next", second), ("regenerate", first), ("edit", edited)):
        copy = shutil.copytree(shelf, tmp_path / name)  # each starts from turn 1's snapshot
        warm = _turn_after_restart(arch, copy, messages)
        assert warm.token_ids == arch.cold(messages, greedy(8)).token_ids, name
        m = warm.metrics
        if name == "edit" and not arch.rolls_back:
            assert (m.cache_miss_reason, m.cached_tokens, m.restored_tokens) == (
                "recurrent_state", 0, 0)
            continue
        assert m.cache_miss_reason == "restored_from_disk", name
        assert m.restored_tokens == m.cached_tokens
        if name == "next":  # all of turn 1's prompt, and its reply as far as the new prompt
            # encodes it alike (a random model's reply may end in a broken UTF-8 sequence)
            assert m.cached_tokens > r1.metrics.prompt_tokens
        elif name == "regenerate":
            assert m.cached_tokens == m.prompt_tokens - 1
            assert warm.token_ids == r1.token_ids
        else:
            assert 0 < m.cached_tokens < m.prompt_tokens - TINY_WINDOW


def test_a_snapshot_that_does_not_fit_the_model_is_dropped_and_the_turn_runs_cold(
        arch: Arch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A whole file (right key, right checksum) whose first layer holds one position or
    column too few: refused in one log line before any tensor is used; the turn runs cold."""
    from safetensors.torch import load, save

    from engine.core.snapshots import KvShelf
    from engine.runtimes.torch.prefix_cache import snapshot_meta

    shelf, first = tmp_path / "kv", [SYSTEM, QUESTION]
    r1 = _turn_after_restart(arch, shelf, first)
    (folder,) = shelf.iterdir()
    shelved_on = KvShelf(shelf, folder.name)
    found = shelved_on.find("c")
    assert found is not None
    data = shelved_on.load(found)
    assert data is not None
    tensors = load(data)
    name = min(n for n in tensors if n.startswith("0."))  # layer 0's keys or first state
    cut = tensors[name][..., :-1, :] if name.endswith((".k", ".v")) else tensors[name][..., :-1]
    tensors[name] = cut.contiguous()
    bad = save(tensors, metadata=snapshot_meta(data))
    shelved_on.put("c", found.ids, lambda: bad)
    assert shelved_on.flush(10)
    shelved_on.close(10)
    second = [*first, r1.as_message(), ChatMessage("user", "And then?")]
    warm = _turn_after_restart(arch, shelf, second)
    assert warm.token_ids == arch.cold(second, greedy(8)).token_ids
    assert (warm.metrics.cache_miss_reason, warm.metrics.restored_tokens) == ("first_turn", 0)
    (line,) = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert "layer 0" in line and "\n" not in line
