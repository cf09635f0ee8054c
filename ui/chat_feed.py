"""Each reply's stream on screen: from the engine, through the chat session, to the chat view
and the HUD, one way.

The chat session (ui/session.py, Qt-free) keeps each running reply's record: which request it
is, the chat and turn it answers, its text so far, how far its prompt is read and the time left
(said once, ui.session.PromptReading). The ChatFeed takes the engine's stream events from the
bridge, has the session fold each in, and shows what the session kept: in the chat view (when
the reply's chat is on screen), in the HUD (every reply) and as the sidebar's dot on a chat
being written. The chat view's paint stamps go straight to the HUD. Streaming replies are
saved in batches on the feed's timer. The window only wires the feed and tells it when the
chat on screen changes.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, QTimer
from PySide6.QtGui import QCursor
from PySide6.QtWidgets import QToolTip

from engine import (
    EngineEvent,
    ModelInfo,
    PrefillProgress,
    PrefillStarted,
    TextFlushed,
    TokenEmitted,
)
from engine.params import MAX_ALTERNATIVES
from ui.bridge import EngineBridge
from ui.chat_pane import LoadStatus
from ui.chat_view import CPU_FLUSH_INTERVAL_MS, FLUSH_INTERVAL_MS, Alternative, ChatView
from ui.hud.history import saved_chat
from ui.hud.model import saved_request_id
from ui.hud.widget import HudWidget
from ui.session import FINISH_STATUS, ActiveReply, ChatSession
from ui.sidebar import Sidebar
from ui.store import DONE, Conversation, Message

SAVE_INTERVAL_MS = 500  # how often a streaming reply's text is written to the database


class ChatFeed(QObject):
    """Feeds the chat view and the HUD from the chat session's replies."""

    def __init__(self, session: ChatSession, bridge: EngineBridge, chat: ChatView,
                 hud: HudWidget, sidebar: Sidebar, status: LoadStatus,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.session, self.bridge, self.chat, self.hud = session, bridge, chat, hud
        self.sidebar, self.status = sidebar, status
        self._saved_context = 0  # tokens the chat on screen's last saved reply left
        self._save_timer = QTimer(self)
        self._save_timer.setInterval(SAVE_INTERVAL_MS)
        self._save_timer.timeout.connect(session.save_partial)
        bridge.sig_event.connect(hud.on_engine_event)  # the HUD's own record of every request
        bridge.sig_stream.connect(self._on_stream)  # a drain's tokens, every chat's, at once
        bridge.sig_text_flushed.connect(self._on_text_flushed)
        bridge.sig_prefill_started.connect(self._on_prefill_started)
        bridge.sig_prefill_progress.connect(self._on_prefill_progress)
        bridge.sig_request_finished.connect(session.on_finished)
        bridge.sig_request_failed.connect(session.on_failed)
        chat.sig_tokens_painted.connect(hud.on_tokens_painted)
        bridge.sig_model_loaded.connect(self.show_model)

    # ----- the engine's stream events, through the session ----------------------------------
    def _on_stream(self, events: list[EngineEvent]) -> None:
        """A run of streamed tokens (and sampler snapshots) of every running reply: the HUD
        folds the lot at once; each token joins its reply, and the chat view takes those of
        the chat on screen (it paints them on its own timer)."""
        self.hud.on_engine_events(events)
        for event in events:
            if isinstance(event, TokenEmitted) and self.session.add_token(event) is not None:
                self.chat.push_token(event.request_id, event.index, event.text)

    def _on_text_flushed(self, event: TextFlushed) -> None:
        if self.session.add_text(event.request_id, event.text) is not None:
            self.chat.push_text(event.request_id, event.text)

    def _on_prefill_started(self, event: PrefillStarted) -> None:
        reply = self.session.on_prefill_started(event)
        if reply is not None and reply.conversation_id == self.session.conversation_id:
            self.show_context_fill(None)  # its prompt fills the context from now on

    def _on_prefill_progress(self, event: PrefillProgress) -> None:
        reply = self.session.on_prefill_progress(event)
        if reply is not None and reply.reading is not None:
            self.chat.show_reading(reply.request_id, reply.reading)
            self.hud.show_reading(reply.request_id, reply.reading)

    # ----- replies starting and ending ------------------------------------------------------
    def started(self, reply: ActiveReply) -> None:
        """The HUD names it by its chat and turn (its picker, the open chat's panels)."""
        self.hud.name_reply(reply.request_id, reply.chat_title, reply.turn,
                            chat_id=reply.conversation_id)
        self._show_streaming_chats()

    def ended(self, reply: ActiveReply) -> None:
        self.chat.end_stream(reply.request_id)
        self._show_streaming_chats()

    def _show_streaming_chats(self) -> None:
        """The sidebar marks every chat with a reply being written (on screen or not)."""
        self.sidebar.set_streaming({r.conversation_id for r in self.session.replies.values()})

    def saving(self, active: bool) -> None:
        """Whether streaming replies are saved in batches (the session asks)."""
        if active:
            self._save_timer.start()
        else:
            self._save_timer.stop()

    def show_stats(self, message: Message) -> None:
        """A click on a saved reply's stats line: its full breakdown at the pointer, and the
        reply in the HUD (its picker moves to it): the live record when this session wrote
        it, else the saved one."""
        if message.stats is None:
            return
        QToolTip.showText(QCursor.pos(), message.stats.details(), self.chat)
        request_id = self.session.reply_of_message.get(message.id)
        if request_id is None or self.hud.model.record(request_id) is None:
            request_id = saved_request_id(message.id)
        self.hud.select_reply(request_id)  # until a new reply starts

    # ----- the chat on screen ---------------------------------------------------------------
    def show_chat(self, conv: Conversation | None, saved: list[Message] | None = None) -> None:
        """The chat on screen in the view, in the HUD's history and in the context gauge, from
        one read of its messages (None: it is not in the store, so nothing saved shows)."""
        if saved is None:
            saved = self.session.store.messages(conv.id) if conv is not None else []
        messages = self.session.visible_messages(saved)
        self._render(messages)
        self.hud.show_chat(None if conv is None else saved_chat(conv.id, conv.title, saved))
        self.show_context_fill(messages)

    def chat_created(self, conv_id: str, title: str) -> None:
        """The chat on screen was just saved (its first message is next): the HUD follows it."""
        self.hud.show_chat(saved_chat(conv_id, title, []))

    def _render(self, messages: list[Message]) -> None:
        """Saved messages, then this chat's alternatives in their order, finished or still
        streaming (one that ends first never jumps ahead), then its other live replies."""
        session = self.session
        finished = {i: Alternative(i, f"Alternative {i + 1}", r.text,
                                   FINISH_STATUS.get(r.finish_reason, DONE))
                    for i, r in session.finished_alternatives(session.conversation_id)}
        running = session.running(session.conversation_id)
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

    def _show_live(self, reply: ActiveReply) -> None:
        self.chat.begin_stream(reply.request_id, reply.label)
        self.chat.push_text(reply.request_id, reply.text)
        if reply.reading is not None:
            self.chat.show_reading(reply.request_id, reply.reading)

    def show_context_fill(self, messages: list[Message] | None) -> None:
        """What the chat on screen fills of the context: a running reply's prompt (shown as
        soon as it is being read, not after the reply) and its tokens so far, else what its
        last saved reply used (`messages`: the chat's saved messages; None: as last time)."""
        if messages is not None:
            last = next((m.metrics for m in reversed(messages) if m.metrics), None)
            self._saved_context = (last["prompt_tokens"] + last["output_tokens"]) if last else 0
        running = [r.prompt_tokens + r.output_tokens for r in
                   self.session.running(self.session.conversation_id)
                   if r.prompt_tokens is not None]
        info = self.session.model_info
        self.status.show_context(max(running, default=self._saved_context),
                                 info.context_length if info else 0)

    def show_model(self, info: ModelInfo | None) -> None:
        """A model is in use (the session's replies run on it): the chat's context gauge
        against its context, and streaming text painted at the rate its device affords."""
        self.session.model_info = info
        if info is not None:
            self.show_context_fill(self.session.visible_messages())
            self.set_text_rate(CPU_FLUSH_INTERVAL_MS if info.device == "cpu"
                               else FLUSH_INTERVAL_MS)

    def set_text_rate(self, interval_ms: int) -> None:
        """Streaming text is handed over and painted at one rate; the HUD judges render lag
        against it."""
        self.chat.set_flush_interval(interval_ms)
        self.bridge.min_drain_interval_s = interval_ms / 1000
        self.hud.set_text_interval(interval_ms / 1000)
