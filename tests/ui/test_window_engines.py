"""The chat window on both engines, as users get them: torch (a GPU, or a Hugging Face folder)
and llama.cpp (what a user without a GPU runs, on the bundled GGUF).

The scenarios (tests/support/window_scenarios.py) drive a window built by the app's own factory and
return what they saw; the assertions here are the same for both engines. On torch the window
runs in this process on the tiny random model (conftest's make_window). On llama.cpp every
scenario runs in one spawned child (run_in_child: a native crash is a failed test naming the
signal), with its own offscreen QApplication, one engine on the bundled SmolLM2 GGUF and a
fresh window per scenario; the child reports each scenario's dict (or its traceback) and the
Qt warnings it saw.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.child import CHILD_TIMEOUT_S, needs_llama_cpp, run_in_child
from tests.support.window_scenarios import SCENARIOS, Rig
from ui.store import DONE, STOPPED, fmt_share

pytestmark = pytest.mark.timeout(CHILD_TIMEOUT_S + 60)

TORCH, LLAMA_CPP = "torch", "llama.cpp"
ENGINES = [TORCH, pytest.param(LLAMA_CPP, marks=needs_llama_cpp)]
TORCH_CHUNK = 32  # PHASEWISE_PREFILL_CHUNK for the tiny model: its 256-token context holds 5
LLAMA_CHUNK = 512  # the llama.cpp engine's batch (engine/runtimes/llamacpp/model.py BATCH_TOKENS)
LLAMA_STOP_AT = 600  # prompt tokens read when Stop comes: past the first whole chunk
# Waits that fail only when something hangs: SmolLM2 on two shared cores reads a prompt at
# ~100 tok/s when other work runs beside it.
LLAMA_WAIT_MS = 180_000

# Several prefill chunks on each model, with room left for a short reply.
TORCH_PROMPT = " ".join(["the cat sat on the mat"] * 9)
LLAMA_PROMPT = "Summarise these notes.\n" + "\n".join(
    f"Note {i}: the river rose by {i % 7} inches near the old mill on day {i}."
    for i in range(40))


# ----- llama.cpp: every scenario in one child ---------------------------------------------------
def _llama_window_child(names: list[str]) -> dict[str, Any]:
    """Runs in a spawned process: an offscreen QApplication, the engine on the bundled GGUF
    (llama.cpp), and each scenario on a fresh window; {name: {"ok": dict} | {"error": str}},
    plus the Qt warnings seen under "qt_warnings"."""
    with tempfile.TemporaryDirectory(prefix="phasewise-window-") as tmp:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
        os.environ["PHASEWISE_CACHE_DIR"] = str(Path(tmp) / "cache")
        os.environ["PHASEWISE_DATA_DIR"] = str(Path(tmp) / "data")
        from PySide6.QtCore import QSettings, QtMsgType, qInstallMessageHandler
        from PySide6.QtWidgets import QApplication
        from pytestqt.qt_compat import qt_api
        from pytestqt.qtbot import QtBot

        from app.gui import build_backend, build_window
        from engine.worker import Engine
        from ui.store import ChatStore

        app = QApplication.instance() or QApplication(["phasewise-test"])
        warnings: list[str] = []

        def on_message(kind: QtMsgType, _context: object, message: str) -> None:
            if kind != QtMsgType.QtDebugMsg:
                warnings.append(message)

        qInstallMessageHandler(on_message)
        # pytest-qt's waits, outside pytest (its plugin would set the binding; the ini lookup
        # is all a QtBot asks of its request)
        qt_api.set_qt_api("pyside6")
        bot = QtBot(SimpleNamespace(config=SimpleNamespace(getini=lambda _name: "")))
        out: dict[str, Any] = {}
        with Engine() as engine:
            engine.load_model_sync("default", engine="llama.cpp")
            router = build_backend(engine)
            for name in names:
                store = ChatStore(Path(tmp) / f"{name}.sqlite3")
                settings = QSettings(str(Path(tmp) / f"{name}.ini"), QSettings.Format.IniFormat)
                window = build_window(router, store, settings, hud_calibrate=False)
                try:
                    rig = Rig(window, engine, LLAMA_PROMPT, LLAMA_CHUNK, LLAMA_STOP_AT,
                              LLAMA_WAIT_MS)
                    out[name] = {"ok": SCENARIOS[name](bot, rig)}
                except Exception:
                    out[name] = {"error": traceback.format_exc()}
                finally:
                    window.close()
                    window.deleteLater()
                    app.processEvents()
                    store.close()
        out["qt_warnings"] = warnings
        return out


@pytest.fixture(scope="module")
def llama_window() -> dict[str, Any]:
    return run_in_child(_llama_window_child, list(SCENARIOS))  # type: ignore[no-any-return]


# ----- torch: in this process, on the tiny model --------------------------------------------------
@pytest.fixture(params=ENGINES)
def observe(request: pytest.FixtureRequest) -> Callable[[str], dict[str, Any]]:
    """observe(scenario): what the scenario saw on this engine's window."""
    engine = request.param
    if engine == LLAMA_CPP:
        results = request.getfixturevalue("llama_window")

        def from_child(name: str) -> dict[str, Any]:
            assert results["qt_warnings"] == [], "Qt warnings in the llama.cpp window"
            outcome = results[name]
            if "error" in outcome:
                pytest.fail(f"{name} failed in the llama.cpp child:\n{outcome['error']}")
            assert outcome["ok"].get("engine", LLAMA_CPP) == LLAMA_CPP
            return outcome["ok"]  # type: ignore[no-any-return]

        return from_child
    request.getfixturevalue("monkeypatch").setenv("PHASEWISE_PREFILL_CHUNK", str(TORCH_CHUNK))
    bot = request.getfixturevalue("qtbot")
    make_window = request.getfixturevalue("make_window")
    tiny_engine = request.getfixturevalue("tiny_engine")

    def here(name: str) -> dict[str, Any]:
        rig = Rig(make_window(), tiny_engine, TORCH_PROMPT, TORCH_CHUNK, 2 * TORCH_CHUNK)
        out = SCENARIOS[name](bot, rig)
        assert out.get("engine", TORCH) == TORCH
        return out

    return here


