"""HUD dock content. Interface used by the main window (keep it stable):

- on_engine_event(event): every engine event (engine.events dataclasses), on the GUI thread;
  on_engine_events(events): a run of them at once (a drain's tokens of every stream).
- show_reading(request_id, reading): how far a reply's prompt is read (ui.session.PromptReading,
  its time left as the chat session said it).
- on_tokens_painted(request_id, indexes, painted_ns): the chat view painted those tokens.
- mark_setting_change(name, value, t_ns): a slider changed (marker on time plots).
- name_reply(request_id, chat, turn, chat_id=...): which chat and turn a reply answers, as
  the chat session numbered it (picker labels, the header, the open chat's per-turn panels).
- show_chat(saved_chat): the chat on screen; its saved replies show as history.
- rename_chat(chat_id, title): a chat's new title, in the picker and the history cue.

Events only update the session model (cheap appends) and mark panels dirty; a single-shot
QTimer redraws the dirty, visible panels at most 4 times a second while a reply streams, and
once more right after it ends, so the final numbers land at once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from PySide6.QtCore import QTimer, Signal
from PySide6.QtGui import QAction, QResizeEvent
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QMenu,
    QScrollArea,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine.events import (
    EngineEvent,
    ModelLoaded,
    PrefillStarted,
    RequestFailed,
    RequestFinished,
    RequestQueued,
    SamplerSnapshot,
    TokenEmitted,
)
from engine.threads import start_worker
from engine.tools.calibrate import DevicePeaks, device_peaks, measure_peaks
from engine.tools.speed import ModelSpeed
from ui.hud import style
from ui.hud.live_label import LiveLabel
from ui.hud.model import (
    ReplyRecord,
    SavedChat,
    SessionModel,
    advise,
    fmt_ms,
    fmt_seconds,
)
from ui.hud.panels import PANEL_TYPES, HudContext, Panel, prefill_caption
from ui.session import PromptReading

# 4 Hz while tokens stream: plots still move live, and pyqtgraph's painting (the HUD's main
# cost) stays off the decode loop's back on small machines, where every millisecond of GUI
# thread is taken from decode (a paint pre-empts one of torch's threads; the other waits).
REDRAW_INTERVAL_MS = 250
# The redraw after a reply ends (or fails): prompt, and still under 30 Hz.
FINAL_REDRAW_MS = 34
# Redraw plus paint may use at most this share of the GUI thread: when it gets expensive (a
# slow or busy machine), the next redraw waits longer, but never more than the cap.
REDRAW_DUTY = 0.03
MAX_REDRAW_INTERVAL_MS = 1000

# Which panels each event can change (the rest keep their last drawing).
_DIRTY_BY_EVENT: dict[type, frozenset[str]] = {
    RequestQueued: frozenset({"header", "ttft", "cache"}),
    PrefillStarted: frozenset({"cache", "context", "breakdown"}),
    TokenEmitted: frozenset({"header", "itl", "throughput", "breakdown", "context"}),
    SamplerSnapshot: frozenset({"sampler"}),
    RequestFinished: frozenset({"all"}),
    RequestFailed: frozenset({"header"}),
    ModelLoaded: frozenset({"roofline", "context"}),
}
# Of those, the panels that draw every reply of the session: a reply the HUD does not show
# (another chat's, streaming in the background) redraws only these. The rest describe the
# shown reply; redrawing them for another's tokens repaints the same picture, 4 times a second
# for as long as the background chat streams.
_SESSION_PANELS = frozenset({"throughput"})
_TIME_MARKER_PANELS = ("throughput",)
_TURN_MARKER_PANELS = ("ttft", "cache")
LIVE_ITEM = "Newest reply of this chat"
NO_REPLY = "No reply yet"
# The narrowest the HUD gets (its toolbar and a vertical scroll bar fit): in a small window the
# docks give way before the chat does.
MIN_WIDTH = 310
KPI_ROW_WIDTH = 360  # narrower than this, the four headline numbers sit two by two


@dataclass(frozen=True)
class ExportOutcome:
    """What one export wrote, or in one line why it could not (empty `written`)."""

    written: list[Path]
    message: str


def _send_of(request_id: str) -> str:
    """The request id of the send a reply belongs to: an alternative's, less its ".N"."""
    send, _, index = request_id.rpartition(".")
    return send if send and index.isdigit() else request_id


