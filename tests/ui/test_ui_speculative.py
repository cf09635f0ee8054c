"""Speculative decoding from the window: the Advanced modes, picking a draft model, failures.

The tiny model drafts for itself (same vocabulary); greedy, it repeats its last token, so
prompt lookup and the self-draft are both accepted often: the HUD has numbers to show.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import GenerationResult
from tests.support.window_helpers import WAIT_MS, greedy, send_and_wait
from ui.main_window import MainWindow
from ui.model_picker import ModelChoice


class FakePicker:
    """Stands in for ModelPickerDialog: 'accepts' with a fixed choice, or cancels."""

    choice_to_return: ModelChoice | None = None
    opened = 0

    def __init__(self, _parent: object = None, **_options: object) -> None:
        FakePicker.opened += 1

    def setWindowTitle(self, _title: str) -> None:
        pass

    def exec(self) -> bool:
        return self.choice_to_return is not None

    def choice(self) -> ModelChoice:
        assert self.choice_to_return is not None
        return self.choice_to_return


@pytest.fixture
def picker(monkeypatch) -> type[FakePicker]:
    monkeypatch.setattr("ui.model_loads.ModelPickerDialog", FakePicker)
    FakePicker.choice_to_return, FakePicker.opened = None, 0
    return FakePicker


def greedy_reply(qtbot, window: MainWindow, max_tokens: int = 24) -> GenerationResult:
    greedy(window, max_tokens)
    result = send_and_wait(qtbot, window, "Say something, please.")
    window.hud.flush()
    return result


def set_mode(window: MainWindow, mode: str | None) -> None:
    combo = window.controls.speculative
    combo.setCurrentIndex(combo.findData(mode))


def test_prompt_lookup_runs_and_the_hud_says_how_it_did(qtbot, make_window) -> None:
    window = make_window()
    set_mode(window, "ngram")

    result = greedy_reply(qtbot, window)

    assert result.speculative == "ngram" and result.spec_proposed > 0
    caption = window.hud.panels["breakdown"].caption.text()
    assert "torch engine, kernel fp32-eager" in caption  # the engine is named, as in the
    assert "torch on cpu" in window.status.model_label.text()  # status bar and the export
    assert (f"speculative (ngram): {result.spec_accepted:,} of {result.spec_proposed:,} "
            "drafted tokens accepted") in caption
    row = window.hud.model.reply_rows()[-1]  # the export says it too
    assert (row["speculative"], row["spec_accepted"]) == ("ngram", result.spec_accepted)
    assert (row["engine"], row["kernel"]) == ("torch", "fp32-eager")
    # Set before the first reply: the reply's settings, not a change marker on the plots.
    assert row["setting_speculative"] == "ngram"
    assert window.hud.panels["throughput"].marker_labels() == []


def test_off_decodes_plainly(qtbot, make_window) -> None:
    window = make_window()
    result = greedy_reply(qtbot, window)
    assert result.speculative is None and result.spec_proposed == 0
    assert "speculative" not in window.hud.panels["breakdown"].caption.text()


def test_choosing_a_draft_model_loads_it_and_replies_draft(qtbot, make_window, picker,
                                                           tiny_model_dir: Path) -> None:
    window = make_window()
    picker.choice_to_return = ModelChoice(str(tiny_model_dir), {"kernel": "fp32-eager"})
    with qtbot.waitSignal(window.bridge.sig_draft_changed, timeout=WAIT_MS):
        set_mode(window, "draft")  # no draft yet: the picker opens, the engine loads it
    assert picker.opened == 1
    name = window.model_info.name  # it drafts for itself
    assert window.controls.draft_label.text() == name
    assert window.status.load_label.text() == f"Draft model {name} (fp32-eager)"
    assert window.controls.speculative_mode() == "draft"

    result = greedy_reply(qtbot, window)

    assert result.speculative == "draft" and result.spec_accepted > 0
    assert "speculative (draft)" in window.hud.panels["breakdown"].caption.text()
    set_mode(window, None)
    set_mode(window, "draft")  # a draft is loaded: no picker this time
    assert picker.opened == 1


def test_a_draft_that_fails_to_load_says_why_and_falls_back_to_off(
        qtbot, make_window, picker, tmp_path: Path) -> None:
    window = make_window()
    picker.choice_to_return = ModelChoice(str(tmp_path / "no-such-model"), {})
    with qtbot.waitSignal(window.bridge.sig_draft_load_failed, timeout=WAIT_MS):
        set_mode(window, "draft")
    notice = window.notice_label.text()
    assert notice.startswith("Draft model not loaded: ") and "\n" not in notice
    assert window.controls.speculative_mode() is None
    assert window.model_info is not None  # the model itself is untouched
    assert greedy_reply(qtbot, window).speculative is None


def test_cancelling_the_picker_or_choosing_a_server_falls_back_to_off(
        make_window, picker) -> None:
    window = make_window()
    set_mode(window, "draft")  # picker cancelled
    assert window.controls.speculative_mode() is None
    picker.choice_to_return = ModelChoice("remote", {"base_url": "http://127.0.0.1:9/v1"})
    set_mode(window, "draft")
    assert window.controls.speculative_mode() is None
    assert "runs locally" in window.notice_label.text()


def test_sending_while_the_draft_still_loads_is_refused_with_a_reason(make_window) -> None:
    window = make_window()
    window.controls.speculative.blockSignals(True)  # as if the picker's load were running
    set_mode(window, "draft")
    window.controls.speculative.blockSignals(False)
    assert not window.send("Hello")
    assert "No draft model is loaded yet" in window.notice_label.text()


def test_regenerate_while_the_draft_still_loads_keeps_the_old_reply(qtbot, make_window
                                                                      ) -> None:
    window = make_window()
    old = greedy_reply(qtbot, window, 8)
    window.controls.speculative.blockSignals(True)
    set_mode(window, "draft")
    window.controls.speculative.blockSignals(False)
    reply_id = window.store.messages(window.conversation_id)[-1].id
    window.regenerate(reply_id)
    assert "No draft model is loaded yet" in window.notice_label.text()
    assert window.store.messages(window.conversation_id)[-1].content == old.text


def test_prompt_lookup_is_remembered_and_a_draft_is_not(make_window) -> None:
    window = make_window()
    set_mode(window, "ngram")
    window.close()
    assert make_window().controls.speculative_mode() == "ngram"