# ----- the tests --------------------------------------------------------------------------------
def test_a_reply_streams_onto_the_screen_and_is_saved(observe) -> None:
    out = observe("send_and_stream")
    n = out["output_tokens"]
    assert 1 <= n <= 24 and out["text"]
    assert out["finish"] in ("stop", "length")
    assert out["painted"] == list(range(n))  # every token reached the screen, in order
    assert 1 <= out["inserts"] <= n
    assert out["roles"] == ["user", "assistant"]
    assert out["saved_text"] == out["text"]
    assert out["saved_status"] == (DONE if out["finish"] == "stop" else "length")
    assert out["saved_output_tokens"] == n
    assert out["composer"] == ""


def test_the_window_runs_the_engine_it_says(observe, request) -> None:
    out = observe("send_and_stream")
    engine = request.node.callspec.params["observe"]
    assert out["engine"] == out["window_engine"] == engine


def test_esc_stops_a_streaming_reply_within_one_step(observe) -> None:
    out = observe("stop_mid_reply")
    assert out["button_while_streaming"] == "Stop" and out["button_after"] == "Send"
    assert out["finish"] == "cancelled"
    assert out["output_tokens"] <= out["tokens_at_stop"] + 1  # at most the step in flight
    assert out["saved_status"] == STOPPED and out["saved_matches"]


@pytest.mark.parametrize("scenario", ["stop_in_prefill_then_regenerate",
                                      "stop_in_prefill_beside_a_stream_then_regenerate"])
def test_regenerate_after_stop_inside_a_prefill_keeps_what_was_read(observe, scenario) -> None:
    """Issue 31 item 4: what was read before Stop stays cached, alone or beside a stream."""
    out = observe(scenario)
    prompt, cached_first = out["first"]
    assert out["prompt_total"] == prompt - cached_first
    assert out["stopped_finish"] == "cancelled" and out["stopped_output_tokens"] == 0
    assert out["stopped_status"] == STOPPED
    assert out["read_at_stop"] > out["chunk"]  # Stop came after at least one whole chunk
    again_prompt, again_cached, reason = out["again"]
    assert again_prompt == prompt  # the same history, the stopped (empty) reply left out
    assert again_cached == out["again_metrics_cached"]
    # What was read before Stop (less the chunk Stop cut short) is not read again.
    assert again_cached - cached_first >= out["read_at_stop"] - out["chunk"]
    assert reason == "none"
    assert out["again_finish"] in ("stop", "length") and out["again_output_tokens"] >= 1
    assert out["roles"] == ["user", "assistant"]