def _state(reply: ReplyRecord) -> str:
    """Whether a reply's numbers are still moving (live) or which end they had."""
    if reply.history:
        return "saved"
    if reply.error:
        return "failed"
    if not reply.done:
        return "live"
    return "stopped" if reply.finish_reason == "cancelled" else "finished"


def run_write(write: Callable[[], list[Path]]) -> ExportOutcome:
    """Run one export: a missing folder or no permission is a one-line message, never a
    traceback on stderr. Shared by the HUD's exports and the window's chat exports."""
    try:
        written = write()
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        return ExportOutcome([], f"Export failed:{where}: {exc.strerror or exc}.")
    names = ", ".join(path.name for path in written[:3])
    more = f" and {len(written) - 3} more" if len(written) > 3 else ""
    return ExportOutcome(written, f"Saved {names}{more} in {written[0].parent}.")


class HudWidget(QWidget):
    sig_peaks_ready = Signal(object)
    """Device peaks (DevicePeaks) arrived from the background calibration thread."""

    def __init__(self, parent: QWidget | None = None, *, calibrate: bool = True) -> None:
        super().__init__(parent)
        self.model = SessionModel()
        self.peaks: DevicePeaks | None = None
        # The loaded model's predicted speed here (engine/tools/speed.py) and its identity: the
        # roofline says it beside that model's replies.
        self.model_speed: tuple[ModelSpeed, str] | None = None
        self._calibrate = calibrate
        self._calibrated_device: str | None = None
        self._calibration: threading.Thread | None = None
        self._stop_calibration = threading.Event()
        self._selected_id: str | None = None  # None follows the live (latest) reply
        self._pinned = False  # the user picked a past reply: keep it when a new one streams
        self._names: dict[str, tuple[str, int]] = {}  # request id -> (chat title, turn)
        self._saved_items = 0  # picker rows after LIVE_ITEM that are the chat's history
        self.export_dir = Path.home()  # where export dialogs open: home, then the last used
        self._dirty: set[str] = set()
        self._text_interval_s = 0.0
        self._prefill: dict[str, PromptReading] = {}  # replies whose prompt is being read
        # The request id of the reply the panels describe, as last worked out (None: none);
        # stream events ask for it per token, so it is kept until something may change it.
        self._shown: str | None = None
        self._shown_known = False
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(REDRAW_INTERVAL_MS)
        self._timer.timeout.connect(self.flush)
        self.panels: dict[str, Panel] = {cls.key: cls() for cls in PANEL_TYPES}
        self._panel_actions: dict[str, QAction] = {}
        self.setStyleSheet(style.STYLE_SHEET)
        self._build()
        self.sig_peaks_ready.connect(self.set_device_peaks)

    # ----- layout ------------------------------------------------------------------------
    def _build(self) -> None:
        body = QWidget()
        body.setObjectName("hudScrollBody")
        column = QVBoxLayout(body)
        column.setContentsMargins(8, 8, 8, 8)
        column.setSpacing(8)
        column.addLayout(self._toolbar())
        self.subject_label = QLabel(NO_REPLY)  # whose numbers: chat, turn, live or saved
        self.subject_label.setObjectName("hudSubject")
        self.subject_label.setWordWrap(True)
        column.addWidget(self.subject_label)
        self.pin_label = QLabel()
        self.pin_label.setObjectName("hudPinned")
        self.pin_label.setWordWrap(True)
        self.pin_label.hide()
        column.addWidget(self.pin_label)
        self.history_label = QLabel()  # the open chat's saved replies are history, not live
        self.history_label.setObjectName("hudHistory")
        self.history_label.setWordWrap(True)
        self.history_label.hide()
        column.addWidget(self.history_label)
        self.export_label = QLabel()  # what the last export wrote, or why it could not
        self.export_label.setObjectName("hudExport")
        self.export_label.setWordWrap(True)
        self.export_label.hide()
        column.addWidget(self.export_label)
        column.addWidget(self._advisor_card())
        for panel in self.panels.values():
            panel.sig_hide_requested.connect(lambda key: self.set_panel_visible(key, False))
            column.addWidget(panel)
        column.addStretch(1)
        scroll = self.scroll_area = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.verticalScrollBar().valueChanged.connect(self._on_scrolled)
        scroll.setWidget(body)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(scroll)
        self.setMinimumWidth(MIN_WIDTH)

    def _toolbar(self) -> QHBoxLayout:
        row = QHBoxLayout()
        self.reply_combo = QComboBox()
        self.reply_combo.addItem(LIVE_ITEM, None)
        # Its width comes from the layout, not from the longest chat title in it (a restored
        # chat's saved replies are listed before the first show): the HUD never scrolls
        # sideways because of a title.
        self.reply_combo.setSizeAdjustPolicy(
            QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.reply_combo.setMinimumContentsLength(8)
        self.reply_combo.setToolTip("Which reply the ITL, breakdown and advisor describe; "
                                    "picking a past reply pins it")
        self.reply_combo.activated.connect(self._on_combo_activated)
        row.addWidget(self.reply_combo, 1)
        self.panels_button = self._menu_button("Panels", self._panels_menu())
        self.export_button = self._menu_button("Export", self._export_menu())
        row.addWidget(self.panels_button)
        row.addWidget(self.export_button)
        return row

    def _menu_button(self, text: str, menu: QMenu) -> QToolButton:
        button = QToolButton()
        button.setText(text)
        button.setMenu(menu)
        button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        return button

    def _panels_menu(self) -> QMenu:
        menu = QMenu(self)
        for key, panel in self.panels.items():
            action = menu.addAction(panel.title)
            action.setCheckable(True)
            action.setChecked(True)
            action.toggled.connect(lambda on, k=key: self.set_panel_visible(k, on))
            self._panel_actions[key] = action
        return menu

    def _export_menu(self) -> QMenu:
        menu = QMenu(self)
        menu.addAction("Session metrics as CSV…", self._ask_export_csv)
        menu.addAction("Session metrics as JSON…", self._ask_export_json)
        menu.addAction("All plots as PNG…", self._ask_export_pngs)
        return menu

    def _advisor_card(self) -> QFrame:
        card = QFrame()
        card.setObjectName("hudAdvisor")
        layout = QVBoxLayout(card)
        layout.setContentsMargins(10, 8, 10, 8)
        grid = self._kpi_grid = QGridLayout()
        grid.setHorizontalSpacing(12)
        self._kpis: dict[str, LiveLabel] = {}
        self._kpi_names: dict[str, QLabel] = {}
        for name in ("TTFT", "decode", "ITL p50", "total"):
            value = LiveLabel("–")
            value.setObjectName("hudKpiValue")
            caption = QLabel(name)
            caption.setObjectName("hudKpiName")
            self._kpis[name] = value
            self._kpi_names[name] = caption
        self._kpi_columns = 0
        self._arrange_kpis(4)
        layout.addLayout(grid)
        self.advice_label = LiveLabel("Send a message to see where the time goes.",
                                      word_wrap=True)
        self.advice_label.setObjectName("hudAdvice")
        layout.addWidget(self.advice_label)
        return card

    def _arrange_kpis(self, columns: int) -> None:
        """The headline numbers in one row of four, or two by two in a narrow HUD (a small
        window narrows the docks first): never clipped."""
        if columns == self._kpi_columns:
            return
        self._kpi_columns = columns
        for i, name in enumerate(self._kpis):
            row, col = 2 * (i // columns), i % columns
            for widget, at in ((self._kpis[name], row), (self._kpi_names[name], row + 1)):
                self._kpi_grid.removeWidget(widget)
                self._kpi_grid.addWidget(widget, at, col)

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self._arrange_kpis(4 if event.size().width() >= KPI_ROW_WIDTH else 2)

    # ----- inputs from the window ----------------------------------------------------------
    def on_engine_event(self, event: EngineEvent) -> None:
        """Fold one engine event in; the redraw happens on the throttle timer."""
        self.on_engine_events([event])

    def on_engine_events(self, events: list[EngineEvent]) -> None:
        """Fold a run of engine events in (a drain's tokens of every streaming reply): the
        panels they change are marked once for the lot; the redraw happens on the timer."""
        dirty: set[str] = set()
        for event in events:
            dirty |= self._fold(event)
        if dirty:
            self._mark_dirty(dirty)

    def _fold(self, event: EngineEvent) -> frozenset[str]:
        """One event into the session model; the panels it changes."""
        self.model.apply(event)
        # A streaming reply's per-token events (snapshots: 10 a second), of any chat.
        streamed = event if isinstance(event, TokenEmitted | SamplerSnapshot) else None
        if streamed is None:
            self._shown_known = False  # a reply started, ended or was named: ask again
        if isinstance(event, RequestQueued) and not self._pinned and self._selected_id:
            self.select_reply(None)  # a new reply streams: follow it
        if isinstance(event, TokenEmitted | RequestFinished | RequestFailed):
            self._prefill.pop(event.request_id, None)
        if isinstance(event, ModelLoaded):
            self._start_calibration(event.info.device)
        dirty = _DIRTY_BY_EVENT.get(type(event), frozenset())
        if dirty and streamed is not None and streamed.request_id != self._shown_id():
            dirty = dirty & _SESSION_PANELS  # another chat's reply: only what draws them all
        if isinstance(event, RequestFinished | RequestFailed):
            self._timer.start(FINAL_REDRAW_MS)  # before _mark_dirty: it keeps a running timer
        return dirty

    def show_reading(self, request_id: str, reading: PromptReading) -> None:
        """How far a reply's prompt is read, until its first token (the live breakdown)."""
        self._prefill[request_id] = reading
        self._mark_dirty({"breakdown"})

    def on_token_painted(self, request_id: str, index: int, painted_ns: int) -> None:
        """The chat view painted token `index` at painted_ns (perf_counter_ns)."""
        self.on_tokens_painted(request_id, [index], painted_ns)

    def on_tokens_painted(self, request_id: str, indexes: list[int], painted_ns: int) -> None:
        """The chat view painted these tokens at once (its sig_tokens_painted): recorded for
        every reply; the render-lag panel redraws only for the reply it shows."""
        marked = [self.model.mark_painted(request_id, index, painted_ns) for index in indexes]
        if any(r is not None for r in marked) and request_id == self._shown_id():
            self._mark_dirty({"render"})

    def mark_setting_change(self, name: str, value: object, t_ns: int) -> None:
        """A slider changed: record it; the changes between two replies share one marker on
        the time and per-turn plots (none for the settings restored before the first reply)."""
        self.model.mark_setting(name, value, t_ns)
        self._place_markers()

    def _place_markers(self) -> None:
        markers = self.model.markers
        for key in _TIME_MARKER_PANELS:
            self.panels[key].set_markers(
                [(self.model.session_s(m.t_ns), m.label()) for m in markers])
        for key in _TURN_MARKER_PANELS:
            self.panels[key].set_markers(
                [(self.model.turn_position(m.t_ns), m.label()) for m in markers])

    def name_reply(self, request_id: str, chat: str, turn: int, *, chat_id: str = "") -> None:
        """Which chat and turn a reply answers (the chat session's numbering): the picker and
        the header show that, and with chat_id the reply joins that chat's per-turn panels
        when it is open."""
        self._names[request_id] = (chat, turn)
        if chat_id:
            self.model.assign(request_id, chat_id, turn)
            self._shown_known = False  # it may be the open chat's newest now
        index = self.reply_combo.findData(request_id)
        reply = self.model.replies.get(request_id)
        if index >= 0 and reply is not None:
            self.reply_combo.setItemText(index, self.reply_title(reply))

    def show_chat(self, chat: SavedChat | None) -> None:
        """The chat on screen (None: a new, unsaved one): its saved replies become the
        per-turn panels' history, listed in the picker as saved. Showing the same chat again
        (it changed) keeps the picker's selection."""
        same = chat is not None and self.model.chat is not None \
            and self.model.chat.chat_id == chat.chat_id
        self.model.open_chat(chat)
        self._shown_known = False
        self._fill_saved_items()
        self._refresh_history_cue()
        self._place_markers()
        if not same and not self._pinned:
            self.select_reply(None)  # this chat's newest reply: live, else its last saved one
        else:
            self._mark_dirty({"all"})

    def rename_chat(self, chat_id: str, title: str) -> None:
        """A chat was renamed: its entries in the picker (live and saved) follow."""
        for rid, (cid, turn) in list(self._chat_turns()):
            if cid == chat_id and rid in self._names:
                self._names[rid] = (title, turn)
        if self.model.chat is not None and self.model.chat.chat_id == chat_id:
            self.model.chat.title = title
        combo = self.reply_combo
        for index in range(1, combo.count()):
            reply = self.model.record(combo.itemData(index))
            if reply is not None:
                combo.setItemText(index, self.reply_title(reply))
        self._refresh_history_cue()
        self._refresh_pin_cue()
        self._mark_dirty({"header"})  # the subject line names the chat

    def _chat_turns(self) -> list[tuple[str, tuple[str, int]]]:
        return [(rid, chat) for rid in self._names if (chat := self.model.chat_of(rid))]

    def reply_title(self, reply: ReplyRecord) -> str:
        """"Trip ideas · turn 3" when the window named it, else "Reply 11 (turn 3)"; a saved
        reply of the open chat is "Trip ideas · turn 3 (saved)"."""
        chat, which = self._whose(reply)
        title = f"{chat} · {which}" if chat else which
        return f"{title} (saved)" if reply.history else title

    def _whose(self, reply: ReplyRecord) -> tuple[str, str]:
        """(the chat's title, "" if unknown; which of its replies: "turn 3 · attempt 2 ·
        alternative 1", or "Reply 11" for one nobody named)."""
        if reply.history:
            chat = self.model.chat.title if self.model.chat is not None else "Saved"
            return chat, f"turn {reply.number}"
        alternative = reply.request_id.rpartition(".")[2] if "." in reply.request_id else ""
        suffix = f" · alternative {int(alternative) + 1}" if alternative.isdigit() else ""
        named = self._names.get(reply.request_id)
        if named is not None:
            chat, turn = named
            attempt = self._attempt(reply.request_id)
            again = f" · attempt {attempt}" if attempt > 1 else ""
            return chat, f"turn {turn}{again}{suffix}"
        return "", f"Reply {reply.number}{suffix}"

    def subject_text(self) -> str:
        """Whose numbers the HUD shows, in its header: "Chat “Trip plan” · turn 3 · live"
        (live while it streams; finished, stopped or failed this session; saved: read back
        from the chat, as measured when it ran)."""
        reply = self.selected_reply()
        if reply is None:
            chat = self._chat_title()
            return f"Chat “{chat}” · no reply yet" if chat else NO_REPLY
        chat, which = self._whose(reply)
        return " · ".join([*([f"Chat “{chat}”"] if chat else []), which, _state(reply)])

    def _attempt(self, request_id: str) -> int:
        """Which try at its chat's turn a named reply is: 1, then 2, 3 ... for each regenerate
        or edit & resend of that turn (the alternatives of one send are one attempt)."""
        def turn_of(rid: str) -> object:
            return self.model.chat_of(rid) or self._names[rid]  # (chat id or title, turn)

        mine = turn_of(request_id)
        sends = dict.fromkeys(_send_of(rid) for rid in self._names if turn_of(rid) == mine)
        return list(sends).index(_send_of(request_id)) + 1

    def set_text_interval(self, seconds: float) -> None:
        """The chat view paints streaming text this often: render lag is judged against it."""
        self._text_interval_s = seconds
        self._mark_dirty({"render"})

    def set_model_speed(self, speed: ModelSpeed | None, identity: str = "") -> None:
        """The loaded model's predicted speed on this computer (None: none known), for the
        model whose ModelInfo.identity is `identity`."""
        self.model_speed = (speed, identity) if speed is not None else None
        self._mark_dirty({"roofline"})

    def set_device_peaks(self, peaks: DevicePeaks) -> None:
        """Peaks for the roofline (from the calibration thread, the table or a test)."""
        self.peaks = peaks
        self.model.peaks = peaks.to_dict()
        self._mark_dirty({"roofline"})

    # ----- selection and visibility --------------------------------------------------------
    def select_reply(self, request_id: str | None, *, pin: bool = False) -> None:
        """Show a past reply in the per-reply panels; None follows the live one.

        Unpinned, the next reply to start takes over again; pinned (the user's pick in the
        picker), it stays, with a visible cue, until the user picks the live reply.
        """
        known = request_id is not None and self.model.record(request_id) is not None
        self._selected_id = request_id if known else None
        self._shown_known = False
        self._pinned = pin and self._selected_id is not None
        self._refresh_combo()
        index = self.reply_combo.findData(self._selected_id)
        if index >= 0 and index != self.reply_combo.currentIndex():
            self.reply_combo.setCurrentIndex(index)
        self._refresh_pin_cue()
        self._mark_dirty({"all"})

    @property
    def pinned(self) -> bool:
        return self._pinned

    def _refresh_pin_cue(self) -> None:
        reply = self.selected_reply() if self._pinned else None
        if reply is None:
            self.pin_label.hide()
            return
        latest = self.model.newest_of_chat()
        newer = latest is not None and latest is not reply
        self.pin_label.setText(
            f"Pinned to {self.reply_title(reply)}"
            + (f"; {self.reply_title(latest)} is newer" if newer and latest else "")
            + f". Pick “{LIVE_ITEM}” to follow it.")
        self.pin_label.show()

    def selected_reply(self) -> ReplyRecord | None:
        """The reply the per-reply panels and the headline describe: the user's pick, else
        the newest reply of the chat on screen (never one of another chat)."""
        if self._selected_id is not None:
            return self.model.record(self._selected_id)
        return self.model.newest_of_chat()

    def _shown_id(self) -> str | None:
        """The request id of selected_reply(), worked out once per change, not per token."""
        if not self._shown_known:
            reply = self.selected_reply()
            self._shown = reply.request_id if reply is not None else None
            self._shown_known = True
        return self._shown

    def focus_order(self) -> list[QWidget]:
        """What Tab reaches in the HUD: the picker, its two menus (Panels shows and hides
        panels), then the column itself (the arrow keys scroll it)."""
        return [self.reply_combo, self.panels_button, self.export_button, self.scroll_area]

    def panel_keys(self) -> list[str]:
        return list(self.panels)

    def set_panel_visible(self, key: str, visible: bool) -> None:
        self.panels[key].setHidden(not visible)
        action = self._panel_actions[key]
        if action.isChecked() != visible:
            action.setChecked(visible)
        if visible:
            self._mark_dirty({key})

    def is_panel_visible(self, key: str) -> bool:
        return not self.panels[key].isHidden()

    def advice_text(self) -> str:
        reply = self.selected_reply()
        return advise(reply.breakdown()) if reply else ""

    # ----- redraw --------------------------------------------------------------------------
    def _mark_dirty(self, keys: set[str] | frozenset[str]) -> None:
        self._dirty |= keys
        if not self._timer.isActive():
            self._timer.start()

    def flush(self) -> None:
        """Redraw every dirty, visible panel now (the timer calls this; so may tests).

        Panels scrolled out of view stay dirty and redraw when scrolled back into view.
        """
        started = time.perf_counter()
        self._timer.stop()
        dirty, self._dirty = self._dirty, set()
        everything = "all" in dirty
        ctx = self._context()
        if everything or "header" in dirty:
            self._refresh_combo()
            self._refresh_pin_cue()
        if everything or dirty - _SESSION_PANELS:  # else the shown reply did not change
            self.subject_label.setText(self.subject_text())
            self._refresh_summary(ctx.reply)
        for key, panel in self.panels.items():
            if panel.isHidden() or not (everything or key in dirty):
                continue
            if self._scrolled_out(panel):
                self._dirty.add(key)
                continue
            panel.refresh(ctx)
            panel.layout_markers()  # the range may have moved: labels must not overlap
        # The painting of the previous redraw happened after it returned; count it here.
        painted_s = sum(panel.plot.take_paint_s() for panel in self.panels.values())
        cost_ms = (time.perf_counter() - started + painted_s) * 1000
        self._timer.setInterval(
            min(max(REDRAW_INTERVAL_MS, round(cost_ms / REDRAW_DUTY)), MAX_REDRAW_INTERVAL_MS))

    def _context(self) -> HudContext:
        reply = self.selected_reply()
        prefill = self._prefill.get(reply.request_id) if reply is not None else None
        speed = None
        if self.model_speed is not None and reply is not None and reply.result is not None \
                and reply.result.model is not None \
                and reply.result.model.identity == self.model_speed[1]:
            speed = self.model_speed[0]
        return HudContext(self.model, reply, self.peaks, self._text_interval_s, prefill, speed)

    def _scrolled_out(self, panel: Panel) -> bool:
        return self.isVisible() and panel.visibleRegion().isEmpty()

    def _on_scrolled(self) -> None:
        if self._dirty and not self._timer.isActive():
            self._timer.start()

    def _refresh_combo(self) -> None:
        combo = self.reply_combo
        combo.blockSignals(True)
        for reply in self.model.replies_after(combo.count() - 1 - self._saved_items):
            combo.addItem(self.reply_title(reply), reply.request_id)
        combo.blockSignals(False)

    def _fill_saved_items(self) -> None:
        """The open chat's saved replies, right after LIVE_ITEM in the picker."""
        combo = self.reply_combo
        combo.blockSignals(True)
        selected = combo.currentData()
        for _ in range(self._saved_items):
            combo.removeItem(1)
        turns = self.model.saved_turns()  # a turn answered live this session is listed live
        for i, reply in enumerate(turns, start=1):
            combo.insertItem(i, self.reply_title(reply), reply.request_id)
        self._saved_items = len(turns)
        index = combo.findData(selected)
        combo.setCurrentIndex(max(index, 0))
        combo.blockSignals(False)
        if self._selected_id is not None and self.model.record(self._selected_id) is None:
            self._selected_id, self._pinned = None, False  # its saved reply is gone
            self._shown_known = False

    def _refresh_history_cue(self) -> None:
        chat, n = self.model.chat, len(self.model.saved_turns())
        if chat is None or not n:
            self.history_label.hide()
            return
        self.history_label.setText(
            f"History: “{chat.title}”, {n} saved repl{'ies' if n > 1 else 'y'} (faded in the "
            "per-turn plots; their numbers as measured when they ran, “–” where none were "
            "saved). New replies in this chat appear live.")
        self.history_label.show()

    def _refresh_summary(self, reply: ReplyRecord | None) -> None:
        if reply is None:
            return
        b = reply.breakdown()
        m = reply.metrics
        # A reply stopped before its first token has no TTFT, and one without two tokens no
        # gap: "–", never a 0.0 ms that reads as instant.
        self._kpis["TTFT"].setText(fmt_seconds(b.ttft_s) if b and b.has_first_token else "–")
        tok_s = m.decode_tok_s if m else (1 / b.ms_per_token_s if b and b.ms_per_token_s else 0)
        self._kpis["decode"].setText(f"{tok_s:,.1f} tok/s" if tok_s else "–")
        has_gap = bool(reply.itl_s())
        bursts = reply.result is not None and bool(reply.result.speculative)
        self._kpi_names["ITL p50"].setText("ITL p50 (bursts)" if bursts else "ITL p50")
        self._kpi_names["ITL p50"].setToolTip(
            "Speculative decoding: tokens arrive in accepted bursts, so most gaps are near "
            "zero; decode tok/s is the rate per token." if bursts else "")
        self._kpis["ITL p50"].setText(fmt_ms(reply.itl_percentiles()[0]) if has_gap else "–")
        self._kpis["total"].setText(fmt_seconds(b.e2e_s) if b else "–")
        prefill = self._prefill.get(reply.request_id)
        if reply.history and b is None:
            self.advice_label.setText(f"{reply.name} of “{self._chat_title()}”: no numbers "
                                      "were saved with it (–).")
        elif reply.error:
            self.advice_label.setText(f"{self.model.reply_name(reply)} failed: {reply.error}")
        elif b is None and prefill is not None:
            self.advice_label.setText(f"Live: {prefill_caption(prefill)}.")
        elif b is not None:
            advice = advise(b) or "No single phase dominates this reply; nothing to cut."
            prefix = "Saved: " if reply.history else "" if b.final else "Live: "
            self.advice_label.setText(prefix + advice)

    def _chat_title(self) -> str:
        return self.model.chat.title if self.model.chat is not None else ""

    def _on_combo_activated(self, index: int) -> None:
        """The user picked in the picker: a past reply is pinned, LIVE_ITEM follows."""
        request_id = self.reply_combo.itemData(index)
        self.select_reply(request_id, pin=request_id is not None)

    # ----- calibration ---------------------------------------------------------------------
    def _start_calibration(self, device: str) -> None:
        """Peaks for a new device come from a background thread (< 2 s once, then cached)."""
        if not self._calibrate or device == self._calibrated_device:
            return
        self._calibrated_device = device
        self.stop_calibration()  # a calibration for the previous device is of no use now
        self._stop_calibration = threading.Event()
        self._calibration = start_worker(
            partial(self._calibration_worker, device, self._stop_calibration), "calibrate")

    def stop_calibration(self) -> None:
        """Stop and join the calibration thread (within one timed repeat): it runs torch, and
        the interpreter must never finalize under it (engine/threads.py says why)."""
        self._stop_calibration.set()
        if self._calibration is not None:
            self._calibration.join()
            self._calibration = None

    def _calibration_worker(self, device: str, stop: threading.Event) -> None:
        try:
            peaks = device_peaks(device, measure=partial(measure_peaks, stop=stop))
        except Exception:  # stopped, or failed: the roofline just stays empty
            return
        with contextlib.suppress(RuntimeError):  # the HUD was closed while calibrating
            self.sig_peaks_ready.emit(peaks)

    # ----- export --------------------------------------------------------------------------
    def export_csv(self, path: str | Path) -> list[Path]:
        """Per-reply CSV at path plus per-token CSV beside it (<stem>-tokens.csv)."""
        return self.model.export_csv(path)

    def export_json(self, path: str | Path) -> Path:
        return self.model.export_json(path)

    def export_plot_png(self, key: str, path: str | Path, width: int = 900) -> Path:
        """One panel's plot as a PNG (drawn fresh from the current data)."""
        from pyqtgraph.exporters import ImageExporter

        panel = self.panels[key]
        panel.refresh(self._context())
        panel.layout_markers()
        exporter = ImageExporter(panel.plot.getPlotItem())
        exporter.parameters()["width"] = width
        path = Path(path)
        exporter.export(str(path))
        return path

    def export_all_pngs(self, folder: str | Path) -> list[Path]:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        return [self.export_plot_png(key, folder / f"hud-{key}.png") for key in self.panels]

    def _dialog_parent(self) -> QWidget | None:
        """Dialogs belong to the window, not the HUD: a child of the HUD would inherit its
        dark style sheet (faint labels, black combo boxes, invisible icons)."""
        window = self.window()
        return None if window is self else window

    def _ask_export_csv(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self._dialog_parent(), "Export CSV",
                                              str(self.export_dir / "phasewise-session.csv"),
                                              "CSV (*.csv)")
        if path:
            self.run_export(lambda: self.export_csv(path))

    def _ask_export_json(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self._dialog_parent(), "Export JSON",
                                              str(self.export_dir / "phasewise-session.json"),
                                              "JSON (*.json)")
        if path:
            self.run_export(lambda: [self.export_json(path)])

    def _ask_export_pngs(self) -> None:
        folder = QFileDialog.getExistingDirectory(self._dialog_parent(),
                                                  "Export plots to folder", str(self.export_dir))
        if folder:
            self.run_export(lambda: self.export_all_pngs(folder))

    def run_export(self, write: Callable[[], list[Path]]) -> bool:
        """Run one export and say what it wrote, or in one line why it could not (a missing
        folder, no permission): never a silent close with a traceback on stderr."""
        outcome = run_write(write)
        if outcome.written:
            self.export_dir = outcome.written[0].parent
        self._show_export(outcome.message, failed=not outcome.written)
        return bool(outcome.written)

    def _show_export(self, text: str, *, failed: bool) -> None:
        self.export_label.setText(text)
        self.export_label.setStyleSheet(f"color: {style.CHOSEN if failed else style.MUTED};")
        self.export_label.show()
