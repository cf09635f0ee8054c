"""Issue 18: an opened chat's saved replies in the HUD's per-turn panels (history, not live),
export of any chat, and issue 20's leftovers (rename in the picker, ITL labels that overlap).

Window tests build the window with the app's factory (make_window) over the tiny engine; a
second window on the same database is a restart.
"""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtWidgets import QApplication, QFileDialog, QToolTip, QWidget

from engine.events import RequestFinished
from tests.support.hud_events import MS, ReplySpec, reply_events
from tests.support.window_helpers import banner, greedy, send_and_wait, show_and_wait
from ui.hud.model import SavedChat, SessionModel, fmt_ms, saved_metrics, saved_reply
from ui.hud.panels import HISTORY_ALPHA
from ui.hud.widget import HudWidget
from ui.store import ChatStore, metrics_record


def finished(spec: ReplySpec, *, jitter: bool = True) -> RequestFinished:
    event = reply_events(spec, jitter=jitter)[-1]
    assert isinstance(event, RequestFinished)
    return event


def saved(message_id: int, turn: int, *, metrics: dict | None = None, **kw: Any) -> Any:
    """A saved reply as the store gives it back: its metrics record (as saved) and settings."""
    if metrics is None:
        spec = ReplySpec(f"old-{message_id}", 0, 300 + 100 * turn, 250 if turn > 1 else 0,
                         20, **kw)
        metrics = metrics_record(finished(spec).result)
    return saved_reply(message_id, turn, "done", metrics, {"temperature": 0.7})


def alpha(bar: Any, index: int) -> int:
    return bar.opts["brushes"][index].color().alpha()


# ----- the model ------------------------------------------------------------------------------
def test_saved_metrics_are_the_saved_numbers_and_none_when_too_little_was_saved() -> None:
    result = finished(ReplySpec("r", 0, 400, 100, 30)).result
    record = metrics_record(result)
    assert saved_metrics(json.loads(json.dumps(record))) == result.metrics  # a round trip
    assert saved_metrics(None) is None and saved_metrics({}) is None
    assert saved_metrics({"ttft_s": 0.2}) is None  # too little to rebuild honestly
    reply = saved_reply(7, 2, "done", record, {"temperature": 0.7})
    assert reply.history and reply.number == 2 and reply.metrics == result.metrics
    assert reply.path_text() == f"{record['engine']} engine, kernel {record['kernel']}"


def test_an_open_chat_lists_saved_turns_then_its_live_replies() -> None:
    model = SessionModel()
    model.open_chat(SavedChat("chat-a", "Trip", [saved(1, 1), saved(2, 2)]))
    for event in reply_events(ReplySpec("other", 0, 100, 0, 5)):  # another chat's reply
        model.apply(event)
    model.assign("other", "chat-b", 1)
    for event in reply_events(ReplySpec("live", 10_000 * MS, 600, 550, 5)):
        model.apply(event)
    model.assign("live", "chat-a", 3)
    rows = model.turn_rows()
    assert [(x, r.history) for x, r in rows] == [(1, True), (2, True), (3, False)]
    assert rows[2][1] is model.replies["live"]
    for event in reply_events(ReplySpec("regen", 20_000 * MS, 500, 0, 5)):  # turn 2 again
        model.apply(event)
    model.assign("regen", "chat-a", 2)
    assert [(x, r.history) for x, r in model.turn_rows()] == [(1, True), (2, False), (3, False)]
    model.open_chat(None)  # no chat: the whole session by reply number, as before
    assert [x for x, _r in model.turn_rows()] == [1, 2, 3]


