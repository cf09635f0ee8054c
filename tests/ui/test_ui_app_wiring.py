"""The window as the app wires it (app.gui's factories: a BackendRouter over the local engine):
what users run is what these tests drive."""

from __future__ import annotations

from engine import PrefillStarted
from engine.backends import BackendRouter
from ui.main_window import MainWindow

WAIT_MS = 30_000


def test_the_window_runs_on_the_apps_router(make_window) -> None:
    window = make_window()
    assert isinstance(window.engine, BackendRouter)
    assert window.engine.capabilities.shared_prefill_alternatives


def test_times_two_after_a_cached_turn_shares_one_prefill_and_the_chats_cache(
    qtbot, make_window
) -> None:
    """The issue's case: a chat turn, then "× 2" and Send. Both alternatives come from one
    prefill that reused the chat's cached prefix; neither waits behind the other's prefill."""
    window: MainWindow = make_window()
    window.controls.temperature.setValue(80)  # 0.80: sampled alternatives
    window.controls.max_tokens.setValue(8)
    with qtbot.waitSignal(window.sig_reply_finished, timeout=WAIT_MS):
        assert window.send("Hello there, how are you today?")

    window.composer.alternatives.setValue(2)
    prefills: list[PrefillStarted] = []
    window.bridge.sig_prefill_started.connect(prefills.append)
    with qtbot.waitSignal(window.sig_alternatives_ready, timeout=WAIT_MS):
        assert window.send("Tell me more about that.")

    assert len(prefills) == 2
    first, second = sorted(prefills, key=lambda p: p.request_id)
    assert first.t_ns == second.t_ns  # a single prefill, started once for both
    assert 0 < first.cached_tokens < first.prompt_tokens  # the chat's cache, plus the new turn
    assert second.cached_tokens == second.prompt_tokens  # nothing of its own to compute
    results = window.session.alternative_sets[window.conversation_id].results
    metrics = [results[i].metrics for i in (0, 1)]
    assert all(m.cached_tokens > 0 for m in metrics)
    assert metrics[0].prefill_s == metrics[1].prefill_s
    hud = [window.hud.model.replies[p.request_id] for p in (first, second)]
    assert all(r.cached_tokens > 0 for r in hud)  # what the HUD shows
