"""The main window: conversations on the left, the chat in the middle, settings and HUD right.

The window owns the flow of a reply: save the user's message, submit to the engine (never
waiting on it), stream tokens into the view, save the partial reply in batches, and on the
end write the authoritative text, its settings and its metrics. Several replies may run at
once (the engine batches them): one per chat, or N alternatives in one chat, of which the
user keeps one.
"""

from __future__ import annotations

import contextlib
import html
import time
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from PySide6.QtCore import QByteArray, QCoreApplication, QSettings, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QCloseEvent, QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QDockWidget,
    QFrame,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QSplitter,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine import (
    ChatMessage,
    DraftModelChanged,
    GenerationRequest,
    GenerationResult,
    ModelInfo,
    RequestFailed,
    RequestFinished,
    TextFlushed,
    TokenEmitted,
)
from engine.params import Role
from engine.protocol import Backend
from engine.remote import REMOTE_SPEC
from ui.bridge import EngineBridge
from ui.chat_view import CPU_FLUSH_INTERVAL_MS, FLUSH_INTERVAL_MS, Alternative, ChatView
from ui.composer import Composer
from ui.controls import ControlsPanel
from ui.hud import HudWidget
from ui.model_picker import ModelPickerDialog
from ui.sidebar import Sidebar
from ui.store import DONE, STOPPED, STREAMING, ChatStore, Message, StoreError

SAVE_INTERVAL_MS = 500  # how often a streaming reply's text is written to the database
TITLE_CHARS = 48
FINISH_STATUS = {"stop": DONE, "length": "length", "cancelled": STOPPED, "error": "error"}
DEFAULT_ALTERNATIVES = 3  # the Alternatives link when the composer asks for one reply


@dataclass
class ActiveReply:
    """A reply being generated. Several run at once: one per chat, or a chat's alternatives."""

    request_id: str
    conversation_id: str
    message_id: int | None  # its saved row; None for an alternative (saved only if kept)
    user_message_id: int | None  # set when this send created the user message
    user_text: str
    text: str = ""  # everything received so far, painted or not
    label: str = "Assistant"
    alternative: int | None = None  # its index among the chat's alternatives


@dataclass
class AlternativeSet:
    """N alternatives of one reply in one chat: they stream, then wait for the user's pick."""

    request_ids: list[str]
    settings: dict[str, Any]
    results: dict[int, GenerationResult] = field(default_factory=dict)
    ended: int = 0  # finished or failed


