"""What helps while a message is written: the wait forecast beside Send (ui/forecast.py) and the
documents attached to the message (ui/attach_flow.py), wired to the composer once.

The window owns one; it asks for the message with its documents, hands the HUD the forecast
as a message is sent, and puts an edited message's documents back as chips.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtWidgets import QFileDialog, QWidget

from engine.documents import Document, split_documents, with_documents
from engine.protocol import Backend, PrefixPeek
from ui.attach_flow import FILE_FILTER, DocumentAttacher
from ui.bridge import EngineBridge
from ui.composer import Composer
from ui.forecast import WaitForecast
from ui.hud.widget import HudWidget
from ui.session import ChatSession, ReplyOptions


class ComposeAids:
    def __init__(self, engine: Backend, session: ChatSession, composer: Composer,
                 bridge: EngineBridge, reply_options: Callable[[], ReplyOptions],
                 notify: Callable[[str], None], parent: QWidget) -> None:
        self.engine, self.session, self.composer = engine, session, composer
        self.reply_options = reply_options
        self.parent = parent
        self.forecast = WaitForecast(
            engine, lambda text: session.forecast_request(self.message(text), reply_options()),
            composer.set_forecast, parent)
        composer.editor.textChanged.connect(self._text_changed)
        composer.chips.sig_changed.connect(self._text_changed)
        bridge.sig_request_finished.connect(self.forecast.finished)
        bridge.sig_model_loaded.connect(self.forecast.model_loaded)
        self.attacher = DocumentAttacher(engine, composer.chips, self._prompt_with, notify)
        composer.sig_attach.connect(self.attacher.attach)
        composer.sig_attach_clicked.connect(self.choose_documents)

    def message(self, text: str) -> str:
        """`text` with the attached documents before it, as it is sent."""
        return with_documents(text, self.composer.chips.documents)

    def expect(self, hud: HudWidget, editing: bool) -> None:
        """A message is being sent: the HUD sets its first token against the forecast (none
        for an edit: the forecast was of the text after the chat, not of the edited turn)."""
        if editing:
            hud.model.expect_ttft(None)
        else:
            hud.model.expect_ttft(self.forecast.seconds, self.forecast.cold_seconds)

    def choose_documents(self) -> None:
        """The paperclip: pick files to attach to the message being written."""
        paths, _ = QFileDialog.getOpenFileNames(self.parent, "Attach documents", "",
                                                FILE_FILTER)
        self.attacher.attach([Path(p) for p in paths])

    def restore(self, content: str) -> None:
        """An edited message back in the composer: its documents as chips, then its text."""
        documents, text = split_documents(content)
        self.composer.chips.clear()
        for name, body in documents:
            document = Document(name, len(body.encode()), body)
            self.composer.chips.add(document, self.engine.count_tokens(document.block()))
        self.composer.set_text(text)

    def stop(self) -> None:
        self.forecast.stop()

    def _text_changed(self) -> None:
        self.forecast.text_changed(self.composer.text())

    def _prompt_with(self, documents: list[Document]) -> PrefixPeek | None:
        request = self.session.forecast_request(
            with_documents(self.composer.text(), documents), self.reply_options())
        return self.engine.peek_prefix(request) if request is not None else None
