"""Compare mode: the same prompt on two backends at once, their TTFT, ITL and throughput
overlaid.

Each side runs on a backend object of its own, so the window's chat is not disturbed: the
local Engine serves the local side next to the chat (its own request id), and a remote side
gets a fresh RemoteEngine (on the GUI's qasync loop when the window has one). Every number
comes from the engines: the table shows each reply's GenerationResult.metrics; the plots fold
each side's events with ui.hud.model.SessionModel, as the HUD does.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyqtgraph as pg
from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtGui import QCloseEvent, QShowEvent, QTextCursor
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine import (
    ChatMessage,
    EngineEvent,
    GenerationRequest,
    GenerationResult,
    ModelInfo,
    ModelLoaded,
    ModelLoadFailed,
    RequestFailed,
    RequestFinished,
    SamplingParams,
    TextFlushed,
    TokenEmitted,
)
from engine.backends import BackendRouter
from engine.metrics import RequestMetrics
from engine.remote import RemoteConfig, RemoteEngine, resolve_api_key
from engine.worker import Engine
from ui.bridge import EngineBridge
from ui.hud import style
from ui.hud.model import SessionModel
from ui.model_picker import RemoteBackendInputs

LOCAL, REMOTE = "local", "remote"
SIDE_NAMES = ("A", "B")
SIDE_COLORS = (style.KEPT, style.PREFILL)
REDRAW_MS = 100  # plots and text follow the streams at up to 10 Hz
UNKNOWN = "unknown"  # the server did not say
MISSING = "—"  # that side has no result (it failed or was stopped)

# (row name, value of a reply's metrics; None when the backend did not report it)
TABLE_ROWS: tuple[tuple[str, Callable[[RequestMetrics], float | int | None]], ...] = (
    ("TTFT (ms)", lambda m: m.ttft_s * 1e3),
    ("ITL p50 (ms)", lambda m: m.itl_p50_s * 1e3),
    ("ITL p99 (ms)", lambda m: m.itl_p99_s * 1e3),
    ("decode (tok/s)", lambda m: m.decode_tok_s),
    ("output tokens", lambda m: m.output_tokens),
    ("prompt tokens", lambda m: m.prompt_tokens if m.prompt_tokens_known else None),
    ("cached tokens", lambda m: m.cached_tokens if m.cached_tokens_known else None),
    ("end to end (ms)", lambda m: m.e2e_s * 1e3),
)

RemoteFactory = Callable[[str, "str | None", "str | None"], RemoteEngine]


def own_thread_remote(base_url: str, model: str | None, api_key: str | None) -> RemoteEngine:
    """A RemoteEngine with its own loop thread (no GUI loop to share)."""
    config = RemoteConfig(base_url, model=model or None,
                          api_key=api_key or resolve_api_key(base_url))
    return RemoteEngine(config)


def format_value(value: float | int | None) -> str:
    if value is None:
        return UNKNOWN
    return f"{value:,}" if isinstance(value, int) else f"{value:,.1f}"


def ratio(a: float | int | None, b: float | int | None) -> float | None:
    """B / A, or None when either is unknown or A is zero."""
    if a is None or b is None or a == 0:
        return None
    return b / a


@dataclass(frozen=True)
class BackendChoice:
    kind: str  # LOCAL or REMOTE
    base_url: str = ""
    model: str = ""
    api_key: str | None = None


# ----- one side --------------------------------------------------------------------------------
class BackendPicker(QGroupBox):
    """Pick one side's backend: the local model, or a remote server."""

    sig_changed = Signal()
    """The kind or a remote input changed: what the last check or run said may be stale."""

    def __init__(self, name: str, local_info: ModelInfo | None,
                 parent: QWidget | None = None) -> None:
        super().__init__(f"Backend {name}", parent)
        self.kind = QComboBox()
        if local_info is not None:
            self.kind.addItem(f"Local model: {local_info.name} ({local_info.device})", LOCAL)
        self.kind.addItem("Remote server (OpenAI-compatible)", REMOTE)
        self.remote = RemoteBackendInputs()
        self.remote.key.setPlaceholderText("API key (optional; used for this run only)")
        self.kind.currentIndexChanged.connect(self._show_inputs)
        self.kind.currentIndexChanged.connect(self.sig_changed)
        for edit in self.remote.edits():
            edit.textChanged.connect(self.sig_changed)
        layout = QVBoxLayout(self)
        layout.addWidget(self.kind)
        layout.addWidget(self.remote)
        layout.addStretch(1)
        self._show_inputs()

    def set_kind(self, kind: str) -> None:
        index = self.kind.findData(kind)
        if index >= 0:
            self.kind.setCurrentIndex(index)

    def _show_inputs(self) -> None:
        self.remote.setVisible(self.kind.currentData() == REMOTE)

    def choice(self) -> BackendChoice:
        """The picked backend; ValueError with a one-line reason if it is incomplete."""
        if self.kind.currentData() == LOCAL:
            return BackendChoice(LOCAL)
        options = self.remote.options()
        return BackendChoice(REMOTE, options["base_url"], options["model"],
                             self.remote.key.text() or None)


