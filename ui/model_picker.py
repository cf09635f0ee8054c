"""Choose a model: the bundled default, a local folder, a .gguf file, or a Hugging Face hub id.

A hub id downloads weights, so it needs an explicit consent tick. The dialog only picks; the
window asks the engine to load (in its thread) and shows progress in the status bar.
RemoteBackendInputs (URL, model, key) is shared with the Compare dialog.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QGridLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QRadioButton,
    QVBoxLayout,
    QWidget,
)

from engine.remote import REMOTE_SPEC, RemoteError, normalize_base_url, store_api_key


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


class ModelPickerDialog(QDialog):
    """Modal picker; `choice()` is valid after it was accepted."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
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
        self._build()

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
        remote_edits = [(REMOTE_SPEC, edit) for edit in self.remote.edits()]
        for source, edit in [("folder", self.folder_path), ("gguf", self.gguf_path),
                             ("hub", self.hub_id), *remote_edits]:
            edit.textEdited.connect(lambda _t, s=source: self.radios[s].setChecked(True))
        layout = QVBoxLayout(self)
        layout.addLayout(grid)
        layout.addWidget(self.error)
        layout.addWidget(self.buttons)

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

    def source(self) -> str:
        return next(s for s, radio in self.radios.items() if radio.isChecked())

    def choice(self) -> ModelChoice:
        """The picked model; raises ValueError with a one-line reason if it is incomplete."""
        source = self.source()
        if source == "default":
            return ModelChoice("default")
        if source == REMOTE_SPEC:
            return self._remote_choice()
        text = {"folder": self.folder_path, "gguf": self.gguf_path, "hub": self.hub_id}[
            source
        ].text().strip()
        if not text:
            raise ValueError("Enter a path or a hub id first.")
        if source == "hub":
            if not self.consent.isChecked():
                raise ValueError("Tick 'Allow downloading' to fetch a model from the hub.")
            return ModelChoice(text, {"allow_download": True})
        return ModelChoice(text)

    def _remote_choice(self) -> ModelChoice:
        return ModelChoice(REMOTE_SPEC, self.remote.options())

    def _accept(self) -> None:
        try:
            choice = self.choice()
            if choice.spec == REMOTE_SPEC:
                self.remote.store_key(choice.options["base_url"])
        except ValueError as exc:
            self.error.setText(str(exc))
            return
        self.accept()
