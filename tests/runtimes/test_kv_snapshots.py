"""KV snapshots on disk (engine/core/snapshots.py under the ledger): a chat's next turn after a
restart reads its prefix back from disk instead of the prompt, and says so; its reply is the
cold one. Every bad snapshot is dropped and the turn runs cold with the same reply.

The llama.cpp cases run the engine in a child process per "app start" (a real restart)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import ChatMessage, GenerationRequest, SamplingParams
from engine.core.snapshots import SUFFIX, KvShelf, shelf_usage
from engine.worker import Engine
from tests.support.child import CHILD_TIMEOUT_S, needs_llama_cpp, run_in_child

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SYSTEM = ChatMessage("system", "You are a careful assistant who answers in full sentences.")
FIRST = [SYSTEM, ChatMessage("user", "Tell me about the sea and the ships that sail on it.")]


def _turn(engine: Engine, conv: str, messages: list[ChatMessage], **kw: Any) -> Any:
    return engine.submit(GenerationRequest(list(messages), GREEDY, conversation_id=conv,
                                           **kw)).wait(120)


def _chat_after_restart(spec: str, shelf: Path, *, engine: str = "torch",
                        damage: str | None = None) -> dict[str, Any]:
    """Turn 1 in one engine (snapshot written at its end and flushed at shutdown), then, in a
    new engine, turn 2 of the same chat and the same turn 2 cold in another chat."""
    with Engine(snapshot_dir=shelf) as first:
        first.load_model_sync(spec, engine=engine, kernel="fp32-eager" if engine == "torch"
                              else "auto")
        r1 = _turn(first, "chat", FIRST)
    second = [*FIRST, r1.as_message(), ChatMessage("user", "And what about the storms?")]
    files = sorted(shelf.rglob(f"*{SUFFIX}"))
    if damage is not None:
        _damage(files, damage)
    with Engine(snapshot_dir=shelf) as again:
        again.load_model_sync(spec, engine=engine, kernel="fp32-eager" if engine == "torch"
                              else "auto")
        warm = _turn(again, "chat", second)
        cold = _turn(again, "other", second, reuse_cache=False)
    m = warm.metrics
    return {"files": len(files), "prompt": m.prompt_tokens, "cached": m.cached_tokens,
            "reason": m.cache_miss_reason, "restored": m.restored_tokens,
            "restored_bytes": m.restored_bytes, "warm": warm.token_ids, "cold": cold.token_ids,
            "left": len(list(shelf.rglob(f"*{SUFFIX}"))),
            "first_prompt": r1.metrics.prompt_tokens + len(r1.token_ids)}


def _damage(files: list[Path], how: str) -> None:
    (path,) = files
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "corrupt":
        data[-100] ^= 0xFF
        path.write_bytes(data)
    elif how == "other_model":  # a snapshot filed under another model's key
        other = path.parent.parent / ("0" * 24)
        other.mkdir()
        shutil.move(path, other / path.name)
    elif how == "garbage":
        path.write_bytes(b"not a snapshot at all")


def test_a_chat_resumes_from_disk_after_a_restart(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = _chat_after_restart(str(tiny_model_dir), tmp_path / "kv")
    assert out["files"] == 1
    assert out["reason"] == "restored_from_disk"
    # everything of turn 1 but its last token (generated, never fed) came from disk
    assert out["restored"] == out["cached"] == out["first_prompt"] - 1
    assert out["restored_bytes"] > 0
    assert out["warm"] == out["cold"]


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "other_model", "garbage"])
def test_a_bad_snapshot_is_dropped_and_the_turn_runs_cold(
        tiny_model_dir: Path, tmp_path: Path, damage: str,
        caplog: pytest.LogCaptureFixture) -> None:
    out = _chat_after_restart(str(tiny_model_dir), tmp_path / "kv", damage=damage)
    assert (out["reason"], out["restored"], out["cached"]) == ("first_turn", 0, 0)
    assert out["warm"] == out["cold"]
    if damage != "other_model":  # another model's file is not looked at, so not dropped
        assert "KV snapshot" in caplog.text and "dropped" in caplog.text
        assert out["left"] == 2  # dropped; then turn 2's own and the cold chat's written


def test_a_changed_model_file_finds_no_snapshot(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    shelf = tmp_path / "kv"
    with Engine(snapshot_dir=shelf) as first:
        first.load_model_sync(str(model), kernel="fp32-eager")
        r1 = _turn(first, "chat", FIRST)
    config = model / "config.json"
    config.write_text(config.read_text() + "\n")  # the same model, but its files changed
    with Engine(snapshot_dir=shelf) as again:
        again.load_model_sync(str(model), kernel="fp32-eager")
        second = [*FIRST, r1.as_message(), ChatMessage("user", "And then?")]
        assert _turn(again, "chat", second).metrics.cache_miss_reason == "first_turn"


def test_the_shelf_keeps_to_its_budget_least_recently_used_first(tmp_path: Path) -> None:
    shelf = KvShelf(tmp_path, "k" * 24, budget_bytes=10_000)
    for conv in ("a", "b", "c"):
        shelf.put(conv, [1, 2, 3], lambda: b"x" * 4_000)
        assert shelf.flush(10)
    assert shelf.find("a") is None  # the oldest went to make room for c
    assert shelf.find("b") is not None and shelf.find("c") is not None
    assert shelf_usage(tmp_path)[1] <= 10_000
    shelf.close(10)


def test_a_full_disk_writes_nothing_and_keeps_the_chat_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    shelf = KvShelf(tmp_path, "k" * 24)
    real_fsync = os.fsync

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    shelf.put("a", [1, 2], lambda: b"x" * 100)
    assert shelf.flush(10)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert "No space left on device" in caplog.text
    assert list(tmp_path.rglob("*")) == [tmp_path / ("k" * 24)]  # no partial file left
    shelf.close(10)


def test_a_snapshot_of_another_chat_under_this_chats_name_is_refused(tmp_path: Path) -> None:
    shelf = KvShelf(tmp_path, "k" * 24)
    shelf.put("a", [1, 2, 3], lambda: b"payload")
    assert shelf.flush(10)
    (path,) = tmp_path.rglob(f"*{SUFFIX}")
    shutil.copy(path, shelf._path("b"))
    assert shelf.find("b") is None and not shelf._path("b").exists()
    found = shelf.find("a")
    assert found is not None and found.ids == [1, 2, 3] and shelf.load(found) == b"payload"
    shelf.close(10)


# ----- torch: a recurrent cache's snapshot format (engine/runtimes/torch/prefix_cache.py) ------
@pytest.fixture(scope="module")
def recurrent_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny Qwen3-Next: a linear-attention layer (conv and recurrent states) and an
    attention layer."""
    from transformers import AutoModelForCausalLM

    from tests.support.tiny_model import build_tiny_architecture

    folder = build_tiny_architecture(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _recurrent_cache(model: Any) -> tuple[Any, Any, list[int]]:
    """A cache of 27 positions, with the checkpoint its prefill kept one token short of the
    prompt (24): what a chat's entry holds after a short reply."""
    from engine.runtimes.torch.prefix_cache import PrefixCache, checkpoint_if_due

    ids = list(range(3, 30))
    lease = PrefixCache(model.config, budget_bytes=1 << 30).acquire("c", ids[:-2])
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:-3]]), cache=lease.cache, use_cache=True)
        lease.ids.extend(ids[:-3])
        checkpoint_if_due(lease)
        model(input_ids=torch.tensor([ids[-3:]]), cache=lease.cache, use_cache=True)
    assert lease.checkpoint is not None and lease.checkpoint.length == len(ids) - 3
    return lease.cache, lease.checkpoint, ids


