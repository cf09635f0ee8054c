"""Prediction against reality in the window (ui/speed_figures.py): after a model's first
replies the model picker shows what they measured beside the speed predicted for this computer,
and the HUD's roofline says the prediction beside each reply's figures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.tools.calibrate import DevicePeaks
from engine.tools.speed import MeasuredSpeeds
from tests.support.speed import install_speeds
from tests.support.window_helpers import greedy, send_and_wait

QUESTION = ("Here is a longer question, so that the prompt has a few dozen tokens to read: "
            "what do the layers of a computer have to do with the distance to its memory?")


@pytest.fixture
def measured_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache dir holding a made-up measurement of this computer (both engines)."""
    cache = tmp_path / "speed-cache"
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(cache))
    install_speeds()
    return cache


def test_replies_measured_show_beside_the_prediction_in_the_picker_and_the_hud(
        qtbot, make_window, measured_machine: Path) -> None:
    window = make_window()
    info = window.model_info
    assert info is not None and info.source == "folder"
    picker = window.loads.picker()
    qtbot.addWidget(picker)
    before = picker.speed_label.text()
    assert before.startswith(f"Speed here ({info.engine}): predicted ~")
    assert "Its replies will show what they measure" in before
    greedy(window, 12)
    first = send_and_wait(qtbot, window, QUESTION)
    assert first.metrics.output_tokens >= 8 and first.metrics.prefilled_tokens >= 32
    send_and_wait(qtbot, window, "And again, in other words?")
    measured = MeasuredSpeeds().get(info.path, info.engine)
    assert measured is not None and measured.replies == 2
    picker = window.loads.picker()
    qtbot.addWidget(picker)
    text = picker.speed_label.text()
    assert re.search(r"Replies measured over 2 replies: [\d,.]+ tok/s, prompts read at "
                     r"[\d,.]+ tok/s \(~\d+ tokens\); decode predicted ~[\d,.]+ tok/s, "
                     r"measured [\d,.]+ \(x\d+\.\d\d\); prompts \(~\d+ tokens\) predicted "
                     r"~[\d,.]+ tok/s, measured [\d,.]+ \(x\d+\.\d\d\)\.$", text), text
    # The HUD's roofline: the same prediction beside the reply it draws.
    hud = window.hud
    hud.set_device_peaks(DevicePeaks("cpu: test", 20.0, 0.1, "calibrated (cached)"))
    hud.export_plot_png("roofline", measured_machine / "roofline.png")  # drawn afresh
    caption = hud.panels["roofline"].caption.text()
    assert re.search(r"Predicted on this computer \(from its one measurement\): decode "
                     r"~[\d,]+ tok/s, this reply [\d,]+ \(x\d+\.\d\d\); its prompt \(\d+ "
                     r"tokens read\) ~[\d.]+ s, took [\d.]+ s \(x\d+\.\d\d\)\.", caption), caption


def test_a_reply_beside_another_is_not_kept(qtbot, make_window,
                                            measured_machine: Path) -> None:
    """Two chats streaming at once share the steps: neither decode rate is the model's."""
    window = make_window()
    info = window.model_info
    greedy(window, 12)
    figures = window.speed_figures
    kept: list[str] = []
    add = figures.store.add
    figures.store.add = lambda path, engine, metrics: (kept.append(engine),
                                                       add(path, engine, metrics))
    with qtbot.waitSignals([window.sig_reply_finished] * 2, timeout=30_000):
        assert window.send(QUESTION)
        window.new_chat()
        assert window.send(QUESTION)
    assert kept == [] and MeasuredSpeeds().get(info.path, info.engine) is None
    window.new_chat()
    send_and_wait(qtbot, window, QUESTION)  # alone: kept
    assert kept == [info.engine]


def test_the_hud_hears_the_prediction_once_this_computer_is_measured(
        qtbot, make_window, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path / "not-measured"))
    window = make_window()
    assert window.hud.model_speed is None  # nothing measured: nothing predicted
    install_speeds()  # measured meanwhile (in the browser)
    greedy(window, 4)
    send_and_wait(qtbot, window, "Hello")
    assert window.hud.model_speed is not None
    assert window.hud.model_speed[1] == window.model_info.identity