class MainWindow(QMainWindow):
    """The Phasewise chat window."""

    sig_reply_started = Signal(str)
    """A request was submitted (its request id)."""
    sig_reply_finished = Signal(object)
    """A reply ended and was saved (its GenerationResult)."""
    sig_reply_failed = Signal(str)
    """A request failed; the one-line message is also shown in the notice bar."""
    sig_alternatives_ready = Signal(str)
    """Every alternative of a chat's set ended (its conversation id); one can be kept."""

    def __init__(
        self,
        engine: Backend,
        store: ChatStore,
        settings: QSettings,
        *,
        load_options: dict[str, Any] | None = None,
        hud_calibrate: bool = True,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setObjectName("mainWindow")
        self.setWindowTitle("Phasewise")
        self.engine = engine
        self.store = store
        self.settings = settings
        self.load_options = dict(load_options or {})
        self.bridge = EngineBridge(engine, self)
        self.model_info: ModelInfo | None = engine.model_info
        self.conversation_id: str | None = None
        self.replies: dict[str, ActiveReply] = {}  # running, by request id, oldest first
        self.alternative_sets: dict[str, AlternativeSet] = {}  # by conversation id
        self._editing_message_id: int | None = None

        self._build_widgets()
        self._build_docks(hud_calibrate)
        self._build_status_bar()
        self._build_menu()
        self._wire()
        self._save_timer = QTimer(self)
        self._save_timer.setInterval(SAVE_INTERVAL_MS)
        self._save_timer.timeout.connect(self._save_partial)
        self._restore_settings()
        self._show_model(self.model_info)
        self._open_initial_conversation()
        if store.recovered_from is not None:
            self.notify(f"The chat database was damaged; it was backed up to "
                        f"{store.recovered_from.name} and a new one was started.")
        if store.open_error is not None:
            self.notify(f"Chats will not be saved this session: {store.open_error}.")

    # ----- construction ------------------------------------------------------------------
    def _build_widgets(self) -> None:
        self.sidebar = Sidebar(self.store)
        self.chat = ChatView()
        self.composer = Composer()
        self.title_label = QLabel("New chat")
        self.title_label.setObjectName("chatTitle")
        self.plain_toggle = QToolButton()
        self.plain_toggle.setText("Plain text")
        self.plain_toggle.setCheckable(True)
        self.plain_toggle.setToolTip("Show replies as exact text instead of Markdown")
        self.model_button = QPushButton("Model…")
        self.model_button.setObjectName("modelButton")

        header = QFrame()
        header.setObjectName("chatHeader")
        row = QHBoxLayout(header)
        row.setContentsMargins(16, 8, 12, 8)
        row.addWidget(self.title_label, 1)
        row.addWidget(self.plain_toggle)
        row.addWidget(self.model_button)

        self.notice = QFrame()
        self.notice.setObjectName("noticeBar")
        self.notice_label = QLabel()
        self.notice_label.setWordWrap(True)
        close = QToolButton()
        close.setText("✕")
        close.setAutoRaise(True)
        close.clicked.connect(self.notice.hide)
        notice_row = QHBoxLayout(self.notice)
        notice_row.setContentsMargins(12, 6, 6, 6)
        notice_row.addWidget(self.notice_label, 1)
        notice_row.addWidget(close)
        self.notice.hide()

        center = QWidget()
        center.setObjectName("chatPane")
        column = QVBoxLayout(center)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(0)
        column.addWidget(header)
        column.addWidget(self.chat, 1)
        column.addWidget(self.notice)
        column.addWidget(self.composer)

        self.splitter = QSplitter()
        self.splitter.addWidget(self.sidebar)
        self.splitter.addWidget(center)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([240, 760])
        self.setCentralWidget(self.splitter)

    def _build_docks(self, hud_calibrate: bool) -> None:
        self.controls = ControlsPanel()
        self.hud = HudWidget(calibrate=hud_calibrate)  # tests skip the device calibration
        self.settings_dock = QDockWidget("Generation", self)
        self.settings_dock.setObjectName("settingsDock")
        self.settings_dock.setWidget(self.controls)
        self.hud_dock = QDockWidget("Performance", self)
        self.hud_dock.setObjectName("hudDock")
        self.hud_dock.setWidget(self.hud)
        area = Qt.DockWidgetArea.RightDockWidgetArea
        self.addDockWidget(area, self.settings_dock)
        self.addDockWidget(area, self.hud_dock)
        self.splitDockWidget(self.settings_dock, self.hud_dock, Qt.Orientation.Vertical)
        self.resizeDocks([self.settings_dock, self.hud_dock], [250, 650], Qt.Orientation.Vertical)
        self.resizeDocks([self.settings_dock], [430], Qt.Orientation.Horizontal)

    def _build_status_bar(self) -> None:
        bar = self.statusBar()
        self.model_label = QLabel()
        self.context_label = QLabel()
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)  # busy indicator: the loader reports stages, not percent
        self.progress.setMaximumWidth(140)
        self.progress.setTextVisible(False)
        self.progress.hide()
        self.load_label = QLabel()
        bar.addWidget(self.progress)
        bar.addWidget(self.load_label)
        bar.addPermanentWidget(self.context_label)
        bar.addPermanentWidget(self.model_label)

    def _build_menu(self) -> None:
        chat_menu = self.menuBar().addMenu("&Chat")
        self.new_action = QAction("New chat", self)
        self.new_action.setShortcut(QKeySequence.StandardKey.New)
        self.new_action.triggered.connect(self.new_chat)
        chat_menu.addAction(self.new_action)
        chat_menu.addAction("Choose model…", self.choose_model)
        chat_menu.addAction("Compare backends…", self.compare_backends)
        chat_menu.addSeparator()
        chat_menu.addAction("Quit", QKeySequence.StandardKey.Quit, self.close)
        view_menu = self.menuBar().addMenu("&View")
        view_menu.addAction(self.settings_dock.toggleViewAction())
        view_menu.addAction(self.hud_dock.toggleViewAction())
        help_menu = self.menuBar().addMenu("&Help")
        help_menu.addAction("About Phasewise", self.show_about)
        self.addAction(self.new_action)
        QShortcut(QKeySequence(Qt.Key.Key_Escape), self, self.composer.escape)

    def about_text(self) -> str:
        """The About box: version (set by the app from pyproject) and the loaded model."""
        version = QCoreApplication.applicationVersion() or "development build"
        model = self.model_info
        running = (
            f"<p>Model: {html.escape(model.name)} on {model.device} ({model.dtype})</p>"
            if model else ""
        )
        return (
            f"<h3>Phasewise {version}</h3>"
            "<p>Chat with local language models and see where the time goes: queue, "
            "prefill and decode, live.</p>" + running
        )

    def show_about(self) -> None:
        QMessageBox.about(self, "About Phasewise", self.about_text())

    def _wire(self) -> None:
        b = self.bridge
        b.sig_event.connect(self.hud.on_engine_event)
        b.sig_token.connect(self._on_token)
        b.sig_text_flushed.connect(self._on_text_flushed)
        b.sig_request_finished.connect(self._on_finished)
        b.sig_request_failed.connect(self._on_failed)
        b.sig_model_loading.connect(self._on_model_loading)
        b.sig_model_loaded.connect(self._on_model_loaded)
        b.sig_model_load_failed.connect(self._on_model_load_failed)
        b.sig_draft_changed.connect(self._on_draft_changed)
        b.sig_draft_load_failed.connect(self._on_draft_load_failed)
        self.chat.sig_tokens_painted.connect(self._on_tokens_painted)
        self.chat.sig_action.connect(self._on_message_action)
        self.composer.sig_send.connect(self.send)
        self.composer.sig_stop.connect(self.stop)
        self.composer.sig_cancel_edit.connect(self._cancel_edit)
        self.sidebar.sig_selected.connect(self.open_conversation)
        self.sidebar.sig_new.connect(self.new_chat)
        self.sidebar.sig_delete.connect(self.delete_conversation)
        self.sidebar.sig_store_error.connect(self._on_store_error)
        self.controls.sig_setting_changed.connect(
            lambda name, value: self.hud.mark_setting_change(name, value, time.perf_counter_ns())
        )
        self.controls.sig_system_prompt_changed.connect(self._on_system_prompt)
        self.controls.sig_draft_requested.connect(self.choose_draft_model)
        self.plain_toggle.toggled.connect(self.chat.set_plain_text)
        self.model_button.clicked.connect(self.choose_model)

    # ----- conversations -------------------------------------------------------------------
    def _open_initial_conversation(self) -> None:
        recent = self.store.conversations()
        if recent:
            self.open_conversation(recent[0].id)
        else:
            self.new_chat()

    def new_chat(self) -> None:
        """Start an empty chat; it is saved when the first message is sent."""
        self._leave_edit_mode()
        self.conversation_id = None
        self.title_label.setText("New chat")
        self.controls.set_system_prompt("")
        self.chat.show_messages([])
        self._update_busy()
        self.sidebar.refresh(select="")
        self.sidebar.list.clearSelection()
        self._show_context_fill(None)
        self.composer.editor.setFocus()

    def open_conversation(self, conv_id: str) -> None:
        conv = self.store.conversation(conv_id)
        if conv is None:
            return
        self._leave_edit_mode()
        self.conversation_id = conv_id
        self.title_label.setText(conv.title)
        self.controls.set_system_prompt(conv.system_prompt)
        self._render_conversation()
        self.sidebar.refresh(select=conv_id)
        self._update_busy()

    def delete_conversation(self, conv_id: str) -> None:
        self._stop_conversation(conv_id)
        self.alternative_sets.pop(conv_id, None)
        try:
            self.store.delete_conversation(conv_id)
        except StoreError as exc:
            self._on_store_error(str(exc))
            return
        self.engine.drop_conversation(conv_id)
        if conv_id == self.conversation_id:
            self.new_chat()
        else:
            self.sidebar.refresh()

    def _render_conversation(self) -> None:
        """Saved messages, finished alternatives, then this chat's live replies."""
        messages = self._visible_messages()
        self.chat.show_messages(messages, self._finished_alternatives(self.conversation_id))
        for reply in self._running(self.conversation_id):
            self.chat.begin_stream(reply.request_id, reply.label)
            self.chat.push_text(reply.request_id, reply.text)
        self.chat.flush()
        self._show_context_fill(messages)

    def _visible_messages(self) -> list[Message]:
        if self.conversation_id is None:
            return []
        streaming = {r.message_id for r in self.replies.values()}
        return [m for m in self.store.messages(self.conversation_id) if m.id not in streaming]

    def _finished_alternatives(self, conv_id: str | None) -> list[Alternative]:
        alts = self.alternative_sets.get(conv_id) if conv_id else None
        if alts is None:
            return []
        return [Alternative(i, f"Alternative {i + 1}", r.text,
                            FINISH_STATUS.get(r.finish_reason, DONE))
                for i, r in sorted(alts.results.items())]

    @property
    def reply(self) -> ActiveReply | None:
        """The most recently started reply still running (any chat), or None."""
        return next(reversed(self.replies.values()), None)

    def _running(self, conv_id: str | None) -> list[ActiveReply]:
        return [r for r in self.replies.values() if r.conversation_id == conv_id]

    def _on_system_prompt(self, text: str) -> None:
        if self.conversation_id is not None:
            try:
                self.store.set_system_prompt(self.conversation_id, text)
            except StoreError as exc:
                self._on_store_error(str(exc))

    # ----- sending -------------------------------------------------------------------------
    def send(self, text: str) -> bool:
        """Send the composer's text (or resend an edited message). False if refused."""
        if self._busy_refusal():
            return False
        if not text.strip():
            return self._refuse("Type a message first.")
        if self.model_info is None:
            return self._refuse("No model is loaded yet: wait for loading to finish, "
                                "or choose one with Model….")
        if self._draft_refusal(self.composer.alternative_count()):
            return False
        self.notice.hide()
        try:  # nothing is sent unless the message is saved; the composer keeps the text
            conv_id = self._ensure_conversation(text)
            if self._editing_message_id is not None:
                self.store.delete_from(conv_id, self._editing_message_id)
                self._leave_edit_mode()
            user_id = self.store.add_message(conv_id, "user", text)
        except StoreError as exc:
            return self._refuse(self._store_message(str(exc)))
        self.composer.editor.clear()
        return self._start_reply(conv_id, user_id, text)

    def regenerate(self, message_id: int, alternatives: int | None = None) -> None:
        """Replace a reply with a new one (or `alternatives` of them) from the same history
        (the prompt is all cached)."""
        if self._busy_refusal():
            return
        message = self.store.message(message_id)
        if message is None or message.role != "assistant":
            return
        if self._draft_refusal(alternatives or self.composer.alternative_count()):
            return  # before the old reply is deleted
        try:
            self.store.delete_from(message.conversation_id, message_id)
        except StoreError as exc:
            self._on_store_error(str(exc))
            return
        self._start_reply(message.conversation_id, None, "", alternatives)

    def generate_alternatives(self, message_id: int) -> None:
        """Replace a reply with N alternatives streaming at once (N from the composer, at
        least two); the user keeps one."""
        count = self.composer.alternative_count()
        self.regenerate(message_id, count if count > 1 else DEFAULT_ALTERNATIVES)

    def keep_alternative(self, index: int) -> bool:
        """Save alternative `index` of the current chat as its reply; discard the others
        (any still running are stopped). False if there is no such finished alternative."""
        conv_id = self.conversation_id
        alts = self.alternative_sets.get(conv_id) if conv_id else None
        result = alts.results.get(index) if alts else None
        if alts is None or result is None or conv_id is None:
            return False
        for request_id in alts.request_ids:
            if self.replies.pop(request_id, None) is not None:
                self.engine.cancel(request_id)
                self.chat.end_stream(request_id)
        del self.alternative_sets[conv_id]
        self.engine.keep_alternative(conv_id, index, len(alts.request_ids))
        status = FINISH_STATUS.get(result.finish_reason, DONE)
        try:
            message_id = self.store.add_message(conv_id, "assistant", result.text,
                                                status=status, settings=alts.settings)
            self.store.finish_message(message_id, result.text, status, _metrics_dict(result))
        except StoreError as exc:
            self._on_store_error(str(exc))
        self._render_conversation()
        self._update_busy()
        self.sidebar.refresh()
        return True

    def edit(self, message_id: int) -> None:
        """Put a user message back in the composer; sending replaces it and what followed."""
        if self._busy_refusal():
            return
        message = self.store.message(message_id)
        if message is None or message.role != "user":
            return
        self._editing_message_id = message_id
        self.composer.set_text(message.content)
        self.composer.set_editing(True)
        self.composer.editor.setFocus()

    def stop(self) -> None:
        """Stop the current chat's running replies; the engine stops within one decode step."""
        self._stop_conversation(self.conversation_id)

    def _stop_conversation(self, conv_id: str | None) -> None:
        for reply in self._running(conv_id):
            self.engine.cancel(reply.request_id)

    def _start_reply(self, conv_id: str, user_id: int | None, user_text: str,
                     alternatives: int | None = None) -> bool:
        params = self.controls.params()
        request = GenerationRequest(self._history(conv_id), params, conversation_id=conv_id,
                                    speculative=self.controls.speculative_mode())
        settings = asdict(params) | {"model": self.model_info.name if self.model_info else ""}
        count = alternatives or self.composer.alternative_count()
        if count > 1:
            started = self._start_alternatives(request, count, user_id, user_text, settings)
        else:
            started = self._start_single(request, user_id, user_text, settings)
        if not started:
            return False
        if conv_id == self.conversation_id:
            self._render_conversation()
        self._update_busy()
        self.sidebar.refresh()
        return True

    def _start_single(self, request: GenerationRequest, user_id: int | None, user_text: str,
                      settings: dict[str, Any]) -> bool:
        conv_id = request.conversation_id or ""
        try:
            reply_id = self.store.add_message(conv_id, "assistant", "", status=STREAMING,
                                              settings=settings)
        except StoreError as exc:
            self._on_store_error(str(exc))
            if conv_id == self.conversation_id:
                self._render_conversation()
            return False
        self.replies[request.request_id] = ActiveReply(request.request_id, conv_id, reply_id,
                                                       user_id, user_text)
        self._save_timer.start()
        self.engine.submit(request)
        self.sig_reply_started.emit(request.request_id)
        return True

    def _start_alternatives(self, request: GenerationRequest, count: int, user_id: int | None,
                            user_text: str, settings: dict[str, Any]) -> bool:
        """N replies to one prompt, streaming at once; nothing is saved until one is kept."""
        conv_id = request.conversation_id or ""
        # the local engine prefills once for all; a remote backend sends N requests
        ids = [h.request_id for h in self.engine.submit_alternatives(request, count)]
        for i, request_id in enumerate(ids):
            # each knows the user message: if the whole set fails, the last one takes it back
            self.replies[request_id] = ActiveReply(
                request_id, conv_id, None, user_id, user_text,
                label=f"Alternative {i + 1}", alternative=i)
            self.sig_reply_started.emit(request_id)
        self.alternative_sets[conv_id] = AlternativeSet(ids, settings)
        return True

    def _history(self, conv_id: str) -> list[ChatMessage]:
        conv = self.store.conversation(conv_id)
        history = []
        if conv is not None and conv.system_prompt.strip():
            history.append(ChatMessage("system", conv.system_prompt))
        for m in self.store.messages(conv_id):
            if m.content and m.status != "error" and m.role in ("user", "assistant"):
                history.append(ChatMessage(cast(Role, m.role), m.content))
        return history

    def _ensure_conversation(self, first_text: str) -> str:
        if self.conversation_id is None:
            first_line = first_text.strip().splitlines()[0]
            title = first_line if len(first_line) <= TITLE_CHARS else (
                first_line[: TITLE_CHARS - 1].rstrip() + "…")
            system = self.controls.system_prompt.toPlainText()
            self.conversation_id = self.store.create_conversation(title, system)
            self.title_label.setText(title)
            self.sidebar.refresh(select=self.conversation_id)
        return self.conversation_id

    # ----- engine events -----------------------------------------------------------------
    def _on_token(self, event: TokenEmitted) -> None:
        reply = self.replies.get(event.request_id)
        if reply is not None:
            reply.text += event.text
            self.chat.push_token(event.request_id, event.index, event.text)

    def _on_text_flushed(self, event: TextFlushed) -> None:
        reply = self.replies.get(event.request_id)
        if reply is not None:
            reply.text += event.text
            self.chat.push_text(event.request_id, event.text)

    def _on_tokens_painted(self, request_id: str, indexes: list, painted_ns: int) -> None:
        for index in indexes:
            self.hud.on_token_painted(request_id, index, painted_ns)

    def _on_finished(self, event: RequestFinished) -> None:
        reply, result = self.replies.get(event.request_id), event.result
        if reply is None:
            return
        self._end_reply(reply)
        if reply.message_id is None:
            self._alternative_ended(reply, result)
            self.sig_reply_finished.emit(result)
            return
        status = FINISH_STATUS.get(result.finish_reason, DONE)
        try:
            self.store.finish_message(reply.message_id, result.text, status,
                                      _metrics_dict(result))
        except StoreError as exc:
            # The full reply stays on screen (not re-rendered from the store); what was
            # saved before stays saved and is marked stopped on the next start.
            self._on_store_error(str(exc))
            self.sidebar.refresh()
        else:
            self._after_reply(reply)
        if result.error:  # a remote reply broke off: its partial text was saved above
            self.notify(f"The reply broke off: {result.error}. The partial reply was kept.")
        elif result.notice:
            self.notify(f"Note: {result.notice}.")
        self.sig_reply_finished.emit(result)

    def _on_failed(self, event: RequestFailed) -> None:
        reply = self.replies.get(event.request_id)
        if reply is None:
            return
        self._end_reply(reply)
        if reply.message_id is None and not self._alternative_ended(reply, None):
            return  # other alternatives of the set are still good
        try:
            if reply.message_id is not None:
                self.store.delete_message(reply.message_id)
            if reply.user_message_id is not None:
                # The request never ran (e.g. too long for the context) or broke off (out of
                # memory): take the message back into the composer so nothing typed is lost.
                self.store.delete_message(reply.user_message_id)
        except StoreError:
            pass  # the notice below matters more; a leftover row is marked stopped later
        if reply.user_message_id is not None and not self.composer.text().strip():
            self.composer.set_text(reply.user_text)
        self._after_reply(reply)
        self.notify(event.message)
        self.sig_reply_failed.emit(event.message)

    def _end_reply(self, reply: ActiveReply) -> None:
        self.replies.pop(reply.request_id, None)
        self.chat.end_stream(reply.request_id)
        if not any(r.message_id is not None for r in self.replies.values()):
            self._save_timer.stop()
        self._update_busy()

    def _alternative_ended(self, reply: ActiveReply, result: GenerationResult | None) -> bool:
        """Record an alternative's end; True if its whole set failed (then it is dropped)."""
        alts = self.alternative_sets.get(reply.conversation_id)
        if alts is None or reply.alternative is None:
            return False
        alts.ended += 1
        if result is not None:
            alts.results[reply.alternative] = result
        complete = alts.ended == len(alts.request_ids)
        if complete and not alts.results:
            del self.alternative_sets[reply.conversation_id]
            return True
        self._after_reply(reply)
        if complete:
            self.sig_alternatives_ready.emit(reply.conversation_id)
        return False

    def _after_reply(self, reply: ActiveReply) -> None:
        if reply.conversation_id == self.conversation_id:
            self._render_conversation()
        self._update_busy()
        self.sidebar.refresh()

    def _update_busy(self) -> None:
        """The composer's Stop button follows the chat on screen."""
        self.composer.set_busy(bool(self._running(self.conversation_id)))

    def _save_partial(self) -> None:
        for reply in list(self.replies.values()):
            if reply.message_id is None:
                continue
            try:
                self.store.save_partial(reply.message_id, reply.text)
            except StoreError as exc:  # keep streaming; the next batch tries again
                self._on_store_error(str(exc))
                return

    def _on_store_error(self, message: str) -> None:
        self.notify(self._store_message(message))

    @staticmethod
    def _store_message(message: str) -> str:
        return (f"Not saved: {message.rstrip('.')}. Chats saved earlier are safe; free some "
                "disk space or check the file's permissions, then try again.")

    # ----- message actions -------------------------------------------------------------------
    def _on_message_action(self, action: str, message_id: int) -> None:
        if action == "copy":
            message = self.store.message(message_id)
            if message is not None:
                QGuiApplication.clipboard().setText(message.content)
                self.statusBar().showMessage("Copied to the clipboard", 2000)
        elif action == "edit":
            self.edit(message_id)
        elif action == "regenerate":
            self.regenerate(message_id)
        elif action == "alternatives":
            self.generate_alternatives(message_id)
        elif action == "keep":
            self.keep_alternative(message_id)

    def _draft_refusal(self, count: int) -> bool:
        """Refuse a single reply in Draft model mode while no draft is loaded (alternatives
        decode plainly, in one batch)."""
        waiting = self.controls.speculative_mode() == "draft" and self.controls.draft_name is None
        if count == 1 and waiting:
            self._refuse("No draft model is loaded yet: wait for it, or set Speculative to Off "
                         "(Generation → Advanced).")
            return True
        return False

    def _busy_refusal(self) -> bool:
        """Refuse to start in the chat on screen while it is writing or awaiting a pick
        (other chats may be writing: their replies run alongside)."""
        if self._running(self.conversation_id):
            self._refuse("A reply is still being written: press Esc to stop it first.")
            return True
        if self.conversation_id in self.alternative_sets:
            self._refuse("Keep one of the alternatives first (the Keep this one link).")
            return True
        return False

    def _cancel_edit(self) -> None:
        self._editing_message_id = None

    def _leave_edit_mode(self) -> None:
        self._editing_message_id = None
        if self.composer.editing:
            self.composer.set_editing(False)

    # ----- model -------------------------------------------------------------------------
    def choose_model(self) -> None:
        dialog = ModelPickerDialog(self)
        if dialog.exec():
            choice = dialog.choice()
            self.load_model(choice.spec, **choice.options)

    def choose_draft_model(self) -> None:
        """Pick a draft model for speculative decoding; the engine loads it in its thread."""
        dialog = ModelPickerDialog(self)
        dialog.setWindowTitle("Choose a draft model")
        if not dialog.exec():
            self.controls.keep_loaded_draft()
            return
        choice = dialog.choice()
        if choice.spec == REMOTE_SPEC:
            self.notify("A draft model runs locally: choose a folder, a .gguf file or a hub id.")
            self.controls.keep_loaded_draft()
            return
        self.progress.show()
        self.load_label.setText(f"Loading draft model {choice.spec}…")
        self.engine.load_draft(choice.spec, **(self.load_options | choice.options))

    def compare_backends(self) -> Any:
        """Open Compare mode: the composer's prompt on two backends, overlaid (the chat's
        backend is not disturbed). Returns the dialog."""
        from ui.compare import CompareDialog

        dialog = CompareDialog.for_engine(self.engine, self.controls.params(),
                                          self.composer.text(), self)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.show()
        return dialog

    def load_model(self, spec: str, **options: Any) -> None:
        """Ask the engine to load a model in its thread; progress shows in the status bar."""
        self.progress.show()
        self.load_label.setText(f"Loading {spec}…")
        self.engine.load_model(spec, **(self.load_options | options))

    def _on_model_loading(self, stage: str) -> None:
        self.progress.show()
        self.load_label.setText(stage)

    def _on_model_loaded(self, info: ModelInfo) -> None:
        self.progress.hide()
        self.load_label.setText(f"Loaded {info.name}")
        self._show_model(info)
        self.controls.set_speculative_available(bool(self.engine.capabilities.speculative))

    def _on_draft_changed(self, event: DraftModelChanged) -> None:
        self.progress.hide()
        if event.name is not None:
            self.load_label.setText(f"Draft model {event.name} ({event.kernel})")
        elif self.controls.draft_name is not None:
            self.load_label.setText("Draft model dropped (it was for the previous model)")
        self.controls.set_draft_model(event.name)

    def _on_draft_load_failed(self, message: str) -> None:
        self.progress.hide()
        self.load_label.clear()
        kept = (f" Still drafting with {self.controls.draft_name}."
                if self.controls.draft_name else "")
        self.notify(f"Draft model not loaded: {message.rstrip('.')}.{kept}")
        self.controls.keep_loaded_draft()

    def _on_model_load_failed(self, message: str) -> None:
        self.progress.hide()
        self.load_label.clear()
        kept = f" Still using {self.model_info.name}." if self.model_info else ""
        self.notify(f"Model not loaded: {message.rstrip('.')}.{kept}")

    def _show_model(self, info: ModelInfo | None) -> None:
        self.model_info = info
        if info is None:
            self.model_label.setText("no model")
            return
        self.model_label.setText(f"{info.name}  ·  {info.device}  ·  {info.dtype}")
        if info.template_fallback:
            self.notify(f"{info.name} has no chat template; using a plain "
                        "'User: / Assistant:' format, so replies may be weaker.")
        self.controls.set_context_length(info.context_length)
        self._show_context_fill(self._visible_messages())
        self._set_text_rate(CPU_FLUSH_INTERVAL_MS if info.device == "cpu" else FLUSH_INTERVAL_MS)

    def _set_text_rate(self, interval_ms: int) -> None:
        """Streaming text is handed over and painted at one rate; the HUD judges render lag
        against it."""
        self.chat.set_flush_interval(interval_ms)
        self.bridge.min_drain_interval_s = interval_ms / 1000
        self.hud.set_text_interval(interval_ms / 1000)

    def _show_context_fill(self, messages: list[Message] | None) -> None:
        ctx = self.model_info.context_length if self.model_info else 0
        last = next((m.metrics for m in reversed(messages or []) if m.metrics), None)
        if not ctx:
            self.context_label.setText("")
            return
        used = (last["prompt_tokens"] + last["output_tokens"]) if last else 0
        self.context_label.setText(f"context {used:,} / {ctx:,} ({100 * used / ctx:.0f}%)")

    # ----- notices, settings, closing ----------------------------------------------------------
    def notify(self, message: str) -> None:
        """Show a one-line message above the composer until dismissed."""
        self.notice_label.setText(message)
        self.notice.show()

    def _refuse(self, message: str) -> bool:
        self.notify(message)
        return False

    def _restore_settings(self) -> None:
        geometry = self.settings.value("window/geometry")
        if isinstance(geometry, QByteArray) and not geometry.isEmpty():
            self.restoreGeometry(geometry)
        else:
            self.resize(1320, 820)
        state = self.settings.value("window/state")
        if isinstance(state, QByteArray) and not state.isEmpty():
            self.restoreState(state)
        self.controls.restore(self.settings)

    def save_settings(self) -> None:
        self.settings.setValue("window/geometry", self.saveGeometry())
        self.settings.setValue("window/state", self.saveState())
        self.controls.save(self.settings)
        self.settings.sync()

    def closeEvent(self, event: QCloseEvent) -> None:
        """Cancel running replies, keep their partial text (marked stopped), save settings.
        Alternatives nobody kept are discarded."""
        for reply in list(self.replies.values()):
            self.engine.cancel(reply.request_id)
            self._end_reply(reply)
            if reply.message_id is not None:
                with contextlib.suppress(StoreError):  # else the next start marks it stopped
                    self.store.finish_message(reply.message_id, reply.text, STOPPED)
        self.bridge.detach()
        self.save_settings()
        super().closeEvent(event)


def _metrics_dict(result: GenerationResult) -> dict[str, Any]:
    """What a saved reply records: its metrics plus the model that wrote it."""
    metrics = result.metrics.to_dict()
    if result.model is not None:
        metrics.update(model=result.model.name, device=result.model.device,
                       dtype=result.model.dtype, context_length=result.model.context_length)
    return metrics