def _states(cache: Any) -> list[torch.Tensor]:
    return [t.clone() for layer in cache.layers
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None),
                      *getattr(layer, "conv_states", {}).values(),
                      *getattr(layer, "recurrent_states", {}).values()) if t is not None]


def test_a_recurrent_snapshot_holds_the_moment_it_was_taken_and_its_checkpoint(
        recurrent_model: Any) -> None:
    """export takes the cache on the engine thread; the bytes are made later on the writer
    thread, after the engine went on and updated the recurrent states in place. The restored
    cache is the one of the moment of export, and its checkpoint takes it back to cold
    logits."""
    from engine.runtimes.torch.prefix_cache import TorchKvStore

    model = recurrent_model
    store = TorchKvStore(model.config)
    cache, checkpoint, ids = _recurrent_cache(model)
    then = _states(cache)
    payload = store.export(cache, checkpoint)
    assert payload is not None
    with torch.inference_mode():  # the chat's next turn runs before the writer gets to it
        model(input_ids=torch.tensor([[7, 8]]), cache=cache, use_cache=True)
    restored, restored_checkpoint = store.restore(bytes(payload()))
    assert store.length(restored) == len(ids)
    assert all(torch.equal(a, b) for a, b in zip(_states(restored), then, strict=True))
    assert restored_checkpoint is not None and restored_checkpoint.length == checkpoint.length
    assert store.blocker(restored) == "recurrent_state"
    keep = checkpoint.length
    store.cut(restored, restored_checkpoint, keep)
    with torch.inference_mode():
        warm = model(input_ids=torch.tensor([ids[keep:]]), cache=restored,
                     use_cache=True).logits[0, -1]
        cold = model(input_ids=torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(warm, cold, atol=1e-4)


@pytest.mark.parametrize(("how", "says"), [
    ("first_format", "not this runtime's snapshot format (none)"),
    ("other_layers", "made for other layers (2 conv; this model: 1 recurrent, 1 attention)"),
    ("checkpoint_state", "its layer 0 (recurrent) has shapes that do not fit"),
    ("missing_tensor", "it holds other tensors than this model's cache (1.v)"),
    ("longer", "its layer 1 (attention) has shapes that do not fit 28 positions"),
    ("unreadable", "its metadata is unreadable"),
    ("checkpoint_at_0", "its lengths do not fit (27, 0)"),
])
def test_a_recurrent_snapshot_that_does_not_fit_is_refused_in_one_line(
        recurrent_model: Any, how: str, says: str) -> None:
    """Bytes that pass the shelf's checksum but do not fit this model's cache: refused whole
    (the ledger drops the file with this line and the turn runs cold)."""
    import json

    from safetensors.torch import load, save

    from engine.runtimes.torch.prefix_cache import TorchKvStore, snapshot_meta

    store = TorchKvStore(recurrent_model.config)
    payload = store.export(*_recurrent_cache(recurrent_model)[:2])
    assert payload is not None
    data = bytes(payload())
    tensors, meta = load(data), snapshot_meta(data)
    if how == "first_format":  # the format before this one: keys and values, no metadata
        data = save({name: t for name, t in tensors.items() if name.startswith("1.")})
    else:
        if how == "other_layers":
            meta["layers"] = json.dumps(["conv", "conv"])
        elif how == "checkpoint_state":
            tensors["checkpoint.0.rec0"] = tensors["checkpoint.0.rec0"][:, :1].contiguous()
        elif how == "missing_tensor":
            del tensors["1.v"]
        elif how == "longer":
            meta["length"] = str(int(meta["length"]) + 1)
        elif how == "unreadable":
            meta["checkpoint"] = "soon"
        elif how == "checkpoint_at_0":
            meta["checkpoint"] = "0"
        data = save(tensors, metadata=meta)
    with pytest.raises(ValueError) as err:
        store.restore(data)
    assert says in str(err.value) and "\n" not in str(err.value)


# ----- llama.cpp, each start in its own process -------------------------------------------------
def _llama_start(shelf: str, conv: str, messages: list[ChatMessage], cold_too: bool) -> dict:
    with Engine(snapshot_dir=Path(shelf)) as engine:
        engine.load_model_sync("default", engine="llama.cpp")
        warm = _turn(engine, conv, messages)
        cold = _turn(engine, "cold", messages, reuse_cache=False) if cold_too else None
    m = warm.metrics
    return {"message": warm.as_message(), "reason": m.cache_miss_reason,
            "restored": m.restored_tokens, "cached": m.cached_tokens,
            "fed": m.prompt_tokens + len(warm.token_ids) - 1,
            "ids": warm.token_ids, "cold": cold.token_ids if cold else None}


@needs_llama_cpp
@pytest.mark.timeout(2 * CHILD_TIMEOUT_S + 60)
def test_llama_cpp_resumes_a_chat_from_disk_in_a_new_process(tmp_path: Path) -> None:
    shelf = str(tmp_path / "kv")
    first = run_in_child(_llama_start, shelf, "chat", FIRST, False)
    assert first["reason"] == "first_turn"
    second = [*FIRST, first["message"], ChatMessage("user", "And what about the storms?")]
    out = run_in_child(_llama_start, shelf, "chat", second, True)
    assert out["reason"] == "restored_from_disk"
    assert out["restored"] == out["cached"] == first["fed"]
    assert out["ids"] == out["cold"]


# ----- what the user sees ---------------------------------------------------------------------
def test_the_hud_says_what_came_from_disk_and_what_reading_it_would_cost() -> None:
    from engine.metrics import RequestMetrics
    from ui.hud.model import Breakdown, advise

    fields = {name: 0 for name in RequestMetrics.__dataclass_fields__} | {
        "prefill_complete": True, "prompt_tokens_known": True, "cached_tokens_known": True}
    m = RequestMetrics(**{**fields, "itl_s": [], "queue_s": 0.01, "prefill_s": 0.5,
                          "ttft_s": 0.52, "e2e_s": 0.6, "decode_s": 0.08, "prompt_tokens": 6_100,
                          "cached_tokens": 6_000, "prefilled_tokens": 100, "output_tokens": 5,
                          "cache_miss_reason": "restored_from_disk", "restored_tokens": 6_000,
                          "restored_bytes": 1 << 27, "restore_s": 0.2})
    b = Breakdown.from_metrics(m)
    assert b.prefill_detail() == ("6,100 prompt tokens, 6,000 cached "
                                  "(6,000 restored from disk in 200.0 ms)")
    # no forecast of a cold read: no figure (this reply's 100 tail tokens at 3.0 ms each would
    # claim 18 s; a tail token at depth 6,000 costs several times a cold read's average)
    assert advise(b).startswith("6,000 tokens restored from disk in 200 ms. Prefill owns 83% "
                                "(100 new prompt tokens x 3.0 ms")
    b.cold_prefill_s = 14.0  # the window's forecast of reading all 6,100 tokens
    assert advise(b).startswith("6,000 tokens restored from disk in 200 ms; reading them would "
                                "take ~14 s. Prefill owns 83%")


def test_the_picker_shows_the_space_saved_chats_take_and_clears_it(
        qtbot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.model_files import kv_snapshot_dir
    from ui.model_picker import ModelPickerDialog

    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path / "cache"))
    shelf = KvShelf(kv_snapshot_dir(), "k" * 24)
    for conv in ("a", "b"):
        shelf.put(conv, [1, 2], lambda: b"x" * 3_000_000)
    assert shelf.flush(10)
    shelf.close(10)
    answers: list[bool] = []
    monkeypatch.setattr("ui.saved_caches.confirm", lambda *_a: answers.pop(0))
    dialog = ModelPickerDialog()
    qtbot.addWidget(dialog)
    line = dialog.saved_caches
    assert line.label.text() == "Chats saved for a fast resume: 6 MB (2)"
    answers.append(False)
    line.clear.click()
    assert len(list(kv_snapshot_dir().rglob(f"*{SUFFIX}"))) == 2
    answers.append(True)
    line.clear.click()
    assert not list(kv_snapshot_dir().rglob(f"*{SUFFIX}"))
    assert line.label.text() == "Chats saved for a fast resume: none yet · 6 MB freed"
    assert not line.clear.isEnabled()