def test_a_chat_export_blanks_counts_the_server_did_not_report(tmp_path: Path) -> None:
    remote = metrics_record(finished(ReplySpec("r", 0, 0, 0, 12)).result)
    remote.update(prompt_tokens_known=False, cached_tokens_known=False)
    chat = SavedChat("c", "Remote chat", [saved(1, 1), saved(3, 2, metrics=remote),
                                          saved_reply(5, 3, "stopped", None, None)])
    (path,) = chat.export_csv(tmp_path / "chat.csv")
    rows = list(csv.DictReader(path.read_text("utf-8").splitlines()))
    assert [row["turn"] for row in rows] == ["1", "2", "3"]
    assert rows[0]["prompt_tokens"] == "400" and rows[0]["message_id"] == "1"
    assert rows[1]["prompt_tokens"] == "" and rows[1]["cached_tokens"] == ""
    assert rows[1]["ttft_s"] == str(remote["ttft_s"])
    assert rows[2]["ttft_s"] == "" and rows[2]["status"] == "stopped"
    (json_path,) = chat.export_json(tmp_path / "chat.json")
    data = json.loads(json_path.read_text("utf-8"))
    assert data["chat"] == "Remote chat"
    assert data["replies"][0]["itl_s"] == chat.turns[0].metrics.itl_s
    assert data["replies"][2]["itl_s"] is None


# ----- the widget -----------------------------------------------------------------------------
def test_saved_turns_are_drawn_faded_with_their_saved_numbers(hud: HudWidget) -> None:
    turns = [saved(11, 1), saved(12, 2), saved_reply(13, 3, "stopped", None, None)]
    hud.show_chat(SavedChat("chat-a", "Trip ideas", turns))
    hud.flush()
    ttft = hud.panels["ttft"]
    assert [x for x, _r in ttft._rows] == [1, 2, 3]
    heights = [q + p + f for q, p, f in zip(
        ttft._bars["queue"].opts["height"], ttft._bars["prefill"].opts["height"],
        ttft._bars["first"].opts["height"], strict=True)]
    assert heights == pytest.approx([turns[0].metrics.ttft_s, turns[1].metrics.ttft_s])
    assert alpha(ttft._bars["prefill"], 0) == HISTORY_ALPHA
    assert "faded: saved (history)" in ttft.caption.text()
    assert ttft.hover_text(3, 0) == (
        "turn 3 (saved): TTFT – (no numbers were saved with this reply)")
    assert "History: “Trip ideas”, 3 saved replies" in hud.history_label.text()
    assert not hud.history_label.isHidden()
    items = [hud.reply_combo.itemText(i) for i in range(hud.reply_combo.count())]
    assert items[1:] == [f"Trip ideas · turn {n} (saved)" for n in (1, 2, 3)]
    # The last saved reply is on show; it has no numbers: dashes, never 0.
    assert hud.selected_reply() is turns[2]
    assert [hud._kpis[k].text() for k in ("TTFT", "decode", "ITL p50", "total")] == ["–"] * 4
    assert "no numbers were saved" in hud.advice_label.text()
    hud.select_reply(turns[1].request_id)
    hud.flush()
    m = turns[1].metrics
    assert hud.panels["itl"]._curve.getData()[1].tolist() == pytest.approx(m.itl_s)
    assert "Saved turn 2 (saved)" in hud.panels["itl"].caption.text()
    assert hud.advice_label.text().startswith("Saved: ")
    assert f"{m.decode_s:.3f} s" in hud.panels["breakdown"].table.text()
    assert "turn 1: " in hud.panels["throughput"].caption.text()


def test_a_new_reply_in_the_open_chat_appends_live_after_the_history(hud: HudWidget) -> None:
    hud.show_chat(SavedChat("chat-a", "Trip ideas", [saved(11, 1), saved(12, 2)]))
    events = reply_events(ReplySpec("req-1", 2_000 * MS, 700, 650, 20))
    hud.on_engine_event(events[0])
    hud.name_reply("req-1", "Trip ideas", 3, chat_id="chat-a")
    for event in events[1:]:
        hud.on_engine_event(event)
    hud.flush()
    assert hud.selected_reply().request_id == "req-1"  # the live reply took over
    ttft = hud.panels["ttft"]
    assert [(x, r.history) for x, r in ttft._rows] == [(1, True), (2, True), (3, False)]
    assert [alpha(ttft._bars["queue"], i) for i in range(3)] == [HISTORY_ALPHA] * 2 + [255]
    cache = hud.panels["cache"]
    assert list(cache._reused.opts["height"]) == [0, 250, 650]
    # Captions name it as the per-turn plots place it: the chat's turn, not the session's.
    assert hud.panels["itl"].caption.text().startswith("Turn 3 (finished): 20 tokens")
    assert hud.panels["breakdown"].caption.text().startswith("Turn 3: ")