@pytest.mark.parametrize("scenario", ["stop_in_prefill_then_regenerate",
                                      "stop_in_prefill_beside_a_stream_then_regenerate"])
def test_a_reply_stopped_inside_its_prefill_shows_what_it_read(observe, scenario) -> None:
    """Issue 31 item 4: the HUD and the line under the reply say how much of the prompt was
    read before Stop (exactly what Regenerate then finds cached), never a TTFT, a "p50 0.0
    ms", every prompt token as read, or only the share that was cached before."""
    out = observe(scenario)
    prompt, cached = out["first"]
    new, read = prompt - cached, out["stopped_read"]
    assert not out["stopped_complete"] and 0 < read < new
    assert out["again"][1] - cached == read  # what it says it read is what was kept
    shown = out["shown"]
    words = f"{read:,} of {new:,} new prompt tokens read before Stop"
    assert words in shown["advice"] and words in shown["breakdown"]
    assert f"{new:,} new prompt tokens," not in shown["advice"]
    assert shown["ttft"] == shown["itl"] == "–"
    assert "no TTFT" in shown["ttft_caption"] and "0.0 ms" not in shown["ttft_caption"]
    assert "0.0 ms" not in shown["breakdown"] and "0.0 tok/s" not in shown["throughput_caption"]
    assert "stopped before its first token" in shown["itl_caption"]
    assert f"{new - read:,} not read (stopped)" in shown["cache_caption"]
    line = f"{fmt_share((cached + read) / prompt)} of the prompt read before Stop"
    assert line in shown["transcript"]


def test_two_chats_stream_at_once_and_both_are_saved(observe) -> None:
    out = observe("two_chats_at_once")
    assert out["button_a_while_b_streams"] == "Send"  # A is idle while B writes
    assert out["b_running_after_a"], "B still streams after A's second reply ended"
    assert out["b_tokens_around_a2"]  # one batch: B's tokens came between A's
    assert [role for role, _s in out["saved"]["a"]] == ["user", "assistant"] * 2
    assert [role for role, _s in out["saved"]["b"]] == ["user", "assistant"]
    assert {s for chat in ("a", "b") for role, s in out["saved"][chat] if role == "assistant"} \
        <= {DONE, "length"}
    assert out["texts_saved"] == [True, True]


def test_the_hud_speaks_for_the_chat_on_screen(observe) -> None:
    """Issue 31 item 3: with a long reply streaming in chat B, opening chat A shows A's numbers
    in every panel, not B's beside A's."""
    out = observe("two_chats_at_once")
    chat_a, chat_b = out["chat_a"], out["chat_b"]

    def shows(view: dict[str, Any], request_id: str, chat: str, head: dict[str, str]) -> None:
        assert (view["request_id"], view["chat"]) == (request_id, chat)
        assert view["ttft"] == head["ttft"] and view["decode"] == head["decode"]
        assert view["context"].startswith(head["context"])

    shows(out["a_open"], out["a1"], chat_a, out["a1_headline"])  # B streams meanwhile
    shows(out["a_live"], out["a2"], chat_a, out["a2_headline"])
    shows(out["a_after_b"], out["a2"], chat_a, out["a2_headline"])  # B ended: still A
    shows(out["b_open"], out["b"], chat_b, out["b_headline"])


def test_alternatives_stream_at_once_from_one_prefill_and_one_is_kept(observe) -> None:
    out = observe("alternatives")
    assert out["count"] == 3 and out["max_live_streams"] == 3
    prefilled = out["prefilled"]
    assert prefilled[:2] == [0, 0] and prefilled[2] > 0  # one shared prefill
    assert out["labels_shown"] and out["refused_before_pick"]
    assert out["kept_roles"] == ["user", "assistant"] and out["kept_text"]
    assert 0 < out["next_cached"] < out["next_prompt"]  # the next turn builds on the kept one
    assert out["next_miss"] == "none"
    assert out["leftover_alternative_caches"] == []
