"""Model and draft-model loads started from the window.

Choices go to the backend (which loads in its own thread); progress and the model in use show
in the status line, failures and notes in the notice bar, and what the model and the backend
can do (context length, speculative decoding, draft models) in the controls.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QObject, QSettings
from PySide6.QtWidgets import QWidget

from engine import DraftModelChanged, ModelInfo
from engine.protocol import Backend
from engine.remote import REMOTE_SPEC
from ui.bridge import EngineBridge
from ui.chat_pane import ChatPane, LoadStatus
from ui.controls import ControlsPanel
from ui.model_picker import ModelPickerDialog


class ModelLoads(QObject):
    """Starts loads on a backend and shows how they went."""

    def __init__(self, window: QWidget, engine: Backend, bridge: EngineBridge,
                 status: LoadStatus, controls: ControlsPanel, pane: ChatPane,
                 load_options: dict[str, Any], settings: QSettings | None = None) -> None:
        super().__init__(window)
        self.settings = settings  # remembers the engine chosen per model
        self.window = window
        self.engine = engine
        self.status = status
        self.controls = controls
        self.pane = pane
        self.notify = pane.notify
        self.load_options = load_options  # the app's (device, dtype, kernel, engine)
        bridge.sig_model_loading.connect(status.loading)
        bridge.sig_model_load_progress.connect(status.load_progress)
        bridge.sig_model_loaded.connect(self._on_model_loaded)
        bridge.sig_model_load_failed.connect(self._on_model_load_failed)
        bridge.sig_draft_changed.connect(self._on_draft_changed)
        bridge.sig_draft_load_failed.connect(self._on_draft_load_failed)
        controls.sig_draft_requested.connect(self.choose_draft_model)
        controls.speculative.activated.connect(self._draft_notices_end)  # the user's pick
        if engine.model_info is not None:  # loaded before the window was built
            controls.model_defaults.use_model(engine.model_info.name,
                                              engine.model_info.sampling_defaults)

    def picker(self, *, draft: bool = False) -> ModelPickerDialog:
        """The model picker, knowing the app's load options and the model in use."""
        model = self.engine.model_info
        return ModelPickerDialog(self.window, load_options=self.load_options,
                                 loaded_path=model.path if model else None,
                                 settings=self.settings, draft=draft,
                                 current=None if draft else model)

    def choose_model(self) -> None:
        dialog = self.picker()
        if dialog.exec():
            choice = dialog.choice()
            self.load_model(choice.spec, **choice.options)

    def load_model(self, spec: str, **options: Any) -> None:
        """Ask the backend to load a model in its thread; progress shows in the status bar."""
        self.status.loading(f"Loading {spec}…")
        self.engine.load_model(spec, **(self.load_options | options))

    def choose_draft_model(self) -> None:
        """Pick a draft model for speculative decoding; the engine loads it in its thread."""
        dialog = self.picker(draft=True)
        dialog.setWindowTitle("Choose a draft model")
        if not dialog.exec():
            self.controls.keep_loaded_draft()
            return
        choice = dialog.choice()
        if choice.spec == REMOTE_SPEC:
            self.notify("A draft model runs locally: choose a folder, a .gguf file or a hub id.")
            self.controls.keep_loaded_draft()
            return
        self.status.loading(f"Loading draft model {choice.spec}…")
        self.engine.load_draft(choice.spec, **(self.load_options | choice.options))

    def show_model(self, info: ModelInfo | None) -> None:
        """The model in use: in the status line, the controls' context length, a note when it
        has no chat template; notices about loading it are over."""
        self.status.show_model(info)
        if info is None:
            return
        self.pane.cause_ended("model")  # before a note about this model
        if info.template_fallback:
            self.notify(f"{info.name} has no chat template; using a plain "
                        "'User: / Assistant:' format, so replies may be weaker.")
        self.controls.set_context_length(info.context_length)

    def _on_model_loaded(self, info: ModelInfo) -> None:
        self.show_model(info)
        self.status.done(f"Loaded {info.name}")
        self.controls.model_defaults.use_model(info.name, info.sampling_defaults)
        self.controls.set_capabilities(self.engine.capabilities)

    def _on_model_load_failed(self, message: str) -> None:
        self.status.done()
        model = self.engine.model_info  # the old model stays
        kept = f" Still using {model.name}." if model else ""
        self.notify(f"Model not loaded: {message.rstrip('.')}.{kept}", "model")

    def _on_draft_changed(self, event: DraftModelChanged) -> None:
        if event.name is not None:
            self.status.done(f"Draft model {event.name} ({event.kernel})")
        elif self.controls.draft_name is not None:
            self.status.done("Draft model dropped (it was for the previous model)")
        else:
            self.status.done(self.status.load_label.text())
        self.controls.set_draft_model(event.name)
        self._draft_notices_end()  # now the controls know it

    def _draft_notices_end(self, *_cause: object) -> None:
        """A draft model loaded, or the user chose a mode without one: notices about a
        missing draft are stale."""
        if self.controls.draft_name is not None or self.controls.speculative_mode() != "draft":
            self.pane.cause_ended("draft")

    def _on_draft_load_failed(self, message: str) -> None:
        self.status.done()
        kept = (f" Still drafting with {self.controls.draft_name}."
                if self.controls.draft_name else "")
        self.notify(f"Draft model not loaded: {message.rstrip('.')}.{kept}", "draft")
        self.controls.keep_loaded_draft()