def test_rename_renames_the_chats_entries_in_the_picker(hud: HudWidget) -> None:
    hud.show_chat(SavedChat("chat-a", "Trip ideas", [saved(11, 1)]))
    for rid, chat, turn in (("req-1", "chat-a", 2), ("req-2", "chat-b", 1)):
        events = reply_events(ReplySpec(rid, 2_000 * MS * turn, 100, 0, 5))
        hud.on_engine_event(events[0])
        hud.name_reply(rid, "Trip ideas" if chat == "chat-a" else "Other", turn,
                       chat_id=chat)
        for event in events[1:]:
            hud.on_engine_event(event)
    hud.flush()
    hud.rename_chat("chat-a", "Rome in May")
    items = [hud.reply_combo.itemText(i) for i in range(1, hud.reply_combo.count())]
    assert items == ["Rome in May · turn 1 (saved)", "Rome in May · turn 2", "Other · turn 1"]
    assert "“Rome in May”" in hud.history_label.text()


def test_a_long_chat_title_in_the_picker_never_widens_the_hud(qtbot) -> None:
    hud = HudWidget(calibrate=False)  # as at start-up: the chat is restored before the show
    qtbot.addWidget(hud)
    title = "What is the capital of France, and what else should I see there in May?"
    hud.show_chat(SavedChat("chat-a", title, [saved(11, 1), saved(12, 2)]))
    hud.resize(hud.minimumWidth(), 900)
    show_and_wait(qtbot, hud)
    body = hud.findChild(QWidget, "hudScrollBody")
    assert body.minimumSizeHint().width() <= hud.minimumWidth()  # no sideways scrolling
    assert hud.reply_combo.itemText(2) == f"{title} · turn 2 (saved)"  # listed in full


@pytest.mark.parametrize("width", [0, 640])  # 0: the narrowest the dock allows (stacked)
def test_itl_percentile_labels_never_overlap_when_the_values_are_close(
        qtbot, hud: HudWidget, width: int) -> None:
    hud.resize(width or hud.minimumWidth(), 900)
    show_and_wait(qtbot, hud)
    for n, spec in enumerate((ReplySpec("flat", 2_000 * MS, 100, 0, 60),
                              ReplySpec("near", 9_000 * MS, 100, 0, 60))):
        for event in reply_events(spec, jitter=n == 1):
            hud.on_engine_event(event)
        hud.flush()
        QApplication.processEvents()
        panel = hud.panels["itl"]
        p50, _p90, p99 = hud.selected_reply().itl_percentiles()
        assert p99 - p50 < 0.2 * p50  # close: the lines nearly or exactly coincide
        texts = [line.label.textItem.toPlainText() for line in panel._lines.values()]
        assert texts == [f"{name} {fmt_ms(v)}" for name, v in zip(
            ("p50", "p90", "p99"), (p50, _p90, p99), strict=True)]  # values, not bare names
        rects = panel.percentile_label_rects()
        assert len(rects) == 3
        area = panel.plot.getPlotItem().vb.sceneBoundingRect()
        for a, b in itertools.combinations(rects, 2):
            assert not a.intersects(b), (a, b)
        assert all(area.left() - 1 <= r.left() and r.right() <= area.right() + 1
                   and area.top() - 1 <= r.top() and r.bottom() <= area.bottom() + 1
                   for r in rects), (area, rects)