class CompareSide(QObject):
    """One backend's run: its events, folded; its reply, its result or its error."""

    sig_ready = Signal()
    """The backend is connected (or failed to connect): the run may start."""
    sig_ended = Signal()
    """The reply finished, failed, or never started."""

    def __init__(self, name: str, label: str, engine: Engine | RemoteEngine, owned: bool,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.name = name
        self.label = label
        self.engine = engine
        self.owned = owned  # a RemoteEngine of our own: started and shut down here
        self.session = SessionModel()
        self.request_id: str | None = None
        self.handle: Any = None
        self.text = ""
        self.result: GenerationResult | None = None
        self.error: str | None = None
        self.ready = False
        self.ended = False
        self.bridge = EngineBridge(engine, self)
        self.bridge.sig_event.connect(self._on_event)
        self.bridge.sig_stream.connect(self._on_events)  # its tokens, a drain's at once

    def connect_backend(self) -> None:
        """A remote side asks its server for the model; the local side is ready at once."""
        if self.owned:
            self.engine.start().load_model()
        else:
            self._set_ready(self.engine.model_info)

    def submit(self, request: GenerationRequest) -> None:
        self.request_id = request.request_id  # events may arrive while submit() runs
        self.handle = self.engine.submit(request)

    def cancel(self) -> None:
        """Cancel the reply (it keeps what it has); a side not started yet ends without one."""
        if self.request_id is None:
            self._end("stopped before the reply started")
        elif not self.ended:
            self.engine.cancel(self.request_id)

    def close(self) -> None:
        """Stop the reply and let go of the backend (a remote of ours is shut down)."""
        self.cancel()
        self.bridge.detach()
        if self.owned:
            self.engine.shutdown()

    def status(self) -> str:
        if self.error:
            return self.error
        if self.result is not None:
            r = self.result
            return f"{r.finish_reason} · {r.metrics.output_tokens} tokens"
        if not self.ready:
            return "connecting…"
        reply = self.session.replies.get(self.request_id or "")
        if reply is None or not reply.token_ns:
            return "waiting for the first token…"
        return f"streaming · {reply.output_tokens} tokens"

    def _set_ready(self, info: ModelInfo | None) -> None:
        if info is None:
            self._end("no model is loaded")
            return
        if isinstance(self.engine, RemoteEngine):
            self.label = f"{self.name} · {info.name} @ {self.engine.config.host}"
        self.ready = True
        self.sig_ready.emit()

    def _end(self, error: str | None = None) -> None:
        if error:
            self.error = " ".join(error.split())  # one line
        if not self.ended:
            self.ended = True
            if not self.ready:
                self.sig_ready.emit()  # nothing to wait for on this side
            self.sig_ended.emit()

    def _on_events(self, events: list[EngineEvent]) -> None:
        for event in events:
            self._on_event(event)

    def _on_event(self, event: EngineEvent) -> None:
        if self.owned and not self.ready and not self.ended:
            if isinstance(event, ModelLoaded):
                self._set_ready(event.info)
            elif isinstance(event, ModelLoadFailed):
                self._end(event.message)
        if self.request_id is None or getattr(event, "request_id", None) != self.request_id:
            return
        self.session.apply(event)
        if isinstance(event, (TokenEmitted, TextFlushed)):
            self.text += event.text
        elif isinstance(event, RequestFinished):
            self.result = event.result
            self.text = event.result.text
            self._end(event.result.error)
        elif isinstance(event, RequestFailed):
            self._end(event.message)


# ----- the dialog ------------------------------------------------------------------------------
class CompareDialog(QDialog):
    """Run one prompt on two backends at once and overlay what each one measured."""

    sig_finished = Signal()
    """Both sides have ended (finished, failed or never connected)."""

    def __init__(self, local: Engine | None, remote_factory: RemoteFactory = own_thread_remote,
                 *, params: SamplingParams | None = None, prompt: str = "",
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Compare backends")
        self.resize(1180, 860)
        self.local = local
        self.remote_factory = remote_factory
        self.params = params or SamplingParams()
        self.sides: list[CompareSide] = []
        self.running = False
        self._starting = False  # sides may still be submitted (cleared by stop and close)
        local_info = local.model_info if local is not None else None
        self.pickers = [BackendPicker(name, local_info) for name in SIDE_NAMES]
        self.pickers[1].set_kind(REMOTE)
        for i, picker in enumerate(self.pickers):
            picker.sig_changed.connect(lambda i=i: self._on_choice_changed(i))
        self.prompt = QPlainTextEdit(prompt)
        self.prompt.setTabChangesFocus(True)
        self.prompt.setPlaceholderText("The prompt both backends answer")
        self.prompt.setMaximumHeight(70)
        self.run_button = QPushButton("Run both")
        self.run_button.clicked.connect(self.run)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        self.stop_button.setEnabled(False)
        self.error = QLabel()
        self.error.setObjectName("errorLabel")
        self._build_plots()
        self._build_results()
        self._build_layout()
        self._redraw = QTimer(self)
        self._redraw.setInterval(REDRAW_MS)
        self._redraw.timeout.connect(self.refresh)

    @classmethod
    def for_engine(cls, engine: Any, params: SamplingParams, prompt: str,
                   parent: QWidget | None = None) -> CompareDialog:
        """The dialog for a window's engine: a BackendRouter lends its local engine and makes
        remotes on its loop; a plain Engine is the local side itself."""
        if isinstance(engine, BackendRouter):
            return cls(engine.local, engine.new_remote, params=params, prompt=prompt,
                       parent=parent)
        return cls(engine, params=params, prompt=prompt, parent=parent)

    # ----- construction --------------------------------------------------------------------
    def _build_plots(self) -> None:
        self.ttft_plot = style.make_plot(170)
        style.axis_label(self.ttft_plot, "left", "TTFT (ms)")  # no SI prefix: "kms" misleads
        self.ttft_bars = pg.BarGraphItem(x=[], height=[], width=0.6)
        self.ttft_plot.addItem(self.ttft_bars)
        self.itl_plot = style.make_plot(170)
        style.axis_label(self.itl_plot, "left", "ITL (ms)")
        style.axis_label(self.itl_plot, "bottom", "token")
        self.throughput_plot = style.make_plot(170)
        style.axis_label(self.throughput_plot, "left", "decode (tok/s, rolling)")
        style.axis_label(self.throughput_plot, "bottom", "seconds since submit")
        self.itl_curves: list[pg.PlotDataItem] = []
        self.throughput_curves: list[pg.PlotDataItem] = []
        self.legend = QLabel()  # which color is which side, for the overlaid plots
        self.legend.setObjectName("hudCaption")

    def _build_results(self) -> None:
        self.table = QTableWidget(len(TABLE_ROWS), 3)
        self.table.setVerticalHeaderLabels([name for name, _ in TABLE_ROWS])
        self.table.setHorizontalHeaderLabels([*SIDE_NAMES, "B / A"])
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.table.setMinimumWidth(380)
        self.table.setMaximumWidth(440)
        self.reply_titles = [QLabel(name) for name in SIDE_NAMES]
        self.reply_status = [QLabel() for _ in SIDE_NAMES]
        self.replies = [QPlainTextEdit() for _ in SIDE_NAMES]
        for title, color in zip(self.reply_titles, SIDE_COLORS, strict=True):
            title.setStyleSheet(f"font-weight: 600; color: {color};")
        for status in self.reply_status:
            status.setWordWrap(True)
        for reply in self.replies:
            reply.setReadOnly(True)

    def _build_layout(self) -> None:
        pickers = QHBoxLayout()
        for picker in self.pickers:
            pickers.addWidget(picker, 1)
        run = QHBoxLayout()
        run.addWidget(self.prompt, 1)
        buttons = QVBoxLayout()
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.stop_button)
        run.addLayout(buttons)
        p = self.params
        caption = QLabel(f"temperature {p.temperature:g} · top-p {p.top_p:g} · max "
                         f"{p.max_tokens} tokens (from the Generation panel)")
        caption.setObjectName("hudCaption")
        plots = QHBoxLayout()
        plots.addWidget(self.ttft_plot, 2)
        plots.addWidget(self.itl_plot, 5)
        plots.addWidget(self.throughput_plot, 5)
        results = QGridLayout()
        results.addWidget(self.table, 0, 0, 3, 1, Qt.AlignmentFlag.AlignTop)
        for col, widgets in enumerate(zip(self.reply_titles, self.reply_status, self.replies,
                                          strict=True), 1):
            for row, widget in enumerate(widgets):
                results.addWidget(widget, row, col)
        results.setRowStretch(2, 1)
        results.setColumnStretch(1, 1)
        results.setColumnStretch(2, 1)
        layout = QVBoxLayout(self)
        layout.addLayout(pickers)
        layout.addLayout(run)
        layout.addWidget(caption)
        layout.addWidget(self.error)
        layout.addWidget(self.legend)
        layout.addLayout(plots)
        layout.addLayout(results, 1)

    # ----- running -------------------------------------------------------------------------
    def run(self) -> bool:
        """Start both sides; False (the reason shown) when a choice or the prompt is missing."""
        if self.running:
            return False
        try:
            choices = self._check_inputs()
        except ValueError as exc:
            self.error.setText(str(exc))
            return False
        self.error.clear()
        self._close_sides()
        for side in self.sides:
            side.deleteLater()
        self.sides = [self._make_side(name, choice)
                      for name, choice in zip(SIDE_NAMES, choices, strict=True)]
        self._set_running(True)
        self._starting = True
        for side in self.sides:
            side.connect_backend()
        self.refresh()
        return True

    def _check_inputs(self) -> list[BackendChoice]:
        """Both choices and the prompt; ValueError with the first one-line reason."""
        choices = [picker.choice() for picker in self.pickers]
        if not self.prompt.toPlainText().strip():
            raise ValueError("Type a prompt first.")
        return choices

    def _on_choice_changed(self, index: int) -> None:
        """A shown error clears once its cause does (e.g. B switched from a bad URL to
        Local); the last run's status for a side whose backend changed no longer applies."""
        if self.running:
            return
        if self.error.text():
            try:
                self._check_inputs()
            except ValueError as exc:
                self.error.setText(str(exc))
            else:
                self.error.clear()
        if index < len(self.sides) and self.sides[index].error:
            self.reply_status[index].clear()

    def stop(self) -> None:
        """Cancel both replies (each keeps what it has); a side still connecting never starts."""
        self._starting = False
        for side in self.sides:
            side.cancel()

    def _make_side(self, name: str, choice: BackendChoice) -> CompareSide:
        if choice.kind == LOCAL:
            assert self.local is not None  # the picker offers Local only with a local model
            info = self.local.model_info
            label = f"{name} · {info.name} (local)" if info else f"{name} · local"
            side = CompareSide(name, label, self.local, owned=False, parent=self)
        else:
            remote = self.remote_factory(choice.base_url, choice.model or None, choice.api_key)
            side = CompareSide(name, f"{name} · {remote.config.host}", remote, owned=True,
                               parent=self)
        side.sig_ready.connect(self._submit_when_all_ready)
        side.sig_ended.connect(self._on_side_ended)
        return side

    def _submit_when_all_ready(self) -> None:
        """Both sides start together, once every remote side has connected."""
        if not self._starting or not all(side.ready or side.ended for side in self.sides):
            return
        self._starting = False
        prompt = self.prompt.toPlainText().strip()
        self._reset_curves()
        for side in self.sides:
            if side.ready and side.request_id is None and not side.ended:
                side.submit(GenerationRequest([ChatMessage("user", prompt)], self.params))
        self.refresh()

    def _on_side_ended(self) -> None:
        self.refresh()
        if self.running and all(side.ended for side in self.sides):
            self._set_running(False)
            self.sig_finished.emit()

    def _set_running(self, running: bool) -> None:
        self.running = running
        self.run_button.setEnabled(not running)
        self.stop_button.setEnabled(running)
        if running:
            self._redraw.start()
        else:
            self._redraw.stop()

    def _close_sides(self) -> None:
        self._starting = False
        for side in self.sides:
            side.close()

    def done(self, result: int) -> None:
        """Closing (Esc, the title bar, close()) cancels both replies and lets go of the
        backends; the window's chat backend is untouched."""
        self._close_sides()
        self._set_running(False)
        super().done(result)

    def showEvent(self, event: QShowEvent) -> None:
        """Fit the table to its rows once styled (the rows never change)."""
        super().showEvent(event)
        header = self.table.horizontalHeader()
        self.table.setFixedHeight(self.table.verticalHeader().length() + header.height()
                                  + 2 * self.table.frameWidth())

    def closeEvent(self, event: QCloseEvent) -> None:
        """close() on a hidden dialog skips done(); it must let go of the backends too."""
        self._close_sides()
        self._set_running(False)
        super().closeEvent(event)

    # ----- drawing -------------------------------------------------------------------------
    def _reset_curves(self) -> None:
        """One curve per side in each overlay plot, named for the legend."""
        self.itl_curves = self._new_curves(self.itl_plot, self.itl_curves)
        self.throughput_curves = self._new_curves(self.throughput_plot,
                                                  self.throughput_curves)

    def _new_curves(self, plot: pg.PlotWidget,
                    old: list[pg.PlotDataItem]) -> list[pg.PlotDataItem]:
        """The plot's two curves, emptied and named for this run's sides. Made once and
        reused; the key is a Qt label above the plots (pyqtgraph's in-plot LegendItem was
        freed by Python's garbage collector while its scene still painted it: a crash)."""
        curves = old or [plot.plot([], [], pen=style.pen(color)) for color in SIDE_COLORS]
        for curve, side in zip(curves, self.sides, strict=False):
            curve.setData([], [], name=side.label)
        self.legend.setText("&nbsp;&nbsp;&nbsp;".join(
            f'<span style="color:{color}">■</span> {html.escape(side.label)}'
            for side, color in zip(self.sides, SIDE_COLORS, strict=False)))
        return curves

    def refresh(self) -> None:
        """Redraw plots, table, replies and statuses from each side's state."""
        for i, side in enumerate(self.sides):
            self.reply_titles[i].setText(side.label)
            self.reply_status[i].setText(side.status())
            color = style.CHOSEN if side.error else style.MUTED
            self.reply_status[i].setStyleSheet(f"color: {color};")
            self._paint_text(self.replies[i], side.text)
            self._draw_curves(i, side)
        self._draw_ttft()
        self._fill_table()

    @staticmethod
    def _paint_text(view: QPlainTextEdit, text: str) -> None:
        shown = view.toPlainText()
        if text == shown:
            return
        if text.startswith(shown):  # append only the new part
            cursor = view.textCursor()
            cursor.movePosition(QTextCursor.MoveOperation.End)
            cursor.insertText(text[len(shown):])
        else:
            view.setPlainText(text)

    def _draw_curves(self, i: int, side: CompareSide) -> None:
        reply = side.session.replies.get(side.request_id or "")
        if reply is None or i >= len(self.itl_curves):
            return
        itl_ms = [s * 1e3 for s in reply.itl_s()]
        self.itl_curves[i].setData(list(range(1, len(itl_ms) + 1)), itl_ms)
        self.throughput_curves[i].setData(side.session.throughput_t,
                                          side.session.throughput)

    def _draw_ttft(self) -> None:
        heights = [side.result.metrics.ttft_s * 1e3 if side.result else 0.0
                   for side in self.sides]
        brushes = [style.brush(color) for color in SIDE_COLORS[: len(heights)]]
        self.ttft_bars.setOpts(x=list(range(len(heights))), height=heights,
                               brushes=brushes, pen=None)
        ticks = [(i, side.name) for i, side in enumerate(self.sides)]
        self.ttft_plot.getPlotItem().getAxis("bottom").setTicks([ticks])
        self.ttft_plot.setXRange(-0.6, 1.6, padding=0)

    def values(self, side: CompareSide) -> list[float | int | None] | None:
        """The table's column for a side: its result's metrics, None before one exists."""
        if side.result is None:
            return None
        return [value(side.result.metrics) for _, value in TABLE_ROWS]

    def _fill_table(self) -> None:
        columns = [self.values(side) for side in self.sides]
        for col, (side, values) in enumerate(zip(self.sides, columns, strict=True)):
            header = self.table.horizontalHeaderItem(col)
            if header is not None:
                header.setToolTip(side.label)
            for row in range(len(TABLE_ROWS)):
                self._set_cell(row, col, values[row] if values else None, values is None)
        if len(columns) == 2:
            a, b = columns
            for row in range(len(TABLE_ROWS)):
                r = ratio(a[row], b[row]) if a and b else None
                item = QTableWidgetItem(MISSING if r is None else f"{r:.2f}×")
                item.setData(Qt.ItemDataRole.UserRole, r)
                self.table.setItem(row, 2, item)

    def _set_cell(self, row: int, col: int, value: float | int | None, missing: bool) -> None:
        item = QTableWidgetItem(MISSING if missing else format_value(value))
        item.setData(Qt.ItemDataRole.UserRole, value)
        item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        self.table.setItem(row, col, item)
