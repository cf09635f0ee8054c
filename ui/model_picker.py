"""Choose a model: the bundled default, a local folder, a .gguf file, or a Hugging Face hub id.

A hub id downloads weights, so it needs an explicit consent tick. The dialog only picks; the
window asks the engine to load (in its thread) and shows progress in the status bar.
RemoteBackendInputs (URL, model, key) is shared with the Compare dialog.

For a local model it also shows which engine runs it (auto, torch or llama.cpp, with the
reason auto chose; remembered per model), whether it fits ("needs ~3.1 GB (...), 11.2 GB
free", engine/tools/fit.py): one that cannot fit is not accepted, and where a smaller context fits
the dialog offers it; and how fast it runs here: predicted from this computer's measurement
(engine/tools/speed.py) and, once it has replied, what its replies measured beside that. The GGUF
files converted for torch are listed and can be removed.

"Browse models online…" opens the hub browser (ui/model_browser.py); a file downloaded there
is chosen here. The GGUF files in the models folder are listed (with partial downloads), can
be chosen, and removed after asking (never the model in use).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PySide6.QtCore import QEvent, QSettings, Qt
from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QRadioButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine import ModelInfo, runtimes
from engine.errors import PhasewiseError
from engine.model_files import kv_snapshot_dir
from engine.remote import REMOTE_SPEC, RemoteError, normalize_base_url, store_api_key
from engine.runtimes.torch.converted import (
    ConvertedModel,
    converted_models,
    in_use,
    remove_converted,
)
from engine.tools import fit
from engine.tools.hub import LocalModel, local_models, remove_local
from engine.tools.speed import MeasuredSpeeds, cost_of, local_model_speed, model_file
from ui.about import confirm
from ui.model_browser import ModelBrowserDialog
from ui.saved_caches import SavedCaches

ENGINE_KEY = "model_engine/"  # QSettings: the engine chosen for a model spec


@dataclass(frozen=True)
class ModelChoice:
    spec: str
    options: dict = field(default_factory=dict)


class RemoteBackendInputs(QWidget):
    """The base URL, model name and API key of an OpenAI-compatible server."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.url = QLineEdit()
        self.url.setPlaceholderText("base URL, e.g. http://gpu-box:8000/v1")
        self.model = QLineEdit()
        self.model.setPlaceholderText("model name (empty: the first the server lists)")
        self.key = QLineEdit()
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("API key (optional; kept in the OS keyring)")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        for edit in self.edits():
            layout.addWidget(edit)

    def edits(self) -> tuple[QLineEdit, QLineEdit, QLineEdit]:
        return self.url, self.model, self.key

    def options(self) -> dict:
        """{"base_url", "model"}; raises ValueError with a one-line reason for a bad URL."""
        try:
            url = normalize_base_url(self.url.text())
        except RemoteError as exc:
            raise ValueError(f"{str(exc)[0].upper()}{str(exc)[1:]}.") from None
        return {"base_url": url, "model": self.model.text().strip()}

    def store_key(self, base_url: str) -> None:
        """Move a typed key to the OS keyring (never into settings); ValueError without one."""
        if not self.key.text():
            return
        try:
            store_api_key(base_url, self.key.text())
        except Exception:
            raise ValueError("No OS keyring is available to keep the key: set "
                             "PHASEWISE_API_KEY in the environment instead.") from None
        self.key.clear()