# ----- through the window ---------------------------------------------------------------------
def test_a_restart_shows_the_reopened_chats_turns_in_the_hud(qtbot, make_window,
                                                            monkeypatch) -> None:
    first = make_window()
    greedy(first, 6)
    results = [send_and_wait(qtbot, first, text) for text in ("Hello", "And then?")]
    chat = first.conversation_id
    first.close()

    window = make_window()  # a restart on the same database: the latest chat opens
    assert window.conversation_id == chat
    window.hud.flush()
    turns = window.hud.model.chat.turns
    assert [t.number for t in turns] == [1, 2] and all(t.history for t in turns)
    # The saved engine-clock numbers, not recomputed.
    assert [t.metrics.ttft_s for t in turns] == [r.metrics.ttft_s for r in results]
    assert [t.metrics.itl_s for t in turns] == [r.metrics.itl_s for r in results]
    ttft = window.hud.panels["ttft"]
    assert [x for x, _r in ttft._rows] == [1, 2]
    assert alpha(ttft._bars["prefill"], 1) == HISTORY_ALPHA
    assert not window.hud.history_label.isHidden()
    assert window.hud._kpis["TTFT"].text() != "–"
    first_reply = next(m for m in window.store.messages(chat) if m.role == "assistant")
    tips: list[str] = []  # the breakdown's tooltip (a popup offscreen Qt cannot raise)
    monkeypatch.setattr(QToolTip, "showText", lambda _pos, text, *_a: tips.append(text))
    window.show_reply_stats(first_reply.id)  # a click on its stats line: its panels
    assert window.hud.selected_reply() is turns[0] and tips[0].startswith("TTFT ")

    greedy(window, 6)
    live = send_and_wait(qtbot, window, "One more")  # appends live after the history
    window.hud.flush()
    rows = window.hud.panels["ttft"]._rows
    assert [(x, r.history) for x, r in rows] == [(1, True), (2, True), (3, False)]
    assert rows[2][1].request_id == live.request_id


def test_opening_a_chat_from_the_sidebar_swaps_the_hud_history(qtbot, make_window) -> None:
    window = make_window()
    greedy(window, 6)
    send_and_wait(qtbot, window, "First chat")
    chat_a = window.conversation_id
    window.new_chat()
    assert window.hud.model.chat is None and window.hud.history_label.isHidden()
    send_and_wait(qtbot, window, "Second chat")
    send_and_wait(qtbot, window, "Second turn")
    window.sidebar.list.setCurrentRow(window.sidebar.visible_ids().index(chat_a))
    assert window.conversation_id == chat_a
    window.hud.flush()
    # Its one turn ran in this session: shown from the session (tokens and all), not twice.
    rows = window.hud.panels["ttft"]._rows
    assert [(x, r.history) for x, r in rows] == [(1, False)]
    assert window.hud.history_label.isHidden()
    window.sidebar.rename(chat_a, "Renamed")
    combo = window.hud.reply_combo
    texts = [combo.itemText(i) for i in range(combo.count())]
    assert "Renamed · turn 1" in texts and "Second chat · turn 2" in texts
    assert not any(text.startswith("First chat") for text in texts)

    second = make_window()  # a restart: chat A's turn is now history
    second.open_conversation(chat_a)
    second.hud.flush()
    rows = second.hud.panels["ttft"]._rows
    assert [(x, r.history) for x, r in rows] == [(1, True)]
    assert "“Renamed”, 1 saved reply" in second.hud.history_label.text()
    second.sidebar.rename(chat_a, "Renamed again")
    assert second.hud.reply_combo.itemText(1) == "Renamed again · turn 1 (saved)"