def test_two_instances_writing_one_chat_never_leave_a_torn_file(tmp_path: Path) -> None:
    """Two app instances (two shelves on one folder) writing the same chat at once: every
    read finds one whole snapshot or the other, never a mix (temporary file, then rename)."""
    import threading

    shelves = [KvShelf(tmp_path, "k" * 24) for _ in range(2)]
    payloads = [bytes([i + 1]) * 200_000 for i in range(2)]
    stop = threading.Event()
    seen: list[bytes | None] = []

    def read() -> None:
        while not stop.is_set():
            found = shelves[0].find("chat")
            if found is not None:
                seen.append(shelves[0].load(found))

    reader = threading.Thread(target=read)
    reader.start()
    for round_ in range(20):
        for shelf, payload in zip(shelves, payloads, strict=True):
            shelf.put("chat", [round_, 1, 2], lambda payload=payload: payload)
    for shelf in shelves:
        assert shelf.flush(30)
    stop.set()
    reader.join()
    assert seen and all(data in payloads for data in seen)  # None: a torn file, dropped
    assert not list(tmp_path.rglob("*.tmp"))
    for shelf in shelves:
        shelf.close(10)


def test_a_snapshot_is_taken_only_when_the_engine_asks_while_idle(tmp_path: Path) -> None:
    """Ending a reply copies nothing out (a streaming neighbour would wait for it): the chat is
    marked, and shelve_one, which the engine calls only while idle, takes it, once per change."""
    from engine.core.ledger import KvLedger
    from tests.support.fake_runtime import FakeKvStore, FakeNet

    exports: list[int] = []

    class CountingStore(FakeKvStore):
        def export(self, handle, checkpoint):  # type: ignore[no-untyped-def]
            exports.append(len(handle.states))
            return super().export(handle, checkpoint)

    pool: KvLedger = KvLedger(CountingStore(), budget_bytes=1 << 20)
    pool.shelf = KvShelf(tmp_path, "k" * 24)
    net = FakeNet(50)
    for conv in ("chat", "anon-7", "chat~alt1"):  # one chat; a one-off and an alternative
        lease = pool.acquire(conv, list(range(3, 13)))
        net.feed(lease.cache, list(range(3, 12)))
        lease.ids.extend(range(3, 12))
        pool.release(lease)
    assert exports == []
    assert pool.shelve_one() and exports == [9]
    assert not pool.shelve_one()  # nothing new: no second copy
    pool.shelf.close(10)