class RemovableFiles(QGroupBox):
    """A list of model files on disk with their sizes: Remove deletes the selected one after
    asking (never the model in use) and says how much space it freed. Subclasses say what
    the files are."""

    def __init__(self, title: str, loaded_path: str | None,
                 parent: QWidget | None = None) -> None:
        super().__init__(title, parent)
        self.loaded_path = loaded_path
        self.list = QListWidget()
        self.list.setMaximumHeight(90)
        self.remove = QPushButton("Remove…")
        self.note = QLabel()
        self.note.setObjectName("valueLabel")
        self.note.setWordWrap(True)
        self.remove.clicked.connect(self.remove_selected)
        self.list.currentRowChanged.connect(lambda _row: self._update_button())
        row = QHBoxLayout()
        row.addWidget(self.note, 1)
        row.addWidget(self.remove)
        layout = QVBoxLayout(self)
        layout.addWidget(self.list)
        layout.addLayout(row)
        self.refresh()

    # ----- what a subclass says ------------------------------------------------------------
    def entries(self) -> list[tuple[str, str, Any]]:
        """(label, tooltip, the file's object) for each file, in order."""
        raise NotImplementedError

    def in_use(self, entry: Any) -> bool:
        raise NotImplementedError

    def question(self, entry: Any) -> tuple[str, str]:
        """(title, question) asked before removing `entry`."""
        raise NotImplementedError

    def delete(self, entry: Any) -> str:
        """Remove the file; the note saying what was freed (OSError if it cannot)."""
        raise NotImplementedError

    # ----- the list --------------------------------------------------------------------------
    def refresh(self) -> None:
        self.list.clear()
        for label, tip, entry in self.entries():
            item = QListWidgetItem(label)
            item.setToolTip(tip)
            item.setData(Qt.ItemDataRole.UserRole, entry)
            self.list.addItem(item)
        self.setVisible(self.list.count() > 0 or bool(self.note.text()))
        self._update_button()

    def selected(self) -> Any:
        item = self.list.currentItem()
        return item.data(Qt.ItemDataRole.UserRole) if item is not None else None

    def _update_button(self) -> None:
        entry = self.selected()
        self.remove.setEnabled(entry is not None and not self.in_use(entry))

    def remove_selected(self) -> None:
        entry = self.selected()
        if entry is None or self.in_use(entry) or not confirm(self, *self.question(entry)):
            return
        try:
            self.note.setText(self.delete(entry))
        except (PhasewiseError, OSError) as exc:
            self.note.setText(str(exc) if isinstance(exc, PhasewiseError)
                              else f"Cannot remove it: {exc.strerror or exc}")
            return
        self.refresh()


class ConvertedModels(RemovableFiles):
    """The GGUF files converted for the torch engine: each with its size and source file."""

    def __init__(self, loaded_path: str | None, parent: QWidget | None = None) -> None:
        super().__init__("Converted for torch (cache)", loaded_path, parent)

    def entries(self) -> list[tuple[str, str, Any]]:
        return [(f"{m.label}{'  (in use)' if self.in_use(m) else ''}", str(m.folder), m)
                for m in converted_models()]

    def in_use(self, entry: ConvertedModel) -> bool:
        return in_use(entry, self.loaded_path)

    def question(self, entry: ConvertedModel) -> tuple[str, str]:
        return ("Remove converted model",
                f"Remove the converted copy of {entry.source} "
                f"({fit.size(entry.size_bytes)})? It is converted again when next loaded.")

    def delete(self, entry: ConvertedModel) -> str:
        freed = remove_converted(entry, self.loaded_path)
        return f"Removed {entry.source}: {fit.size(freed)} freed"


class DownloadedModels(RemovableFiles):
    """The GGUF files in the models folder (downloaded from the hub) and partial downloads:
    choosing one selects it as the .gguf file."""

    def __init__(self, loaded_path: str | None, parent: QWidget | None = None) -> None:
        super().__init__("Downloaded models", loaded_path, parent)

    def entries(self) -> list[tuple[str, str, Any]]:
        found = []
        for model in local_models():
            if model.partial:
                total = f" of {fit.size(model.total)}" if model.total else ""
                label = (f"{model.name} (partial: {fit.size(model.size)}{total}; Browse "
                         "models online and download it again to resume)")
            else:
                used = "  (in use)" if self.in_use(model) else ""
                label = f"{model.label} ({fit.size(model.size)}){used}"
            found.append((label, str(model.path), model))
        return found

    def in_use(self, entry: LocalModel) -> bool:
        return self.loaded_path is not None and Path(self.loaded_path) == entry.path

    def question(self, entry: LocalModel) -> tuple[str, str]:
        return ("Remove model", f"Remove {self._what(entry)} ({fit.size(entry.size)}) from "
                                "the models folder?")

    def delete(self, entry: LocalModel) -> str:
        try:
            freed = remove_local(entry)
        except OSError as exc:
            raise PhasewiseError(f"Cannot remove {entry.name}: {exc.strerror or exc}") from exc
        return f"Removed {self._what(entry)}: {fit.size(freed)} freed"

    @staticmethod
    def _what(entry: LocalModel) -> str:
        return f"the partial download of {entry.name}" if entry.partial else entry.name


