"""The chat session: the flow of replies between the store and a Backend, without Qt.

It saves the user's message, submits to the backend (never waiting on it), collects the
streamed text, saves a streaming reply in batches when asked, and on the end writes the
authoritative text, its settings and its metrics. Several replies may run at once: one per
chat, or N alternatives in one chat, of which the user keeps one. What the screen should do
about it goes to a SessionView (the window); tests can drive a session with a plain object.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Protocol, cast

from engine import (
    ChatMessage,
    GenerationRequest,
    GenerationResult,
    InvalidRequestError,
    ModelInfo,
    PrefillProgress,
    PrefillStarted,
    RequestFailed,
    RequestFinished,
    SamplingParams,
    TokenEmitted,
)
from engine.documents import split_documents
from engine.params import Overflow, Role, Speculative
from engine.protocol import Backend
from ui.hud.model import fmt_eta
from ui.store import (
    DONE,
    STOPPED,
    STREAMING,
    ChatStore,
    Message,
    StoreError,
    metrics_record,
)

TITLE_CHARS = 48
# What clears a notice (see SessionView.notify): a model loaded, the chat on screen's replies
# ended, its alternatives were kept or dropped, a draft model loaded or the user chose another
# speculative mode, an export was written.
Until = Literal["model", "reply", "pick", "draft", "export"]
FINISH_STATUS = {"stop": DONE, "length": "length", "cancelled": STOPPED, "error": "error"}
DEFAULT_ALTERNATIVES = 3  # the Alternatives link when the composer asks for one reply
OVERFLOW_SETTING = "Generation → Advanced → Chat too long"  # drops the oldest turns instead


@dataclass(frozen=True)
class PromptReading:
    """How far a reply's prompt has been read, with its time left said once for every view
    (the reply's placeholder in the chat and the HUD's live breakdown)."""

    progress: PrefillProgress
    left: str  # "3 s left", "estimating time left" (engine.core.prefill_eta), or "" when all read
    left_s: float | None  # the figure `left` says (None: it says none)

    @classmethod
    def of(cls, event: PrefillProgress) -> PromptReading:
        if event.done_tokens >= event.total_tokens or event.tok_s <= 0:
            return cls(event, "", None)
        if event.eta_s is None:
            return cls(event, "estimating time left", None)
        return cls(event, f"{fmt_eta(event.eta_s)} left", event.eta_s)


@dataclass
class ActiveReply:
    """A reply being generated, and its stream as every view shows it. Several run at once:
    one per chat, or a chat's alternatives."""

    request_id: str
    conversation_id: str
    message_id: int | None  # its saved row; None for an alternative (saved only if kept)
    user_message_id: int | None  # set when this send created the user message
    user_text: str
    text: str = ""  # everything received so far, painted or not
    label: str = "Assistant"
    alternative: int | None = None  # its index among the chat's alternatives
    prompt_tokens: int | None = None  # known once its prefill started
    output_tokens: int = 0  # tokens received so far
    overflow: Overflow = "refuse"  # what its request asked for a prompt over the context
    chat_title: str = ""  # the chat it answers, as titled when it started
    turn: int = 0  # which of its chat's user turns it answers (1 = the first)
    reading: PromptReading | None = None  # while its prompt is read (until its first token)

    def context_record(self) -> dict[str, Any] | None:
        """What a reply cut short by closing the window records as its metrics: the context
        it filled, so the chat's context gauge counts it after a restart."""
        if self.prompt_tokens is None:
            return None
        return {"prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens}


@dataclass
class AlternativeSet:
    """N alternatives of one reply in one chat: they stream, then wait for the user's pick."""

    request_ids: list[str]
    settings: dict[str, Any]
    results: dict[int, GenerationResult] = field(default_factory=dict)
    ended: int = 0  # finished or failed


@dataclass(frozen=True)
class ReplyOptions:
    """What the controls and the composer say about the next reply."""

    params: SamplingParams
    speculative: Speculative | None = None
    alternatives: int = 1  # the composer's "× N"
    draft_loaded: bool = False
    system_prompt: str = ""  # for a chat this send creates
    overflow: Overflow = "refuse"  # a chat over the context: refused, or its oldest turns left out


class SessionView(Protocol):
    """What a session asks of the screen (the window; a recorder in tests)."""

    def notify(self, message: str, until: Until | None = None) -> None:
        """Show a one-line message (a refusal, a failure, a note); `until` names the change
        that makes it stale (None: it stays until dismissed or replaced)."""

    def conversation_created(self, conv_id: str, title: str) -> None: ...

    def message_saved(self) -> None:
        """The user's message is in the store: the composer may let go of the text."""

    def reply_started(self, reply: ActiveReply) -> None: ...

    def reply_ended(self, reply: ActiveReply) -> None: ...

    def conversation_changed(self, conv_id: str) -> None:
        """Its messages, live replies or alternatives changed: redraw it if it is shown."""

    def reply_finished(self, result: GenerationResult) -> None: ...

    def reply_failed(self, message: str) -> None: ...

    def alternatives_ready(self, conv_id: str) -> None: ...

    def restore_text(self, text: str) -> None:
        """A failed send gives the user's text back (the composer takes it if empty)."""

    def saving(self, active: bool) -> None:
        """Whether streaming replies wait to be saved in batches (save_partial)."""


def store_message(message: str) -> str:
    return (f"Not saved: {message.rstrip('.')}. Chats saved earlier are safe; free some "
            "disk space or check the file's permissions, then try again.")


class ChatSession:
    """Sends, regenerates, edits and keeps replies; turns the backend's ends into store rows."""

    def __init__(self, backend: Backend, store: ChatStore, view: SessionView) -> None:
        self.backend = backend
        self.store = store
        self.view = view
        self.model_info: ModelInfo | None = backend.model_info
        self.conversation_id: str | None = None  # the chat on screen
        self.replies: dict[str, ActiveReply] = {}  # running, by request id, oldest first
        self.alternative_sets: dict[str, AlternativeSet] = {}  # by conversation id
        self.editing_message_id: int | None = None
        # Saved reply -> the request that wrote it this session (the HUD has its live numbers).
        self.reply_of_message: dict[int, str] = {}
        # Saved reply -> the ids its model produced, and that model (ChatMessage.token_ids), so
        # the next turn's prompt holds the reply as the prefix cache does. Kept for the session
        # only: the cache itself lives in memory, and a new session encodes the text afresh.
        self.reply_ids: dict[int, ChatMessage] = {}

    # ----- queries ----------------------------------------------------------------------------
    @property
    def reply(self) -> ActiveReply | None:
        """The most recently started reply still running (any chat), or None."""
        return next(reversed(self.replies.values()), None)

    def running(self, conv_id: str | None) -> list[ActiveReply]:
        return [r for r in self.replies.values() if r.conversation_id == conv_id]

    def visible_messages(self, saved: list[Message] | None = None) -> list[Message]:
        """The chat on screen's saved messages (`saved`: as already read from the store),
        less those still streaming."""
        if self.conversation_id is None:
            return []
        if saved is None:
            saved = self.store.messages(self.conversation_id)
        streaming = {r.message_id for r in self.replies.values()}
        return [m for m in saved if m.id not in streaming]

    def finished_alternatives(self, conv_id: str | None) -> list[tuple[int, GenerationResult]]:
        alts = self.alternative_sets.get(conv_id) if conv_id else None
        return sorted(alts.results.items()) if alts else []

    def later_turns(self, message_id: int) -> int:
        """How many of its chat's user turns come after a message (an edit drops them)."""
        message = self.store.message(message_id)
        if message is None:
            return 0
        return sum(1 for m in self.store.messages(message.conversation_id)
                   if m.id > message_id and m.role == "user")

    def history(self, conv_id: str) -> list[ChatMessage]:
        conv = self.store.conversation(conv_id)
        history = []
        if conv is not None and conv.system_prompt.strip():
            history.append(ChatMessage("system", conv.system_prompt))
        for m in self.store.messages(conv_id):
            if m.content and m.status != "error" and m.role in ("user", "assistant"):
                message = ChatMessage(cast(Role, m.role), m.content)
                produced = self.reply_ids.get(m.id)
                if produced is not None:  # the prompt checks they still decode to the text
                    message = replace(message, token_ids=produced.token_ids,
                                      token_model=produced.token_model)
                history.append(message)
        return history

    def forecast_request(self, text: str, options: ReplyOptions) -> GenerationRequest | None:
        """What sending `text` now would ask, for the wait forecast; None while an earlier
        message is being edited (the prompt would be another) or no model is loaded."""
        if self.editing_message_id is not None or self.model_info is None:
            return None
        conv = self.conversation_id
        if conv is not None:
            history = self.history(conv)
        else:
            system = options.system_prompt
            history = [ChatMessage("system", system)] if system.strip() else []
        return GenerationRequest([*history, ChatMessage("user", text)], options.params,
                                 conversation_id=conv, overflow=options.overflow)

    # ----- starting replies -------------------------------------------------------------------
    def send(self, text: str, options: ReplyOptions) -> bool:
        """Send text (or resend an edited message). False if refused (the view was told)."""
        if self._busy_refusal():
            return False
        if not text.strip():
            return self._refuse("Type a message first.")
        if self.model_info is None:
            return self._refuse("No model is loaded yet: wait for loading to finish, "
                                "or choose one with the Model… button.", until="model")
        if self._settings_refusal(options, options.alternatives):
            return False
        try:  # nothing is sent unless the message is saved; the composer keeps the text
            conv_id = self._ensure_conversation(text, options.system_prompt)
            if self.editing_message_id is not None:
                self.store.delete_from(conv_id, self.editing_message_id)
                self.editing_message_id = None
            user_id = self.store.add_message(conv_id, "user", text)
        except StoreError as exc:
            return self._refuse(store_message(str(exc)))
        self.view.message_saved()
        return self._start_reply(conv_id, user_id, text, options, options.alternatives)

    def regenerate(self, message_id: int, options: ReplyOptions,
                   alternatives: int | None = None) -> None:
        """Replace a reply with a new one (or `alternatives` of them) from the same history
        (the prompt is all cached)."""
        if self._busy_refusal():
            return
        message = self.store.message(message_id)
        if message is None or message.role != "assistant":
            return
        count = alternatives or options.alternatives
        if self._settings_refusal(options, count):
            return  # before the old reply is deleted
        try:
            self.store.delete_from(message.conversation_id, message_id)
        except StoreError as exc:
            self.view.notify(store_message(str(exc)))
            return
        self._start_reply(message.conversation_id, None, "", options, count)

    def generate_alternatives(self, message_id: int, options: ReplyOptions,
                              count: int | None = None) -> None:
        """Replace a reply with `count` alternatives streaming at once (None: the composer's
        × N, or DEFAULT_ALTERNATIVES when it asks for one reply); the user keeps one."""
        if count is None:
            count = default_alternatives(options)
        self.regenerate(message_id, options, count)

    def begin_edit(self, message_id: int) -> str | None:
        """A user message's text to edit (sending replaces it and what followed); None if
        refused or not a user message."""
        if self._busy_refusal():
            return None
        message = self.store.message(message_id)
        if message is None or message.role != "user":
            return None
        self.editing_message_id = message_id
        return message.content

    def _start_reply(self, conv_id: str, user_id: int | None, user_text: str,
                     options: ReplyOptions, count: int) -> bool:
        request = GenerationRequest(self.history(conv_id), options.params,
                                    conversation_id=conv_id, speculative=options.speculative,
                                    overflow=options.overflow)
        settings = asdict(options.params) | {"model": self.model_info.name
                                             if self.model_info else ""}
        template = self._reply_template(conv_id, user_id, user_text, request.overflow)
        if count > 1:
            self._start_alternatives(request, count, template, settings)
        elif not self._start_single(request, template, settings):
            return False
        self.view.conversation_changed(conv_id)
        return True

    def _reply_template(self, conv_id: str, user_id: int | None, user_text: str,
                        overflow: Overflow) -> ActiveReply:
        """What every reply of this start shares: its chat (title) and turn, the user's
        message, what to do with a prompt over the context."""
        conv = self.store.conversation(conv_id)
        turn = sum(m.role == "user" for m in self.store.messages(conv_id))
        return ActiveReply("", conv_id, None, user_id, user_text, overflow=overflow,
                           chat_title=conv.title if conv is not None else "", turn=turn)

    def _start_single(self, request: GenerationRequest, template: ActiveReply,
                      settings: dict[str, Any]) -> bool:
        conv_id = template.conversation_id
        try:
            reply_id = self.store.add_message(conv_id, "assistant", "", status=STREAMING,
                                              settings=settings)
        except StoreError as exc:
            self.view.notify(store_message(str(exc)))
            self.view.conversation_changed(conv_id)
            return False
        reply = replace(template, request_id=request.request_id, message_id=reply_id)
        self.replies[request.request_id] = reply
        self.reply_of_message[reply_id] = request.request_id
        self.view.saving(True)
        self.backend.submit(request)
        self.view.reply_started(reply)
        return True

    def _start_alternatives(self, request: GenerationRequest, count: int,
                            template: ActiveReply, settings: dict[str, Any]) -> None:
        """N replies to one prompt, streaming at once; nothing is saved until one is kept.
        The local engine prefills once for all; a remote backend sends N requests."""
        conv_id = template.conversation_id
        ids = [h.request_id for h in self.backend.submit_alternatives(request, count)]
        self.alternative_sets[conv_id] = AlternativeSet(ids, settings)
        for i, request_id in enumerate(ids):
            # each knows the user message: if the whole set fails, the last one takes it back
            reply = replace(template, request_id=request_id, label=f"Alternative {i + 1}",
                            alternative=i)
            self.replies[request_id] = reply
            self.view.reply_started(reply)

    def _ensure_conversation(self, first_text: str, system_prompt: str) -> str:
        if self.conversation_id is None:
            documents, typed = split_documents(first_text)  # titled by what was typed
            shown = typed.strip() or ", ".join(name for name, _ in documents)
            first_line = shown.splitlines()[0]
            title = first_line if len(first_line) <= TITLE_CHARS else (
                first_line[: TITLE_CHARS - 1].rstrip() + "…")
            self.conversation_id = self.store.create_conversation(title, system_prompt)
            self.view.conversation_created(self.conversation_id, title)
        return self.conversation_id

    # ----- keeping, stopping, deleting --------------------------------------------------------
    def keep_alternative(self, index: int) -> bool:
        """Save alternative `index` of the chat on screen as its reply; discard the others
        (any still running are stopped). False if there is no such finished alternative."""
        conv_id = self.conversation_id
        alts = self.alternative_sets.get(conv_id) if conv_id else None
        result = alts.results.get(index) if alts else None
        if alts is None or result is None or conv_id is None:
            return False
        for request_id in alts.request_ids:
            reply = self.replies.pop(request_id, None)
            if reply is not None:
                self.backend.cancel(request_id)
                self.view.reply_ended(reply)
        del self.alternative_sets[conv_id]
        self.backend.keep_alternative(conv_id, index, len(alts.request_ids))
        status = FINISH_STATUS.get(result.finish_reason, DONE)
        try:
            message_id = self.store.add_message(conv_id, "assistant", result.text,
                                                status=status, settings=alts.settings)
            self.reply_of_message[message_id] = alts.request_ids[index]
            self.reply_ids[message_id] = result.as_message()
            self.store.finish_message(message_id, result.text, status, metrics_dict(result))
        except StoreError as exc:
            self.view.notify(store_message(str(exc)))
        self.view.conversation_changed(conv_id)
        return True

    def stop(self, conv_id: str | None) -> None:
        """Stop a chat's running replies; the backend stops within one decode step."""
        for reply in self.running(conv_id):
            self.backend.cancel(reply.request_id)

    def delete_conversation(self, conv_id: str) -> bool:
        """Stop and forget a chat; False if the store refused (the view was told)."""
        self.stop(conv_id)
        self.alternative_sets.pop(conv_id, None)
        try:
            self.store.delete_conversation(conv_id)
        except StoreError as exc:
            self.view.notify(store_message(str(exc)))
            return False
        self.backend.drop_conversation(conv_id)
        return True

    def set_system_prompt(self, text: str) -> None:
        if self.conversation_id is not None:
            try:
                self.store.set_system_prompt(self.conversation_id, text)
            except StoreError as exc:
                self.view.notify(store_message(str(exc)))

    def close(self) -> None:
        """Cancel running replies, keeping their partial text (marked stopped). Alternatives
        nobody kept are discarded."""
        for reply in list(self.replies.values()):
            self.backend.cancel(reply.request_id)
            self._end(reply)
            if reply.message_id is not None:
                with contextlib.suppress(StoreError):  # else the next start marks it stopped
                    self.store.finish_message(reply.message_id, reply.text, STOPPED,
                                              reply.context_record())

    # ----- the backend's events ---------------------------------------------------------------
    def add_text(self, request_id: str, text: str) -> ActiveReply | None:
        """Streamed text of a running reply (None: not ours, or no longer running)."""
        reply = self.replies.get(request_id)
        if reply is not None:
            reply.text += text
        return reply

    def add_token(self, event: TokenEmitted) -> ActiveReply | None:
        """One streamed token of a running reply (None: not ours, or no longer running)."""
        reply = self.add_text(event.request_id, event.text)
        if reply is not None:
            reply.output_tokens += 1
            reply.reading = None  # it writes: its prompt is read
        return reply

    def on_prefill_started(self, event: PrefillStarted) -> ActiveReply | None:
        reply = self.replies.get(event.request_id)
        if reply is not None:
            reply.prompt_tokens = event.prompt_tokens
        return reply

    def on_prefill_progress(self, event: PrefillProgress) -> ActiveReply | None:
        """How far a running reply's prompt is read (None: not ours, or it already writes:
        a late report changes nothing)."""
        reply = self.replies.get(event.request_id)
        if reply is None or reply.output_tokens:
            return None
        reply.reading = PromptReading.of(event)
        return reply

    def on_finished(self, event: RequestFinished) -> None:
        reply, result = self.replies.get(event.request_id), event.result
        if reply is None:
            return
        self._end(reply)
        if reply.message_id is None:
            self._alternative_ended(reply, result)
            self.view.reply_finished(result)
            return
        status = FINISH_STATUS.get(result.finish_reason, DONE)
        self.reply_ids[reply.message_id] = result.as_message()
        try:
            self.store.finish_message(reply.message_id, result.text, status,
                                      metrics_dict(result))
        except StoreError as exc:
            # The full reply stays on screen (not redrawn from the store); what was saved
            # before stays saved and is marked stopped on the next start.
            self.view.notify(store_message(str(exc)))
        else:
            self.view.conversation_changed(reply.conversation_id)
        if result.error:  # a remote reply broke off: its partial text was saved above
            self.view.notify(f"The reply broke off: {result.error}. The partial reply was "
                             "kept.")
        elif result.notice:
            self.view.notify(f"Note: {result.notice}.")
        elif result.dropped_messages:
            self.view.notify(dropped_note(result.dropped_messages))
        self.view.reply_finished(result)

    def on_failed(self, event: RequestFailed) -> None:
        reply = self.replies.get(event.request_id)
        if reply is None:
            return
        self._end(reply)
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
        if reply.user_message_id is not None:
            self.view.restore_text(reply.user_text)
        self.view.conversation_changed(reply.conversation_id)
        message = event.message
        if (event.context_overflow and reply.overflow == "refuse"
                and self.backend.capabilities.drop_oldest_turns):
            message += f" ({OVERFLOW_SETTING})"  # where to have them dropped instead
        self.view.notify(message)
        self.view.reply_failed(message)

    def save_partial(self) -> None:
        """Write every streaming reply's text so far (the view calls this in batches)."""
        for reply in list(self.replies.values()):
            if reply.message_id is None:
                continue
            try:
                self.store.save_partial(reply.message_id, reply.text)
            except StoreError as exc:  # keep streaming; the next batch tries again
                self.view.notify(store_message(str(exc)))
                return

    def _end(self, reply: ActiveReply) -> None:
        self.replies.pop(reply.request_id, None)
        self.view.reply_ended(reply)
        if not any(r.message_id is not None for r in self.replies.values()):
            self.view.saving(False)

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
        self.view.conversation_changed(reply.conversation_id)
        if complete:
            self.view.alternatives_ready(reply.conversation_id)
        return False

    # ----- refusals ---------------------------------------------------------------------------
    def _refuse(self, message: str, until: Until | None = None) -> bool:
        self.view.notify(message, until=until)
        return False

    def _settings_refusal(self, options: ReplyOptions, count: int) -> bool:
        """Refuse what these settings cannot do, before anything is saved or deleted."""
        return (self._draft_refusal(options, count) or self._params_refusal(options)
                or self._greedy_alternatives_refusal(options, count))

    def _greedy_alternatives_refusal(self, options: ReplyOptions, count: int) -> bool:
        """Alternatives at temperature 0 would all be the same reply."""
        if count > 1 and options.params.greedy:
            self._refuse("Alternatives need a temperature above 0: greedy replies are all the "
                         "same (Generation → Temperature).")
            return True
        return False

    def _draft_refusal(self, options: ReplyOptions, count: int) -> bool:
        """Refuse a single reply in Draft model mode while no draft is loaded (alternatives
        decode plainly, in one batch)."""
        if count == 1 and options.speculative == "draft" and not options.draft_loaded:
            self._refuse("No draft model is loaded yet: wait for it, or set Speculative to Off "
                         "(Generation → Advanced).", until="draft")
            return True
        return False

    def _params_refusal(self, options: ReplyOptions) -> bool:
        """Refuse settings the request would reject (a seed out of range), before anything
        is saved or deleted."""
        try:
            options.params.validate()
        except InvalidRequestError as exc:
            self._refuse(f"Not sent: {exc} (Generation → Advanced).")
            return True
        return False

    def _busy_refusal(self) -> bool:
        """Refuse to start in the chat on screen while it is writing or awaiting a pick
        (other chats may be writing: their replies run alongside)."""
        if self.running(self.conversation_id):
            self._refuse("A reply is still being written: press Esc to stop it first.",
                         until="reply")
            return True
        if self.conversation_id in self.alternative_sets:
            self._refuse("Keep one of the alternatives first (the Keep this one link).",
                         until="pick")
            return True
        return False


def dropped_note(count: int) -> str:
    """The one line a reply gets when its chat's oldest messages were left out of its prompt."""
    messages = "oldest message" if count == 1 else f"{count} oldest messages"
    return f"Left out the {messages} to fit the model's context (the chat keeps them)."


def default_alternatives(options: ReplyOptions) -> int:
    """How many alternatives the Alternatives link offers first: the composer's × N when it
    asks for more than one reply, else DEFAULT_ALTERNATIVES."""
    return options.alternatives if options.alternatives > 1 else DEFAULT_ALTERNATIVES


def metrics_dict(result: GenerationResult) -> dict[str, Any]:
    """What a saved reply records: its metrics plus the model, engine and kernel that wrote
    it (the store also files the headline numbers in columns)."""
    return metrics_record(result)
