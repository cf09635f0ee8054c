"""The main window: conversations on the left, the chat in the middle, settings and HUD right.

The window builds the widgets, wires them to a ChatSession (ui/session.py: the flow of replies
between the store and the backend, without Qt) and to the backend's events, and renders what
the session reports. Several replies may run at once (the engine batches them): one per chat,
or N alternatives in one chat, of which the user keeps one.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from PySide6.QtCore import QSettings, Qt, QTimer, Signal
from PySide6.QtGui import QCloseEvent, QCursor, QGuiApplication
from PySide6.QtWidgets import (
    QDockWidget,
    QMainWindow,
    QMenu,
    QMessageBox,
    QSizePolicy,
    QSplitter,
    QToolTip,
    QWidget,
)

from engine import (
    GenerationResult,
    ModelInfo,
    TextFlushed,
    TokenEmitted,
)
from engine.hud_model import saved_request_id
from engine.params import MAX_ALTERNATIVES
from engine.protocol import Backend
from ui.about import confirm
from ui.bridge import EngineBridge
from ui.chat_export import STATUS_MS, ChatExports
from ui.chat_pane import ChatPane, LoadStatus
from ui.chat_view import CPU_FLUSH_INTERVAL_MS, FLUSH_INTERVAL_MS, Alternative, ChatView
from ui.composer import Composer
from ui.controls import ControlsPanel
from ui.dock_widths import DockWidths
from ui.drafts import Drafts
from ui.hud import HudWidget
from ui.hud.history import saved_chat
from ui.model_loads import ModelLoads
from ui.session import (
    FINISH_STATUS,
    ActiveReply,
    ChatSession,
    ReplyOptions,
    Until,
    default_alternatives,
    store_message,
)
from ui.shortcuts import WindowMenus
from ui.sidebar import Sidebar
from ui.store import DONE, ChatStore, Conversation, Message
from ui.theme import FocusRing
from ui.window_settings import restore_layout, save_layout

SAVE_INTERVAL_MS = 500  # how often a streaming reply's text is written to the database
DOCK_WIDTH = 430  # the settings and HUD column's first width
# The chat column's narrowest: a small window squeezes the docks (down to their own minimum
# widths) before the chat gets narrower than this.
CHAT_MIN_WIDTH = 340
ALTERNATIVE_CHOICES = (2, 3, 4)  # the Alternatives… link's menu (and × N's count if not here)


class MainWindow(QMainWindow):
    """The Phasewise chat window (the SessionView of its ChatSession)."""

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
        self.session = ChatSession(engine, store, self)
        self._saved_context = 0  # tokens the chat on screen's last saved reply left

        self._build_widgets()
        self._build_docks(hud_calibrate)
        self._build_status_bar()
        self.menus = WindowMenus(self)
        self._set_focus_chain()
        self.focus_ring = FocusRing(self)
        self._wire()
        self._save_timer = QTimer(self)
        self._save_timer.setInterval(SAVE_INTERVAL_MS)
        self._save_timer.timeout.connect(self.session.save_partial)
        restore_layout(self, self.controls, settings)
        self.dock_widths.load(settings)
        self._show_model(engine.model_info)
        self._open_initial_conversation()
        if store.recovered_from is not None:
            self.notify(f"The chat database was damaged; it was backed up to "
                        f"{store.recovered_from.name} and a new one was started.")
        if store.open_error is not None:
            self.notify(f"Chats will not be saved this session: {store.open_error}.")

    # ----- the session's state, as the window shows it ----------------------------------------
    @property
    def conversation_id(self) -> str | None:
        """The chat on screen (None: a new chat, saved with its first message)."""
        return self.session.conversation_id

    @property
    def model_info(self) -> ModelInfo | None:
        return self.session.model_info

    @property
    def reply(self) -> ActiveReply | None:
        """The most recently started reply still running (any chat), or None."""
        return self.session.reply

    # ----- construction ------------------------------------------------------------------
    def _build_widgets(self) -> None:
        self.sidebar = Sidebar(self.store)
        self.chat = ChatView()
        self.composer = Composer()
        self.drafts = Drafts(self.settings, self.composer)
        self.pane = ChatPane(self.chat, self.composer)
        self.pane.setMinimumWidth(CHAT_MIN_WIDTH)
        self.notice, self.notice_label = self.pane.notice, self.pane.notice_label  # for tests
        self.splitter = QSplitter()
        self.splitter.addWidget(self.sidebar)
        self.splitter.addWidget(self.pane)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([240, 760])
        self.setCentralWidget(self.splitter)

    def _build_docks(self, hud_calibrate: bool) -> None:
        self.controls = ControlsPanel()
        # The settings never grow past what they show: height the window gains goes to the
        # HUD, which has panels to fill it (else a trip to a small window and back, or a
        # restart after one, leaves the HUD squashed to its headline).
        self.controls.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)
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
        self.resizeDocks([self.settings_dock], [DOCK_WIDTH], Qt.Orientation.Horizontal)
        self.dock_widths = DockWidths(self, self.settings_dock, DOCK_WIDTH)

    def _build_status_bar(self) -> None:
        self.status = LoadStatus(self.statusBar())
        self.progress, self.load_label = self.status.progress, self.status.load_label
        self.context_label = self.status.context_label

    def _set_focus_chain(self) -> None:
        """Tab goes message → replies count → Send → the settings in reading order → the
        chat list (New chat, search, chats) → the HUD's picker, menus and panels → the chat's
        header → the transcript (its links) → back to the message. The plain-text boxes pass
        Tab on instead of typing it."""
        chain = [self.composer.editor, self.composer.alternatives, self.composer.button,
                 *self.controls.focus_order(),
                 self.sidebar.new_button, self.sidebar.search, self.sidebar.list,
                 *self.hud.focus_order(),
                 self.pane.plain_toggle, self.pane.model_button, self.chat]
        for first, second in itertools.pairwise(chain):
            QWidget.setTabOrder(first, second)

    def _wire(self) -> None:
        self.chat_exports = ChatExports(  # any saved chat's stats, from the menus
            self.store, self.hud, self, self._export_done,
            lambda text: self.notify(text, "export"))
        self.sidebar.sig_export.connect(self.chat_exports.ask)
        b = self.bridge
        b.sig_event.connect(self.hud.on_engine_event)
        b.sig_prefill_progress.connect(self.chat.show_prefill_progress)
        b.sig_prefill_started.connect(self.session.on_prefill_started)
        b.sig_prefill_started.connect(lambda _event: self._show_context_fill(None))
        b.sig_token.connect(self._on_token)
        b.sig_text_flushed.connect(self._on_text_flushed)
        b.sig_request_finished.connect(self.session.on_finished)
        b.sig_request_failed.connect(self.session.on_failed)
        b.sig_model_loaded.connect(self._show_model)
        self.controls.speculative.activated.connect(self._draft_notices_end)  # the user's pick
        self.loads = ModelLoads(self, self.engine, b, self.status, self.controls, self.notify,
                                self.load_options, self.settings)
        b.sig_draft_changed.connect(self._draft_notices_end)  # after the controls know it
        self.chat.sig_tokens_painted.connect(self._on_tokens_painted)
        self.chat.sig_action.connect(self._on_message_action)
        self.composer.sig_send.connect(self.send)
        self.composer.sig_stop.connect(self.stop)
        self.composer.sig_cancel_edit.connect(self._cancel_edit)
        self.sidebar.sig_selected.connect(self.open_conversation)
        self.sidebar.sig_new.connect(self.new_chat)
        self.sidebar.sig_delete.connect(self.delete_conversation)
        self.sidebar.sig_renamed.connect(self._on_renamed)
        self.sidebar.sig_store_error.connect(lambda message: self.notify(store_message(message)))
        self.controls.sig_setting_changed.connect(
            lambda name, value: self.hud.mark_setting_change(name, value, time.perf_counter_ns())
        )
        self.controls.sig_system_prompt_changed.connect(self.session.set_system_prompt)
        self.controls.temperature.valueChanged.connect(
            lambda value: self.composer.allow_alternatives(value > 0))  # greedy: one reply
        self.pane.sig_choose_model.connect(self.choose_model)

    # ----- conversations -------------------------------------------------------------------
    def _open_initial_conversation(self) -> None:
        recent = self.store.conversations()
        if recent:
            self.open_conversation(recent[0].id)
        else:
            self.new_chat()

    def new_chat(self) -> None:
        """Start an empty chat; it is saved when the first message is sent."""
        self.drafts.stash()
        self._leave_edit_mode()
        self.session.conversation_id = None
        self.drafts.take(None)
        self.pane.set_title("New chat")
        self.controls.set_system_prompt("")
        self.chat.show_messages([])
        self._update_busy()
        self.sidebar.refresh(select="")
        self.sidebar.clear_selection()
        self._show_context_fill([])
        self._show_chat_history(None, [])
        self.composer.focus()

    def open_conversation(self, conv_id: str) -> None:
        conv = self.store.conversation(conv_id)
        if conv is None:
            return
        self.drafts.stash()
        self._leave_edit_mode()
        self.session.conversation_id = conv_id
        self.drafts.take(conv_id)
        self.pane.set_title(conv.title)
        self.controls.set_system_prompt(conv.system_prompt)
        self._show_conversation(conv)
        self.sidebar.refresh(select=conv_id)
        self._update_busy()

    def switch_chat(self, step: int) -> None:
        """Open the next (step 1) or previous (-1) chat in the sidebar's list, wrapping."""
        self.sidebar.step(self.conversation_id, step)  # the sidebar reports it: the chat opens

    def delete_current_chat(self) -> None:
        if self.conversation_id is not None:
            self.delete_conversation(self.conversation_id)

    def _on_renamed(self, conv_id: str, title: str) -> None:
        if conv_id == self.conversation_id:
            self.pane.set_title(title)
        self.hud.rename_chat(conv_id, title)

    def delete_conversation(self, conv_id: str) -> None:
        """Delete a chat after the user confirms (its replies are stopped)."""
        conv = self.store.conversation(conv_id)
        if conv is None or not confirm(self, "Delete chat",
                                       f"Delete “{conv.title}” and all its messages? "
                                       "This cannot be undone."):
            return
        if not self.session.delete_conversation(conv_id):
            return
        self.drafts.deleted(conv_id)
        if conv_id == self.conversation_id:
            self.new_chat()
        else:
            self.sidebar.refresh()

    def _show_conversation(self, conv: Conversation | None) -> None:
        """The chat on screen in the view and in the HUD's history, from one read of its
        messages (None: it is not in the store, so nothing saved shows)."""
        saved = self.store.messages(conv.id) if conv is not None else []
        self._render_conversation(saved)
        self._show_chat_history(conv, saved)

    def _render_conversation(self, saved: list[Message]) -> None:
        """Saved messages, then this chat's alternatives in their order, finished or still
        streaming (one that ends first never jumps ahead), then its other live replies."""
        messages = self.session.visible_messages(saved)
        finished = {i: Alternative(i, f"Alternative {i + 1}", r.text,
                                   FINISH_STATUS.get(r.finish_reason, DONE))
                    for i, r in self.session.finished_alternatives(self.conversation_id)}
        running = self.session.running(self.conversation_id)
        live = {r.alternative: r for r in running if r.alternative is not None}
        first_live = min(live, default=MAX_ALTERNATIVES)
        self.chat.show_messages(messages, [finished[i] for i in sorted(finished)
                                           if i < first_live])
        for index in sorted(i for i in finished.keys() | live.keys() if i >= first_live):
            if index in live:
                self._show_live(live[index])
            else:
                self.chat.add_alternative(finished[index])  # after the live ones before it
        for reply in running:
            if reply.alternative is None:
                self._show_live(reply)
        self.chat.flush()
        self._show_context_fill(messages)

    def _show_live(self, reply: ActiveReply) -> None:
        self.chat.begin_stream(reply.request_id, reply.label)
        self.chat.push_text(reply.request_id, reply.text)

    def _show_chat_history(self, conv: Conversation | None, saved: list[Message]) -> None:
        """The HUD's per-turn panels follow the chat on screen: its saved replies as history
        (a new chat has none yet)."""
        self.hud.show_chat(None if conv is None else saved_chat(conv.id, conv.title, saved))

    def _update_busy(self) -> None:
        """The composer's Stop button follows the chat on screen, and so do notices about it
        (a refusal while it was writing or awaiting a pick)."""
        running = bool(self.session.running(self.conversation_id))
        self.composer.set_busy(running)
        if not running:
            self.pane.cause_ended("reply")
        if self.conversation_id not in self.session.alternative_sets:
            self.pane.cause_ended("pick")

    # ----- what users do (the session decides, the window shows) ---------------------------------
    def reply_options(self) -> ReplyOptions:
        return ReplyOptions(self.controls.params(), self.controls.speculative_mode(),
                            self.composer.alternative_count(),
                            self.controls.draft_name is not None,
                            self.controls.system_prompt_text(), self.controls.overflow_mode())

    def send(self, text: str) -> bool:
        """Send the composer's text (or resend an edited message). False if refused; then
        the composer keeps the text (a No to the resend question included)."""
        editing = self.session.editing_message_id
        if editing is not None and text.strip() and not self._confirm_resend(editing):
            return False
        return self.session.send(text, self.reply_options())

    def _confirm_resend(self, message_id: int) -> bool:
        """Resending an edited earlier message drops the turns after it: asked first, once
        the edit is written (a No keeps the edited text in the composer, still editing)."""
        later = self.session.later_turns(message_id)
        return not later or confirm(
            self, "Edit & resend",
            f"Resending this message deletes its reply and the {later} later "
            f"turn{'s' if later > 1 else ''} of this chat. Resend it?")

    def regenerate(self, message_id: int, alternatives: int | None = None) -> None:
        """Replace a reply with a new one (or `alternatives` of them) from the same history."""
        self.session.regenerate(message_id, self.reply_options(), alternatives)

    def generate_alternatives(self, message_id: int, count: int | None = None) -> None:
        """Replace a reply with `count` alternatives (None: the × N box's count, or 3)."""
        self.session.generate_alternatives(message_id, self.reply_options(), count)

    def ask_alternatives(self, message_id: int) -> QMenu | None:
        """The Alternatives… link: a menu of how many (2 to 4, and × N's count if more; the
        count it offers first in bold), at the pointer. At temperature 0 the refusal shows
        at once instead (None)."""
        options = self.reply_options()
        if options.params.greedy:
            self.generate_alternatives(message_id)  # says why there are none
            return None
        offered = default_alternatives(options)
        menu = QMenu(self)
        menu.setObjectName("alternativesMenu")
        menu.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        for count in sorted({*ALTERNATIVE_CHOICES, offered}):
            action = menu.addAction(f"{count} alternatives",
                                    partial(self.generate_alternatives, message_id, count))
            if count == offered:
                menu.setDefaultAction(action)
                menu.setActiveAction(action)
        menu.popup(QCursor.pos())
        return menu

    def keep_alternative(self, index: int) -> bool:
        """Save alternative `index` of the current chat as its reply; discard the others."""
        return self.session.keep_alternative(index)

    def edit(self, message_id: int) -> None:
        """Put a user message back in the composer; sending replaces it and what followed
        (asked at the resend when later turns would go: nothing is lost until then)."""
        text = self.session.begin_edit(message_id)
        if text is not None:
            self.composer.set_text(text)
            self.composer.set_editing(True)
            self.composer.focus()

    def stop(self) -> None:
        """Stop the current chat's running replies; the engine stops within one decode step."""
        self.session.stop(self.conversation_id)

    def copy(self, message_id: int) -> None:
        message = self.store.message(message_id)
        if message is not None:
            QGuiApplication.clipboard().setText(message.content)
            self.statusBar().showMessage("Copied to the clipboard", 2000)

    def show_reply_stats(self, message_id: int) -> None:
        """The full breakdown of a saved reply (a click on its stats line)."""
        message = self.store.message(message_id)
        if message is not None and message.stats is not None:
            QToolTip.showText(QCursor.pos(), message.stats.details(), self.chat)
            self.hud.select_reply(saved_request_id(message_id))  # its panels, until a new one

    def _on_message_action(self, action: str, message_id: int) -> None:
        """A link under a message (keep's argument is the alternative's index)."""
        handlers: dict[str, Callable[[int], object]] = {
            "copy": self.copy, "edit": self.edit, "regenerate": self.regenerate,
            "alternatives": self.ask_alternatives, "keep": self.keep_alternative,
            "stats": self.show_reply_stats}
        if action in handlers:
            handlers[action](message_id)

    def _cancel_edit(self) -> None:
        self.session.editing_message_id = None

    def _leave_edit_mode(self) -> None:
        self.session.editing_message_id = None
        if self.composer.editing:
            self.composer.set_editing(False)

    # ----- SessionView: what the session reports -------------------------------------------------
    def conversation_created(self, conv_id: str, title: str) -> None:
        self.drafts.created(conv_id)
        self.pane.set_title(title)
        self.sidebar.refresh(select=conv_id)
        conv = self.store.conversation(conv_id)
        self._show_chat_history(conv, self.store.messages(conv_id) if conv is not None else [])

    def message_saved(self) -> None:
        self.pane.hide_notice()
        self.composer.clear()
        self.drafts.sent()
        self._leave_edit_mode()

    def reply_started(self, reply: ActiveReply) -> None:
        conv = self.store.conversation(reply.conversation_id)
        if conv is not None:  # the HUD's reply picker names it "chat · turn N"
            turn = sum(m.role == "user" for m in self.store.messages(conv.id))
            self.hud.name_reply(reply.request_id, conv.title, turn, chat_id=conv.id)
        self._show_streaming_chats()
        self.sig_reply_started.emit(reply.request_id)

    def reply_ended(self, reply: ActiveReply) -> None:
        self.chat.end_stream(reply.request_id)
        self._update_busy()
        self._show_streaming_chats()

    def _show_streaming_chats(self) -> None:
        """The sidebar marks every chat with a reply being written (on screen or not)."""
        self.sidebar.set_streaming({r.conversation_id for r in self.session.replies.values()})

    def conversation_changed(self, conv_id: str) -> None:
        if conv_id == self.conversation_id:
            self._show_conversation(self.store.conversation(conv_id))
        self._update_busy()
        self.sidebar.refresh()

    def reply_finished(self, result: GenerationResult) -> None:
        self.sig_reply_finished.emit(result)

    def reply_failed(self, message: str) -> None:
        self.sig_reply_failed.emit(message)

    def alternatives_ready(self, conv_id: str) -> None:
        self.sig_alternatives_ready.emit(conv_id)

    def restore_text(self, text: str) -> None:
        if not self.composer.text().strip():
            self.composer.set_text(text)

    def saving(self, active: bool) -> None:
        if active:
            self._save_timer.start()
        else:
            self._save_timer.stop()

    def _export_done(self, text: str) -> None:
        """An export was written: say so, and drop a failed export's banner (it is stale)."""
        self.statusBar().showMessage(text, STATUS_MS)
        self.pane.cause_ended("export")

    def notify(self, message: str, until: Until | None = None) -> None:
        """Show a one-line message above the composer until dismissed, replaced, or (with
        `until`) its cause is over."""
        self.pane.notify(message, until)

    # ----- engine events -----------------------------------------------------------------
    def _on_token(self, event: TokenEmitted) -> None:
        if self.session.add_token(event) is not None:
            self.chat.push_token(event.request_id, event.index, event.text)

    def _on_text_flushed(self, event: TextFlushed) -> None:
        if self.session.add_text(event.request_id, event.text) is not None:
            self.chat.push_text(event.request_id, event.text)

    def _on_tokens_painted(self, request_id: str, indexes: list[int], painted_ns: int) -> None:
        for index in indexes:
            self.hud.on_token_painted(request_id, index, painted_ns)

    # ----- model -------------------------------------------------------------------------
    def choose_model(self) -> None:
        self.loads.choose_model()

    def load_model(self, spec: str, **options: Any) -> None:
        """Ask the engine to load a model in its thread; progress shows in the status bar."""
        self.loads.load_model(spec, **options)

    def _show_model(self, info: ModelInfo | None) -> None:
        self.session.model_info = info
        self.status.show_model(info)
        if info is None:
            return
        self.pane.cause_ended("model")  # before a note about this model
        if info.template_fallback:
            self.notify(f"{info.name} has no chat template; using a plain "
                        "'User: / Assistant:' format, so replies may be weaker.")
        self.controls.set_context_length(info.context_length)
        self._show_context_fill(self.session.visible_messages())
        self._set_text_rate(CPU_FLUSH_INTERVAL_MS if info.device == "cpu" else FLUSH_INTERVAL_MS)

    def _draft_notices_end(self, _cause: object) -> None:
        """A draft model loaded, or the user chose a mode without one: notices about a
        missing draft are stale."""
        if self.controls.draft_name is not None or self.controls.speculative_mode() != "draft":
            self.pane.cause_ended("draft")

    def _set_text_rate(self, interval_ms: int) -> None:
        """Streaming text is handed over and painted at one rate; the HUD judges render lag
        against it."""
        self.chat.set_flush_interval(interval_ms)
        self.bridge.min_drain_interval_s = interval_ms / 1000
        self.hud.set_text_interval(interval_ms / 1000)

    def _show_context_fill(self, messages: list[Message] | None) -> None:
        """What the chat on screen fills of the context: a running reply's prompt (shown as
        soon as it is being read, not after the reply) and its tokens so far, else what its
        last saved reply used (`messages`: the chat's saved messages; None: as last time)."""
        if messages is not None:
            last = next((m.metrics for m in reversed(messages) if m.metrics), None)
            self._saved_context = (last["prompt_tokens"] + last["output_tokens"]) if last else 0
        running = [r.prompt_tokens + r.output_tokens for r in
                   self.session.running(self.conversation_id) if r.prompt_tokens is not None]
        self.status.show_context(max(running, default=self._saved_context),
                                 self.model_info.context_length if self.model_info else 0)

    # ----- closing ----------------------------------------------------------------------------
    def quit(self) -> None:
        """Ctrl+Q / Chat → Quit. While a reply is being written, first say that what it wrote
        is kept, marked stopped (asked only here and only while the window shows: closing it,
        SIGTERM and scripted closes go straight to closeEvent)."""
        if self.session.replies and self.isVisible():
            yes, no = QMessageBox.StandardButton.Yes, QMessageBox.StandardButton.No
            answer = QMessageBox.question(
                self, "Quit while a reply is written",
                "A reply is still being written. Quit now? What it has written so far is kept "
                "in the chat, marked stopped.", yes | no, yes)
            if answer != yes:
                return
        self.close()

    def closeEvent(self, event: QCloseEvent) -> None:
        """Cancel running replies, keep their partial text (marked stopped), save settings.
        Alternatives nobody kept are discarded. The HUD's calibration thread is joined."""
        self.session.close()
        self.hud.stop_calibration()
        self.bridge.detach()
        self.drafts.stash()
        self.dock_widths.save(self.settings)
        save_layout(self, self.controls, self.settings)
        super().closeEvent(event)