def speed_text(spec: str, engine: str, device: str = "auto") -> str:
    """How fast `spec` runs here on `engine`: the prediction from this computer's cached
    measurement, and what its replies measured beside it ('' where neither is known)."""
    path = model_file(spec)
    if path is None:
        return ""
    try:
        priced = local_model_speed(spec, engine, device)
    except (PhasewiseError, OSError, ValueError):
        priced = None
    measured = MeasuredSpeeds().get(path, engine)
    if priced is None:
        line = ""
        if cost_of(path) is not None:
            line = ("Speed here: not predicted yet (Browse models online measures this "
                    "computer once).")
        return f"{line} Replies {measured.text()}.".strip() if measured else line
    line = f"Speed here ({engine}): predicted {priced.prediction().text()}."
    if measured is None:
        return f"{line} Its replies will show what they measure beside this."
    versus = priced.versus(measured)
    return f"{line} Replies {measured.text()}" + (f"; {versus}." if versus else ".")


class ModelPickerDialog(QDialog):
    """Modal picker; `choice()` is valid after it was accepted."""

    def __init__(self, parent: QWidget | None = None, *, load_options: dict[str, Any] | None = None,
                 loaded_path: str | None = None, settings: QSettings | None = None,
                 draft: bool = False, current: ModelInfo | None = None) -> None:
        super().__init__(parent)
        self.load_options = load_options or {}
        self.settings = settings
        self.draft = draft
        self.setWindowTitle("Choose a model")
        self.setMinimumWidth(520)
        self.radios = {
            "default": QRadioButton("Bundled default (SmolLM2-135M-Instruct, offline)"),
            "folder": QRadioButton("Local Hugging Face folder"),
            "gguf": QRadioButton(".gguf file"),
            "hub": QRadioButton("Hugging Face hub id"),
            REMOTE_SPEC: QRadioButton("Remote server (OpenAI-compatible: vLLM, llama.cpp, "
                                      "Ollama, phasewise serve)"),
        }
        self.group = QButtonGroup(self)
        for radio in self.radios.values():
            self.group.addButton(radio)
        self.radios["default"].setChecked(True)
        self.folder_path = QLineEdit()
        self.gguf_path = QLineEdit()
        self.hub_id = QLineEdit()
        self.hub_id.setPlaceholderText("e.g. HuggingFaceTB/SmolLM2-360M-Instruct")
        self.consent = QCheckBox("Allow downloading this model from the internet")
        self.remote = RemoteBackendInputs()
        self.remote_url, self.remote_model, self.remote_key = self.remote.edits()
        self.error = QLabel()
        self.error.setObjectName("errorLabel")
        self.buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        self.buttons.accepted.connect(self._accept)
        self.buttons.rejected.connect(self.reject)
        self.engine = QComboBox()
        for name in runtimes.ENGINES:
            self.engine.addItem(name, name)
        self.engine.setCurrentIndex(self.engine.findData(self.load_options.get("engine", "auto")))
        self.engine_reason = QLabel()
        self.engine_reason.setObjectName("valueLabel")
        self.engine_reason.setWordWrap(True)
        self.context = QSpinBox()
        self.context.setRange(0, 1 << 20)
        self.context.setSingleStep(1024)
        self.context.setSpecialValueText("the model's own")
        self.context.setSuffix(" tokens")
        # Estimate (and clamp to the model's limit) once a number is entered, not per digit.
        self.context.setKeyboardTracking(False)
        self.fit_label = QLabel()
        self.fit_label.setObjectName("valueLabel")
        self.fit_label.setWordWrap(True)
        self.speed_label = QLabel()  # predicted here, and what replies measured
        self.speed_label.setObjectName("valueLabel")
        self.speed_label.setWordWrap(True)
        self.estimate: fit.Estimate | None = None
        self.converted = ConvertedModels(loaded_path)
        self.downloaded = DownloadedModels(loaded_path)
        self.browse_hub = QPushButton("Browse models online…")
        self.browser: ModelBrowserDialog | None = None
        self.in_use = QLabel()
        self.in_use.setObjectName("valueLabel")
        self.in_use.setWordWrap(True)
        self._build()
        self._build_local()
        if current is not None:
            self._show_current(current)
        self.in_use.setVisible(bool(self.in_use.text()))
        self._spec_changed()

    def _show_current(self, info: ModelInfo) -> None:
        """Open on the model in use: its source chosen, its path, hub id or server filled in,
        and named at the top (reopening the picker showed the bundled default instead)."""
        self.in_use.setText(f"In use: {info.name} ({info.engine}, {info.dtype})")
        source = info.source if info.source in self.radios else None
        if source is None:
            return
        self.radios[source].setChecked(True)
        if source == "folder":
            self.folder_path.setText(info.path)
        elif source == "gguf":
            self.gguf_path.setText(info.path)
        elif source == "hub":
            self.hub_id.setText(info.path)
            self.consent.setChecked(True)  # it was downloaded with consent already
        elif source == REMOTE_SPEC:
            self.remote_url.setText(info.path)
            self.remote_model.setText(info.name)

    def _build(self) -> None:
        grid = QGridLayout()
        browse_folder = QPushButton("Browse…")
        browse_folder.clicked.connect(self._browse_folder)
        browse_gguf = QPushButton("Browse…")
        browse_gguf.clicked.connect(self._browse_gguf)
        grid.addWidget(self.radios["default"], 0, 0, 1, 3)
        grid.addWidget(self.radios["folder"], 1, 0)
        grid.addWidget(self.folder_path, 1, 1)
        grid.addWidget(browse_folder, 1, 2)
        grid.addWidget(self.radios["gguf"], 2, 0)
        grid.addWidget(self.gguf_path, 2, 1)
        grid.addWidget(browse_gguf, 2, 2)
        grid.addWidget(self.radios["hub"], 3, 0)
        grid.addWidget(self.hub_id, 3, 1, 1, 2)
        grid.addWidget(self.consent, 4, 1, 1, 2)
        grid.addWidget(self.radios[REMOTE_SPEC], 5, 0, 1, 3)
        grid.addWidget(self.remote, 6, 1, 1, 2)
        grid.addWidget(self.browse_hub, 7, 0)
        self.browse_hub.clicked.connect(self.browse_models)
        remote_edits = [(REMOTE_SPEC, edit) for edit in self.remote.edits()]
        for source, edit in [("folder", self.folder_path), ("gguf", self.gguf_path),
                             ("hub", self.hub_id), *remote_edits]:
            edit.textEdited.connect(lambda _t, s=source: self.radios[s].setChecked(True))
        layout = QVBoxLayout(self)
        layout.addWidget(self.in_use)
        layout.addLayout(grid)
        layout.addWidget(self.error)
        layout.addWidget(self.buttons)

    def _build_local(self) -> None:
        """Engine, context and fit for a local model; the conversion cache."""
        form = QGridLayout()
        form.addWidget(QLabel("Engine"), 0, 0)
        form.addWidget(self.engine, 0, 1)
        form.addWidget(self.engine_reason, 0, 2)
        form.addWidget(QLabel("Context"), 1, 0)
        form.addWidget(self.context, 1, 1)
        form.addWidget(self.fit_label, 2, 0, 1, 3)
        form.addWidget(self.speed_label, 3, 0, 1, 3)
        form.setColumnStretch(2, 1)
        self.local = QWidget()
        self.local.setLayout(form)
        layout = self.layout()
        assert isinstance(layout, QVBoxLayout)
        layout.insertWidget(2, self.local)  # after the "in use" line and the sources
        layout.insertWidget(3, self.downloaded)
        layout.insertWidget(4, self.converted)
        self.downloaded.list.itemActivated.connect(self._use_listed)
        self.downloaded.list.currentItemChanged.connect(lambda item, _old: self._use_listed(item))
        self.converted.setVisible(self.converted.list.count() > 0 and not self.draft)
        self.saved_caches = SavedCaches(kv_snapshot_dir())
        layout.insertWidget(5, self.saved_caches)
        self.saved_caches.setVisible(not self.draft)
        self.group.buttonToggled.connect(self._source_toggled)
        for edit in (self.folder_path, self.gguf_path, self.hub_id):
            edit.textChanged.connect(lambda _t: self._spec_changed())
        self.engine.currentIndexChanged.connect(lambda _i: self.refresh_estimate())
        self.context.valueChanged.connect(lambda _v: self.refresh_estimate())

    def _source_toggled(self, _button: object, checked: bool) -> None:
        if checked:
            self._spec_changed()

    def local_spec(self) -> str | None:
        """The local model spec chosen so far (None: remote, or nothing entered yet)."""
        source = self.source()
        if source == "default":
            return "default"
        if source == REMOTE_SPEC:
            return None
        text = {"folder": self.folder_path, "gguf": self.gguf_path, "hub": self.hub_id}[
            source].text().strip()
        return text or None

    def _spec_changed(self) -> None:
        """A new model: its remembered engine, then the engine's reason and the estimate."""
        spec = self.local_spec()
        self.local.setVisible(self.source() != REMOTE_SPEC and not self.draft)
        if spec is not None and self.settings is not None:
            saved = self.settings.value(ENGINE_KEY + spec)
            index = self.engine.findData(saved)
            if index >= 0:
                blocked = self.engine.blockSignals(True)
                self.engine.setCurrentIndex(index)
                self.engine.blockSignals(blocked)
        self.refresh_estimate()

    def refresh_estimate(self) -> None:
        """Why auto picks its engine, and what the model needs against what is free."""
        spec = self.local_spec()
        self.estimate = None
        if spec is None:
            self.engine_reason.setText("")
            self.fit_label.setText("")
            self.speed_label.setText("")
            return
        device = str(self.load_options.get("device", "auto"))
        chosen, reason = runtimes.engine_reason(spec, device)
        engine = self.engine.currentData()
        self.engine_reason.setText(f"auto: {chosen} ({reason})" if engine == "auto"
                                   else f"auto would choose {chosen}")
        self.speed_label.setText(speed_text(spec, chosen if engine == "auto" else engine,
                                            device))
        try:
            self.estimate = fit.estimate(
                spec, engine, device=device, dtype=str(self.load_options.get("dtype", "auto")),
                context_length=self.context.value() or None)
        except (PhasewiseError, OSError, ValueError) as exc:
            self.fit_label.setText(str(exc).splitlines()[0] if str(exc) else "")
            return
        if self.estimate is None:
            self.fit_label.setText("Memory needed: not known until the files are here")
            return
        verdict = "Fits" if self.estimate.fits else "Does not fit"
        self.fit_label.setText(f"{self._clamp_context(self.estimate)}{verdict}: "
                               f"{self.estimate.summary()}")

    def _clamp_context(self, est: fit.Estimate) -> str:
        """A context beyond the model's limit is set to the limit (the engines would use the
        limit anyway), with a word; '' when it was within."""
        asked, limit = self.context.value(), est.model_context
        if not limit or asked <= limit:
            return ""
        blocked = self.context.blockSignals(True)  # the estimate is already at the limit
        self.context.setValue(limit)
        self.context.blockSignals(blocked)
        return f"Context set to the model's limit, {limit:,} tokens ({asked:,} is more). "

    def browse_models(self) -> ModelBrowserDialog:
        """The hub browser, over this dialog; a file it downloads is chosen here."""
        if self.browser is None:
            self.browser = ModelBrowserDialog(
                self, settings=self.settings, context=self.context.value(),
                device=str(self.load_options.get("device", "auto")))
            self.browser.sig_downloaded.connect(self.use_downloaded)
            self.browser.sig_hub_id.connect(self.use_hub_id)
        self.browser.open()
        return self.browser

    def use_downloaded(self, path: str) -> None:
        """A file downloaded in the browser: listed, and chosen as the .gguf file."""
        self.downloaded.refresh()
        self.gguf_path.setText(path)
        self.radios["gguf"].setChecked(True)

    def use_hub_id(self, repo: str) -> None:
        """A Hugging Face folder chosen in the browser: its hub id, downloads allowed (the
        user agreed to reach the hub there); the torch engine downloads it as it loads."""
        self.hub_id.setText(repo)
        self.consent.setChecked(True)
        self.radios["hub"].setChecked(True)

    def _use_listed(self, item: QListWidgetItem | None) -> None:
        model = item.data(Qt.ItemDataRole.UserRole) if item is not None else None
        if isinstance(model, LocalModel) and not model.partial:
            self.gguf_path.setText(str(model.path))
            self.radios["gguf"].setChecked(True)

    def _browse_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Model folder")
        if folder:
            self.folder_path.setText(folder)
            self.radios["folder"].setChecked(True)

    def _browse_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "GGUF model", "", "GGUF models (*.gguf)")
        if path:
            self.gguf_path.setText(path)
            self.radios["gguf"].setChecked(True)

    def event(self, event: QEvent) -> bool:
        handled = super().event(event)
        if event.type() == QEvent.Type.LayoutRequest:
            self._grow_to_contents()
        return handled

    def _grow_to_contents(self) -> None:
        """Lines that arrive after the dialog is shown (the fit, the speed, a downloaded
        model): Qt's minimum for a dialog does not count word-wrapped lines at their wrapped
        height, so it would squeeze the fixed-height fields (the remote server's) instead."""
        need = self.sizeHint().height()
        if self.isVisible() and self.height() < need:
            self.resize(self.width(), need)

    def source(self) -> str:
        return next(s for s, radio in self.radios.items() if radio.isChecked())

    def choice(self) -> ModelChoice:
        """The picked model; raises ValueError with a one-line reason if it is incomplete."""
        source = self.source()
        if source == REMOTE_SPEC:
            return self._remote_choice()
        text = self.local_spec()
        if not text:
            raise ValueError("Enter a path or a hub id first.")
        options: dict[str, Any] = {}
        if not self.draft:  # a draft model runs on its model's engine, in its context
            options["engine"] = self.engine.currentData()
            if self.context.value():
                options["context_length"] = self.context.value()
        if source == "hub":
            if not self.consent.isChecked():
                raise ValueError("Tick 'Allow downloading' to fetch a model from the hub.")
            options["allow_download"] = True
        return ModelChoice(text, options)

    def _check_fit(self) -> None:
        """ValueError with one line for a model that cannot fit; where a smaller context
        fits, the context box is set to it first, so the next OK loads that."""
        est = self.estimate
        if est is None or est.fits:
            return
        spec = self.local_spec() or ""
        name = "The bundled model" if spec == "default" else spec.rstrip("/").split("/")[-1]
        if est.fitting_context:
            self.context.setValue(est.fitting_context)
            raise ValueError(f"{est.refusal(name)}: the context is set to that, press OK to "
                             "load with it.")
        raise ValueError(f"{est.refusal(name)}.")

    def _remote_choice(self) -> ModelChoice:
        return ModelChoice(REMOTE_SPEC, self.remote.options())

    def _accept(self) -> None:
        try:
            choice = self.choice()
            if choice.spec == REMOTE_SPEC:
                self.remote.store_key(choice.options["base_url"])
            else:
                self._check_fit()
        except ValueError as exc:
            self.error.setText(str(exc))
            return
        if choice.spec != REMOTE_SPEC and self.settings is not None and not self.draft:
            self.settings.setValue(ENGINE_KEY + choice.spec, choice.options["engine"])
        self.accept()
