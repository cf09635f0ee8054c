"""The main window: conversations on the left, the chat in the middle, settings and HUD right.

The window builds the widgets and wires them: a ChatSession (ui/session.py: the flow of
replies between the store and the backend, without Qt) and a ChatFeed (ui/chat_feed.py: each
reply's stream from the engine, through the session, to the chat view and the HUD). It turns
what the user does into the session's calls and what the session reports into the composer,
sidebar and notices. Several replies may run at once (the engine batches them): one per chat,
or N alternatives in one chat, of which the user keeps one.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from PySide6.QtCore import QSettings, Signal
from PySide6.QtGui import QCloseEvent, QGuiApplication
from PySide6.QtWidgets import (
    QMainWindow,
    QMenu,
    QSizePolicy,
    QSplitter,
    QWidget,
)

from engine import GenerationResult, ModelInfo
from engine.protocol import Backend
from ui.about import confirm
from ui.bridge import EngineBridge
from ui.chat_export import STATUS_MS, ChatExports
from ui.chat_feed import ChatFeed
from ui.chat_pane import ChatPane, LoadStatus
from ui.chat_view import ChatView
from ui.compose_aids import ComposeAids
from ui.composer import Composer
from ui.controls import ControlsPanel
from ui.dock_widths import DockWidths, dock_column
from ui.drafts import Drafts
from ui.hud.widget import HudWidget
from ui.model_loads import ModelLoads
from ui.session import (
    ActiveReply,
    ChatSession,
    ReplyOptions,
    Until,
    default_alternatives,
    store_message,
)
from ui.shortcuts import WindowMenus
from ui.sidebar import Sidebar
from ui.speed_figures import SpeedFigures
from ui.store import ChatStore, Conversation
from ui.theme import FocusRing
from ui.window_settings import restore_layout, save_layout

DOCK_WIDTH = 430  # the settings and HUD column's first width
# The chat column's narrowest: a small window squeezes the docks (down to their own minimum
# widths) before the chat gets narrower than this.
CHAT_MIN_WIDTH = 340


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

        self._build_widgets()
        self._build_docks(hud_calibrate)
        self.status = LoadStatus(self.statusBar())
        self.menus = WindowMenus(self)
        self._set_focus_chain()
        self.focus_ring = FocusRing(self)
        self._wire()
        restore_layout(self, self.controls, settings)
        self.dock_widths.load(settings)
        self.loads.show_model(engine.model_info)
        self.feed.show_model(engine.model_info)
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
        self.settings_dock, self.hud_dock = dock_column(
            self, DOCK_WIDTH, ("Generation", "settingsDock", self.controls),
            ("Performance", "hudDock", self.hud))
        self.dock_widths = DockWidths(self, self.settings_dock, DOCK_WIDTH)

    def _set_focus_chain(self) -> None:
        """Tab goes message → Attach… → replies count → Send → the settings in reading order → the
        chat list (New chat, search, chats) → the HUD's picker, menus and panels → the chat's
        header → the transcript (its links) → back to the message. The plain-text boxes pass
        Tab on instead of typing it."""
        chain = [self.composer.editor, self.composer.attach, self.composer.alternatives,
                 self.composer.button,
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
        # The replies' streams: engine -> session -> chat view and HUD (first: the session
        # knows a new model before the controls hear of it).
        self.feed = ChatFeed(self.session, self.bridge, self.chat, self.hud, self.sidebar,
                             self.status, self)
        self.loads = ModelLoads(self, self.engine, self.bridge, self.status, self.controls,
                                self.pane, self.load_options, self.settings)
        self.speed_figures = SpeedFigures(self.bridge, self.hud, self)  # prediction vs replies
        self.speed_figures.model_loaded(self.engine.model_info)
        self.chat.sig_action.connect(self._on_message_action)
        self.aids = ComposeAids(self.engine, self.session, self.composer, self.bridge,
                                self.reply_options, self.notify, self)  # forecast, documents
        self.composer.sig_send.connect(self.send)
        self.composer.sig_stop.connect(self.stop)
        self.composer.sig_cancel_edit.connect(self._leave_edit_mode)
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
        self._show_chat(None, None)
        self.sidebar.clear_selection()
        self.composer.focus()

    def open_conversation(self, conv_id: str) -> None:
        conv = self.store.conversation(conv_id)
        if conv is not None:
            self._show_chat(conv_id, conv)

    def _show_chat(self, conv_id: str | None, conv: Conversation | None) -> None:
        """Put a chat on screen (None: a new one): its draft, title, system prompt, turns."""
        self.drafts.stash()
        self._leave_edit_mode()
        self.session.conversation_id = conv_id
        self.drafts.take(conv_id)
        self.pane.set_title(conv.title if conv else "New chat")
        self.controls.set_system_prompt(conv.system_prompt if conv else "")
        self.feed.show_chat(conv)
        self.sidebar.refresh(select=conv_id or "")
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
        self.aids.expect(self.hud, editing is not None)
        sent = self.session.send(self.aids.message(text), self.reply_options())
        if sent:
            self.composer.chips.clear()
        else:
            self.hud.model.expect_ttft(None)
        return sent

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
        return self.chat.alternatives_menu(default_alternatives(options),
                                           partial(self.generate_alternatives, message_id))

    def keep_alternative(self, index: int) -> bool:
        """Save alternative `index` of the current chat as its reply; discard the others."""
        return self.session.keep_alternative(index)

    def edit(self, message_id: int) -> None:
        """Put a user message back in the composer; sending replaces it and what followed
        (asked at the resend when later turns would go: nothing is lost until then)."""
        content = self.session.begin_edit(message_id)
        if content is not None:
            self.aids.restore(content)  # its documents come back as chips
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
        """A click on a saved reply's stats line: its breakdown, and the reply in the HUD."""
        message = self.store.message(message_id)
        if message is not None:
            self.feed.show_stats(message)

    def _on_message_action(self, action: str, message_id: int) -> None:
        """A link under a message (keep's argument is the alternative's index)."""
        handlers: dict[str, Callable[[int], object]] = {
            "copy": self.copy, "edit": self.edit, "regenerate": self.regenerate,
            "alternatives": self.ask_alternatives, "keep": self.keep_alternative,
            "stats": self.show_reply_stats}
        if action in handlers:
            handlers[action](message_id)

    def _leave_edit_mode(self) -> None:
        self.session.editing_message_id = None
        if self.composer.editing:
            self.composer.set_editing(False)

    # ----- SessionView: what the session reports -------------------------------------------------
    def conversation_created(self, conv_id: str, title: str) -> None:
        self.drafts.created(conv_id)
        self.pane.set_title(title)
        self.sidebar.refresh(select=conv_id)
        self.feed.chat_created(conv_id, title)

    def message_saved(self) -> None:
        self.pane.hide_notice()
        self.composer.clear()
        self.drafts.sent()
        self._leave_edit_mode()

    def reply_started(self, reply: ActiveReply) -> None:
        self.feed.started(reply)
        self.sig_reply_started.emit(reply.request_id)

    def reply_ended(self, reply: ActiveReply) -> None:
        self.feed.ended(reply)
        self._update_busy()

    def conversation_changed(self, conv_id: str) -> None:
        if conv_id == self.conversation_id:
            self.feed.show_chat(self.store.conversation(conv_id))
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
        self.feed.saving(active)

    def _export_done(self, text: str) -> None:
        """An export was written: say so, and drop a failed export's banner (it is stale)."""
        self.statusBar().showMessage(text, STATUS_MS)
        self.pane.cause_ended("export")

    def notify(self, message: str, until: Until | None = None) -> None:
        """Show a one-line message above the composer until dismissed, replaced, or (with
        `until`) its cause is over."""
        self.pane.notify(message, until)

    # ----- model -------------------------------------------------------------------------
    def choose_model(self) -> None:
        self.loads.choose_model()

    def load_model(self, spec: str, **options: Any) -> None:
        """Ask the engine to load a model in its thread; progress shows in the status bar."""
        self.loads.load_model(spec, **options)

    # ----- closing ----------------------------------------------------------------------------
    def quit(self) -> None:
        """Ctrl+Q / Chat → Quit. While a reply is being written, first say that what it wrote
        is kept, marked stopped (asked only here and only while the window shows: closing it,
        SIGTERM and scripted closes go straight to closeEvent)."""
        if self.session.replies and self.isVisible() and not confirm(
                self, "Quit while a reply is written",
                "A reply is still being written. Quit now? What it has written so far is kept "
                "in the chat, marked stopped.", default_yes=True):
            return
        self.close()

    def closeEvent(self, event: QCloseEvent) -> None:
        """Cancel running replies, keep their partial text (marked stopped), save settings.
        Alternatives nobody kept are discarded. The HUD's calibration thread is joined."""
        self.session.close()
        self.aids.stop()
        self.hud.stop_calibration()
        self.bridge.detach()
        self.drafts.stash()
        self.dock_widths.save(self.settings)
        save_layout(self, self.controls, self.settings)
        super().closeEvent(event)