def test_any_chat_exports_from_the_menus_with_feedback(qtbot, make_window, tmp_path: Path,
                                                       monkeypatch) -> None:
    window = make_window()
    greedy(window, 6)
    result = send_and_wait(qtbot, window, "Export me")
    chat_a = window.conversation_id
    window.new_chat()  # the chat to export is not the one on screen
    starts: list[str] = []
    target = tmp_path / "out" / "a.csv"

    def dialog(_parent: object, _title: str, start: str, _filter: str) -> tuple[str, str]:
        starts.append(start)
        return str(target), ""

    monkeypatch.setattr(QFileDialog, "getSaveFileName", dialog)
    window.sidebar.sig_export.emit(chat_a, "csv")  # the sidebar's context menu
    text = window.notice_label.text()
    assert text.startswith("Export failed:") and str(target) in text and "\n" not in text
    assert not target.parent.exists()
    target.parent.mkdir()
    assert banner(window) == text
    window.sidebar.sig_export.emit(chat_a, "csv")
    assert window.statusBar().currentMessage() == f"Saved a.csv in {target.parent}."
    assert banner(window) == ""  # issue 31 item 10: the failure's banner stayed up
    rows = list(csv.DictReader(target.read_text("utf-8").splitlines()))
    assert len(rows) == 1 and float(rows[0]["ttft_s"]) == result.metrics.ttft_s
    assert rows[0]["chat"] == "Export me"
    window.open_conversation(chat_a)
    target = target.with_suffix(".json")
    window.menus.export_json_action.trigger()  # Chat menu: the chat on screen
    data = json.loads(target.read_text("utf-8"))
    assert data["replies"][0]["itl_s"] == result.metrics.itl_s
    assert starts[0] == str(Path.home() / "phasewise-export-me.csv")
    assert starts[-1] == str(target.parent / "phasewise-export-me.json")  # the last folder


def test_a_reply_saved_without_numbers_shows_dashes_after_a_restart(qtbot, make_window) -> None:
    window = make_window()
    store = window.store
    chat = store.create_conversation("Old chat")  # as an older database left it
    store.add_message(chat, "user", "Hello")
    message_id = store.add_message(chat, "assistant", "Hi there")
    window.open_conversation(chat)
    window.hud.flush()
    hud = window.hud
    assert [t.metrics for t in hud.model.chat.turns] == [None]
    assert hud.panels["ttft"].hover_text(1, 0).endswith("TTFT – (no numbers were saved "
                                                       "with this reply)")
    assert hud._kpis["TTFT"].text() == "–" and hud._kpis["total"].text() == "–"
    assert "0.0 ms" not in hud.panels["itl"].caption.text()
    assert hud.selected_reply().request_id == f"message-{message_id}"


def test_opening_a_chat_reads_its_messages_once_for_the_view_and_the_hud(
        qtbot, make_window, monkeypatch) -> None:
    window = make_window()
    store = window.store
    chat = store.create_conversation("Saved chat")
    store.add_message(chat, "user", "Hello")
    reply_id = store.add_message(chat, "assistant", "Hi there")
    store.finish_message(reply_id, "Hi there", "done",
                         metrics_record(finished(ReplySpec("old", 0, 400, 0, 20)).result))
    window.new_chat()
    reads: list[str] = []
    real = ChatStore.messages

    def spy(self: ChatStore, conv_id: str) -> list[Any]:
        reads.append(conv_id)
        return real(self, conv_id)

    monkeypatch.setattr(ChatStore, "messages", spy)
    window.open_conversation(chat)  # from the sidebar or the menus
    assert reads == [chat]
    window.hud.flush()  # the same rows reached both: the view and the HUD's history
    assert [m.content for m in window.chat._messages] == ["Hello", "Hi there"]
    assert [t.number for t in window.hud.model.chat.turns] == [1]

    reads.clear()
    restarted = make_window()  # a restart opens the latest chat through the app's factory
    assert restarted.conversation_id == chat and reads == [chat]
    restarted.hud.flush()
    assert [t.history for t in restarted.hud.model.chat.turns] == [True]
