"""Issue 20's first-hour findings in the HUD, the seed and Compare (items 1, 5, 7, 8, 9, 14).

HUD widgets are built and fed synthetic engine events as in test_hud_widget.py.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from PySide6.QtCore import QEvent, QPointF, Qt
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication, QDockWidget, QFileDialog, QLabel, QMainWindow

from engine import GenerationRequest, InvalidRequestError, SamplingParams
from engine.events import RequestFinished, TokenEmitted
from engine.worker import Engine
from tests.support.hud_events import MS, ReplySpec, reply_events
from tests.support.window_helpers import show_and_wait
from ui.compare import LOCAL, CompareDialog
from ui.hud import style
from ui.hud.model import SessionModel, advise
from ui.hud.panels import NO_HOVER, Panel, short_token
from ui.hud.widget import HudWidget


def feed(hud: HudWidget, events: list) -> None:
    for event in events:
        hud.on_engine_event(event)


def reply(rid: str, start_s: float, tokens: int = 40, **kw: object) -> list:
    return reply_events(ReplySpec(rid, int(start_s * 1000) * MS, 200, 0, tokens, **kw))


# ----- item 1: the seed ----------------------------------------------------------------------
@pytest.mark.parametrize("seed", [-1, 2**63, 99999999999999999999999])
def test_an_out_of_range_seed_is_a_one_line_request_error(seed: int) -> None:
    with pytest.raises(InvalidRequestError, match=r"^seed must be from 0 to 2\*\*63 - 1"):
        SamplingParams(seed=seed).validate()


def test_a_seed_that_is_not_a_whole_number_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="seed must be a whole number"):
        SamplingParams(seed="abc").validate()  # type: ignore[arg-type]


def test_alternatives_of_the_largest_seed_stay_in_range() -> None:
    top = 2**63 - 1
    request = GenerationRequest([], SamplingParams(seed=top))
    seeds = [alt.params.seed for alt in request.alternatives(3)]
    assert seeds == [top, 0, 1]
    for alt in request.alternatives(3):
        alt.params.validate()


# ----- item 7: hover, picker, live TTFT, stopped replies, advisor ------------------------------
def test_hover_readout_clears_when_the_pointer_leaves(qtbot, hud: HudWidget) -> None:
    feed(hud, reply("req-1", 2) + reply("req-2", 10))
    show_and_wait(qtbot, hud)
    hud.flush()
    panel: Panel = hud.panels["ttft"]
    vb = panel.plot.getPlotItem().vb
    panel._on_mouse_moved(vb.mapViewToScene(vb.mapToView(vb.boundingRect().center())))
    assert panel.readout.text().startswith("turn ")
    QApplication.sendEvent(panel.plot.viewport(), QEvent(QEvent.Type.Leave))
    assert panel.readout.text() == NO_HOVER
    panel._on_mouse_moved(vb.mapViewToScene(vb.mapToView(vb.boundingRect().center())))
    area = vb.sceneBoundingRect()
    panel._on_mouse_moved(QPointF(area.right() + 20, area.bottom() + 20))  # off the plot area
    assert panel.readout.text() == NO_HOVER


def test_reply_picker_names_chat_and_turn_not_internal_ids(hud: HudWidget) -> None:
    feed(hud, reply("req-7", 2) + reply("req-10.1", 10))
    hud.flush()
    items = [hud.reply_combo.itemText(i) for i in range(hud.reply_combo.count())]
    assert not any("req-" in item for item in items)
    assert items[1:] == ["Reply 1", "Reply 2 · alternative 2"]
    hud.name_reply("req-10.1", "Trip ideas", 3)
    assert hud.reply_combo.itemText(2) == "Trip ideas · turn 3 · alternative 2"


def test_picker_follows_a_new_reply_unless_the_user_pinned_one(hud: HudWidget) -> None:
    feed(hud, reply("req-1", 2) + reply("req-2", 10))
    hud.select_reply("req-1")  # e.g. the window showing a reply's stats: not a pin
    feed(hud, reply("req-3", 20)[:3])  # a new reply starts streaming
    assert hud.selected_reply().request_id == "req-3"
    assert hud.pin_label.isHidden()

    combo = hud.reply_combo
    combo.setCurrentIndex(combo.findData("req-1"))  # the user's own pick pins it
    combo.activated.emit(combo.currentIndex())
    feed(hud, reply("req-4", 40)[:3])
    hud.flush()
    assert hud.pinned and hud.selected_reply().request_id == "req-1"
    assert not hud.pin_label.isHidden()
    assert "Pinned to Reply 1; Reply 4 is newer" in hud.pin_label.text()

    combo.setCurrentIndex(0)
    combo.activated.emit(0)
    assert not hud.pinned and hud.pin_label.isHidden()
    assert hud.selected_reply().request_id == "req-4"


def test_a_live_ttft_replaces_waiting_for_a_reply(hud: HudWidget) -> None:
    events = reply("req-1", 2, tokens=30)
    first = next(i for i, e in enumerate(events) if isinstance(e, TokenEmitted))
    feed(hud, events[: first + 3])
    hud.flush()
    caption = hud.panels["ttft"].caption.text()
    assert "Waiting" not in caption
    assert caption.startswith("Reply #1: TTFT ") and "(live)" in caption
    assert hud._kpis["TTFT"].text() != "–"
    feed(hud, events[first + 3: first + 25])
    hud.flush()
    assert "tok/s now (live)" in hud.panels["throughput"].caption.text()


def test_a_reply_stopped_during_prefill_shows_dashes_not_zero(hud: HudWidget) -> None:
    events = reply("req-1", 2, tokens=0)
    finished = events[-1]
    assert isinstance(finished, RequestFinished)
    cancelled = dataclasses.replace(finished.result, finish_reason="cancelled", text="")
    feed(hud, [*events[:-1], dataclasses.replace(finished, result=cancelled)])
    hud.flush()
    assert hud._kpis["TTFT"].text() == "–"
    assert hud._kpis["ITL p50"].text() == "–"
    assert "0.0 ms" not in hud.panels["breakdown"].caption.text()
    assert "no TTFT" in hud.panels["ttft"].hover_text(1, 0)


def test_advisor_proposes_a_cap_only_for_a_long_finished_reply() -> None:
    model = SessionModel()
    live = reply("live", 0, tokens=30, itl_ms=40)  # about one second into a reply
    for event in live[:-1]:
        model.apply(event)
    assert model.replies["live"].breakdown().final is False
    assert "cap" not in advise(model.replies["live"].breakdown())
    model.apply(live[-1])  # finished at 30 tokens: too short to cap
    assert "cap" not in advise(model.replies["live"].breakdown())
    for event in reply("quick", 10, tokens=200, itl_ms=5):  # long, but 1 s in all
        model.apply(event)
    assert "cap" not in advise(model.replies["quick"].breakdown())
    for event in reply("long", 20, tokens=300, itl_ms=34):
        model.apply(event)
    assert "A cap of 100 tokens would save about 6.8 s" in advise(
        model.replies["long"].breakdown())


# ----- item 8: one marker layer ----------------------------------------------------------------
def test_settings_restored_before_the_first_reply_draw_no_marker(hud: HudWidget) -> None:
    for name, value in (("temperature", 0.7), ("top_p", 0.9), ("max_tokens", 512)):
        hud.mark_setting_change(name, value, 1_500 * MS)  # restore at start-up
    assert hud.model.markers == []
    assert all(not hud.panels[key].marker_labels() for key in ("throughput", "ttft", "cache"))
    assert hud.model.settings == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 512}


def test_rapid_changes_between_replies_collapse_into_one_marker(hud: HudWidget) -> None:
    hud.mark_setting_change("max_tokens", 512, 1_500 * MS)
    feed(hud, reply("req-1", 2, temperature=0.7))
    for i, t in enumerate(range(70, 100)):  # a slider drag: 30 values in a second
        hud.mark_setting_change("temperature", t / 100, (5_000 + i * 30) * MS)
    hud.mark_setting_change("max_tokens", 256, 6_000 * MS)
    assert hud.panels["throughput"].marker_labels() == ["temperature=0.99, max_tokens=256"]
    hud.mark_setting_change("temperature", 0.7, 6_100 * MS)  # dragged back: only max_tokens
    assert hud.panels["ttft"].marker_labels() == ["max_tokens=256"]
    hud.mark_setting_change("max_tokens", 512, 6_200 * MS)  # all back: no marker at all
    assert hud.panels["ttft"].marker_labels() == []
    hud.mark_setting_change("top_p", 0.5, 6_300 * MS)
    feed(hud, reply("req-2", 8, top_p=0.5))
    hud.mark_setting_change("top_p", 0.8, 15_000 * MS)  # after the next reply: a new marker
    assert hud.panels["ttft"].marker_labels() == ["top_p=0.5", "top_p=0.8"]


def visible_label_rects(panel: Panel) -> list:
    return [line.label.sceneBoundingRect() for _x, _t, line in panel._markers
            if line.label.isVisible()]


def test_marker_labels_never_overlap_on_screen_or_in_the_png(
        qtbot, hud: HudWidget, tmp_path: Path) -> None:
    show_and_wait(qtbot, hud)
    start = 2.0
    for n in range(8):  # short replies with a settings change after each
        feed(hud, reply(f"req-{n}", start, tokens=12))
        hud.mark_setting_change("temperature", 0.1 * (n + 1), int((start + 1) * 1000) * MS)
        start += 1.5
    hud.flush()
    QApplication.processEvents()  # the plots settle their ranges and label positions
    panel = hud.panels["throughput"]
    assert len(panel.marker_labels()) == 8
    shown = visible_label_rects(panel)
    assert 1 <= len(shown) < 8  # the newest always labelled, crowded older ones not
    assert panel.visible_marker_labels()[-1] == panel.marker_labels()[-1]
    for a, b in itertools.pairwise(shown):
        assert not a.intersects(b)
    for key in ("ttft",):  # a per-turn plot: no label runs off the left edge either
        area = hud.panels[key].plot.getPlotItem().vb.sceneBoundingRect()
        rects = visible_label_rects(hud.panels[key])
        assert all(r.left() >= area.left() - 1 for r in rects), (area, rects)
    vb = panel.plot.getPlotItem().vb
    x, text, _line = panel._markers[0]  # an unlabelled marker still reads out on hover
    panel._on_mouse_moved(vb.mapViewToScene(QPointF(x, 20)))
    assert panel.readout.text() == f"settings changed: {text}"
    hud.export_plot_png("throughput", tmp_path / "throughput.png")
    shown = visible_label_rects(panel)
    for a, b in itertools.pairwise(shown):
        assert not a.intersects(b)


# ----- item 9: sampler labels, bursts, tokens vs gaps ------------------------------------------
@pytest.mark.parametrize(("text", "label"), [
    ("<|im_end|>", "⟨im_end⟩"),
    ("</s>", "⟨/s⟩"),
    ("<0xe2>", "<0xE2>"),
    (" \ufffd", "·<byte>"),
    (" Paris", "·Paris"),
])
def test_sampler_token_labels_are_readable(text: str, label: str) -> None:
    assert short_token(text) == label


def test_speculative_itl_says_tokens_arrive_in_bursts(hud: HudWidget) -> None:
    events = reply("req-1", 2, tokens=40)
    finished = events[-1]
    result = dataclasses.replace(finished.result, speculative="ngram", spec_proposed=30,
                                 spec_accepted=24)
    feed(hud, [*events[:-1], dataclasses.replace(finished, result=result)])
    hud.flush()
    assert "tokens arrive in accepted bursts" in hud.panels["itl"].caption.text()
    assert hud._kpi_names["ITL p50"].text() == "ITL p50 (bursts)"


def test_token_and_gap_counts_are_named_alike_everywhere(hud: HudWidget) -> None:
    feed(hud, reply("req-1", 2, tokens=109))
    hud.flush()
    assert "109 tokens, 108 gaps between them" in hud.panels["itl"].caption.text()
    assert "over 109 tokens (108 gaps" in hud.panels["throughput"].caption.text()
    assert "108 gaps after the first token" in hud.panels["breakdown"].table.text()


# ----- item 14: file dialogs keep the app's look ------------------------------------------------
def test_hud_file_dialogs_do_not_inherit_the_dark_style(qtbot, monkeypatch) -> None:
    window = QMainWindow()
    qtbot.addWidget(window)
    hud = HudWidget(calibrate=False)
    dock = QDockWidget("HUD", window)
    dock.setWidget(hud)
    window.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, dock)
    parents = []
    monkeypatch.setattr(QFileDialog, "getSaveFileName",
                        lambda parent, *_a, **_k: (parents.append(parent), ("", ""))[1])
    hud._ask_export_csv()
    assert parents == [window]

    def label_color(parent: object) -> QColor:
        dialog = QFileDialog(parent)
        dialog.setOption(QFileDialog.Option.DontUseNativeDialog)
        label = dialog.findChildren(QLabel)[0]
        label.ensurePolished()
        color = label.palette().color(QPalette.ColorRole.WindowText)
        dialog.deleteLater()
        return color

    dark = QColor(style.TEXT)
    assert label_color(hud) == dark  # what a dialog parented to the HUD looked like
    assert label_color(parents[0]) != dark


# ----- item 5 (Compare): a stale URL error clears ----------------------------------------------
@pytest.fixture
def compare(qtbot, tiny_engine: Engine) -> Iterator[CompareDialog]:
    dialog = CompareDialog(tiny_engine, params=SamplingParams(temperature=0, max_tokens=4),
                           prompt="Hello")
    qtbot.addWidget(dialog)
    yield dialog


def test_compare_url_error_clears_when_b_switches_to_local(compare: CompareDialog) -> None:
    compare.pickers[1].remote.url.setText("not a url at all")
    assert compare.run() is False
    assert compare.error.text()
    compare.pickers[1].set_kind(LOCAL)
    assert compare.error.text() == ""


def test_compare_error_tracks_its_current_cause(compare: CompareDialog) -> None:
    compare.pickers[1].remote.url.setText("")
    compare.prompt.setPlainText("")
    assert compare.run() is False
    first = compare.error.text()
    compare.pickers[1].set_kind(LOCAL)  # the URL is no longer the problem; the prompt is
    assert compare.error.text() == "Type a prompt first." != first


# ----- item 3 (the HUD's own exports): feedback, and dialogs that open somewhere useful ---------
def test_hud_export_to_a_missing_folder_says_so(hud: HudWidget, tmp_path: Path,
                                                 monkeypatch) -> None:
    feed(hud, reply("req-1", 2))
    missing = tmp_path / "no" / "such" / "folder" / "s.csv"
    monkeypatch.setattr(QFileDialog, "getSaveFileName",
                        lambda *_a, **_k: (str(missing), "CSV (*.csv)"))
    hud._ask_export_csv()
    assert not missing.parent.exists()
    text = hud.export_label.text()
    assert text.startswith("Export failed:") and str(missing) in text and "\n" not in text


def test_hud_export_says_what_it_wrote_and_remembers_the_folder(
        hud: HudWidget, tmp_path: Path, monkeypatch) -> None:
    feed(hud, reply("req-1", 2))
    starts = []

    def dialog(_parent: object, _title: str, start: str, _filter: str) -> tuple[str, str]:
        starts.append(start)
        return str(tmp_path / "s.csv"), "CSV (*.csv)"

    monkeypatch.setattr(QFileDialog, "getSaveFileName", dialog)
    hud._ask_export_csv()
    hud._ask_export_csv()
    assert starts[0] == str(Path.home() / "phasewise-session.csv")
    assert starts[1] == str(tmp_path / "phasewise-session.csv")
    assert hud.export_label.text() == f"Saved s.csv, s-tokens.csv in {tmp_path}."
