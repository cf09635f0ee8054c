"""The wait forecast before sending: what the ledger says is cached must be what the turn then
finds, and the prefill cost line must give back the costs it was fitted on."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import ChatMessage, GenerationRequest, SamplingParams
from engine.forecast import PrefillCost, forecast_text
from engine.protocol import PrefixPeek
from engine.worker import Engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SYSTEM = ChatMessage("system", "You are a helpful assistant who answers briefly.")


def _request(conv: str | None, messages: list[ChatMessage]) -> GenerationRequest:
    return GenerationRequest(list(messages), GREEDY, conversation_id=conv)


def test_the_forecast_counts_what_the_turn_then_finds_cached(tiny_engine: Engine) -> None:
    first = [SYSTEM, ChatMessage("user", "Hello there, how are you?")]
    peek = tiny_engine.peek_prefix(_request("c", first))
    assert peek is not None and peek.cached_tokens == 0 and not peek.from_disk
    r1 = tiny_engine.submit(_request("c", first)).wait(60)
    assert peek.prompt_tokens == r1.metrics.prompt_tokens
    second = [*first, r1.as_message(), ChatMessage("user", "And then?")]
    for conv, messages in (("c", second), ("new", [SYSTEM, ChatMessage("user", "Hi")])):
        peek = tiny_engine.peek_prefix(_request(conv, messages))
        result = tiny_engine.submit(_request(conv, messages)).wait(60)
        assert peek is not None
        assert (peek.prompt_tokens, peek.cached_tokens) == (result.metrics.prompt_tokens,
                                                            result.metrics.cached_tokens)
        assert peek.cached_tokens > 0  # its own prefix; the other chat's system prompt


def test_the_forecast_says_a_chat_will_come_back_from_disk(tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    first = [SYSTEM, ChatMessage("user", "Tell me a story about a cat.")]
    with Engine(snapshot_dir=tmp_path) as engine:
        engine.load_model_sync(str(tiny_model_dir), kernel="fp32-eager")
        r1 = engine.submit(_request("c", first)).wait(60)
    second = [*first, r1.as_message(), ChatMessage("user", "Shorter, please.")]
    with Engine(snapshot_dir=tmp_path) as engine:
        engine.load_model_sync(str(tiny_model_dir), kernel="fp32-eager")
        peek = engine.peek_prefix(_request("c", second))
        result = engine.submit(_request("c", second)).wait(60)
    assert peek is not None and peek.from_disk
    assert peek.cached_tokens == result.metrics.restored_tokens > 0


def test_no_model_means_no_forecast() -> None:
    with Engine() as engine:
        assert engine.peek_prefix(_request("c", [ChatMessage("user", "Hi")])) is None


def test_the_prefill_cost_line_gives_back_the_costs_it_was_fitted_on() -> None:
    a, b, d = 2e-3, 1e-6, 0.05  # seconds per token, per token per position, per prefill

    def cost(c: int, p: int) -> float:
        return d + a * (p - c) + b * (p * p - c * c) / 2

    line = PrefillCost()
    seen = [(0, 500), (0, 2_000), (1_500, 1_600)]
    for c, p in seen[:2]:
        line.add(c, p, cost(c, p))
    assert line.seconds(0, 1_000) is None  # two replies are too few to trust a line
    line.add(*seen[2], cost(*seen[2]))
    for c, p in ((0, 6_000), (5_000, 5_200), (100, 300)):
        predicted = line.seconds(c, p)
        assert predicted == pytest.approx(cost(c, p), rel=1e-6)
    line.clear()
    assert line.seconds(0, 1_000) is None


def test_a_prefill_that_read_a_few_tokens_is_not_an_observation() -> None:
    line = PrefillCost()
    for p in (3, 4, 5, 6):
        line.add(0, p, 0.01 * p)
    assert line.seconds(0, 100) is None


def test_the_forecast_line_reads_as_the_issue_says() -> None:
    peek = PrefixPeek(prompt_tokens=7_184, cached_tokens=5_980)
    assert forecast_text(peek, 9.2) == (
        "~1,204 new tokens · ~9.2 s to first token · 5,980 from cache")
    assert forecast_text(PrefixPeek(40, 0), None) == "~40 new tokens"
    assert forecast_text(PrefixPeek(6_000, 5_990, from_disk=True), 0.25) == (
        "~10 new tokens · ~250 ms to first token · 5,990 from disk")


# ----- in the window ----------------------------------------------------------------------------
def test_the_window_forecasts_the_wait_as_the_user_types_and_keeps_it_for_the_hud(
        qtbot, make_window) -> None:
    window = make_window()
    composer = window.composer
    composer.set_text("Hello there, how are you?")
    qtbot.waitUntil(lambda: composer.forecast.text().startswith("~"), timeout=5_000)
    assert "new tokens" in composer.forecast.text()
    assert "to first token" not in composer.forecast.text()  # no prefill seen yet: no time
    window.controls.max_tokens.setValue(8)  # the tiny model's context is short
    for i in range(3):  # prompts of different lengths, each a new chat: the cost line
        window.new_chat()
        composer.set_text("Tell me more. " * (4 * i + 3))
        assert window.send(composer.text())
        qtbot.waitUntil(lambda: not window.session.running(window.session.conversation_id),
                        timeout=30_000)
    composer.set_text("And one more question about the weather tomorrow?")
    qtbot.waitUntil(lambda: "to first token" in composer.forecast.text(), timeout=5_000)
    assert "from cache" in composer.forecast.text()  # the chat so far
    expected, cold = window.aids.forecast.seconds, window.aids.forecast.cold_seconds
    assert expected is not None and expected > 0
    assert window.send(composer.text())
    qtbot.waitUntil(lambda: not window.session.running(window.session.conversation_id),
                    timeout=30_000)
    reply = window.hud.model.latest()
    assert reply is not None and reply.forecast_ttft_s == expected
    assert cold is not None and cold > expected and reply.cold_prefill_s == cold
    assert window.hud.advice_text().startswith("Forecast ~")
    composer.clear()
    qtbot.waitUntil(lambda: not composer.forecast.isVisible(), timeout=5_000)


def test_noise_no_line_explains_falls_back_to_the_plain_rate() -> None:
    line = PrefillCost()
    for c, p, s in ((0, 100, 0.5), (0, 200, 0.4), (0, 300, 0.9)):  # no line with a, b, d >= 0
        line.add(c, p, s)
    assert line.seconds(0, 600) == pytest.approx(600 * 1.8 / 600)
