"""Sampling controls and the per-conversation system prompt. Changes apply to the next request.

Sliders hold integers, so each maps to its real value here: temperature in hundredths (0-2,
0 = greedy), top-p in hundredths (0.05-1), max tokens 1..context length (with a number box
beside it: at ~30 tokens per pixel the slider alone cannot pick an exact count). Advanced: top-k
(0 = off), repetition penalty (1 = off), min-p (0 = off), seed (blank = random), and
speculative decoding: prompt lookup, or a draft model the user picks (the window loads it; this
panel shows which one is loaded). "Chat too long" says what a send does once a chat outgrows the
model's context: refuse it, or leave the oldest turns out of the prompt (the chat keeps them).
Temperature, top-p, top-k and repetition penalty start from the loaded model's own defaults
unless the user set them for it (ui/model_defaults.py).
"""

from __future__ import annotations

from PySide6.QtCore import QSettings, Qt, Signal
from PySide6.QtGui import QValidator
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGridLayout,
    QGroupBox,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSlider,
    QSpinBox,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine import SamplingParams
from engine.params import SEED_LIMIT, Overflow, Speculative
from engine.protocol import Capabilities
from ui.model_defaults import ModelDefaults, Sourced

DEFAULT_CONTEXT = 2048
SETTINGS_GROUP = "sampling"
# (label, GenerationRequest.speculative); greedy output is identical with any of them.
SPECULATIVE_MODES = (
    ("Off", None),
    ("Prompt lookup (greedy replies)", "ngram"),
    ("Draft model", "draft"),
)
# (label, GenerationRequest.overflow): what a send does when the chat outgrows the context.
OVERFLOW_MODES = (
    ("Refuse to send", "refuse"),
    ("Drop the oldest turns", "drop_oldest"),
)
OVERFLOW_TIP = ("When a chat outgrows the model's context: refuse to send it (start a new chat), "
                "or leave its oldest turns out of the prompt. The system prompt and your new "
                "message always stay, and the chat itself keeps every turn.")
# Prompt lookup's drafts are checked greedily (engine/core/speculative.py): a sampled reply decodes
# plainly, so the panel says so instead of leaving the setting a silent no-op.
NGRAM_SAMPLED_NOTE = ("Prompt lookup speeds up greedy replies only: at a temperature above 0 "
                      "replies decode plainly.")


class SeedValidator(QValidator):
    """A seed is empty (random) or a whole number 0..2**63 - 1, what SamplingParams takes:
    letters, signs and out-of-range numbers cannot be typed or pasted."""

    def validate(self, text: str, pos: int) -> tuple[QValidator.State, str, int]:
        stripped = text.strip()
        if not stripped:
            return QValidator.State.Acceptable, text, pos
        if stripped.isdigit() and stripped.isascii() and int(stripped) < SEED_LIMIT:
            return QValidator.State.Acceptable, text, pos
        return QValidator.State.Invalid, text, pos


def _slider(lo: int, hi: int, value: int) -> QSlider:
    slider = QSlider(Qt.Orientation.Horizontal)
    slider.setRange(lo, hi)
    slider.setValue(value)
    return slider


class ControlsPanel(QWidget):
    """Temperature / top-p / max tokens sliders, advanced sampling, and the system prompt."""

    sig_setting_changed = Signal(str, object)
    """A sampling setting changed: (name, new value); marks the HUD's time plots."""
    sig_system_prompt_changed = Signal(str)
    """The system prompt was edited (applies to the current conversation)."""
    sig_draft_requested = Signal()
    """The user wants to choose a draft model (Choose…, or Draft model with none loaded)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("controls")
        self.temperature = _slider(0, 200, 70)
        self.top_p = _slider(5, 100, 100)
        self.max_tokens = _slider(1, DEFAULT_CONTEXT, 512)
        self.max_tokens_box = QSpinBox()  # the exact count; kept in step with the slider
        self.max_tokens_box.setRange(1, DEFAULT_CONTEXT)
        self.max_tokens_box.setValue(self.max_tokens.value())
        self.max_tokens_box.setKeyboardTracking(False)  # typing 512 is one change, not three
        self.max_tokens_box.setAccessibleName("Max tokens")
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 1000)
        self.top_k.setSpecialValueText("off")
        self.min_p = QDoubleSpinBox()
        self.min_p.setRange(0.0, 0.99)
        self.min_p.setSingleStep(0.01)
        self.min_p.setSpecialValueText("off")
        self.repetition_penalty = QDoubleSpinBox()
        self.repetition_penalty.setRange(1.0, 2.0)
        self.repetition_penalty.setSingleStep(0.05)
        self.repetition_penalty.setSpecialValueText("off")
        self.repetition_penalty.setToolTip("Above 1 makes tokens already in the chat less "
                                           "likely: stops a small model repeating one line")
        self.seed = QLineEdit()
        self.seed.setPlaceholderText("random")
        self._seed_validator = SeedValidator(self.seed)
        self.seed.setValidator(self._seed_validator)
        self.seed.setToolTip("Blank for random, or a whole number from 0 to 2**63 - 1")
        self.speculative = QComboBox()
        for label, mode in SPECULATIVE_MODES:
            self.speculative.addItem(label, mode)
        # Its width comes from the dock, not from its longest mode: the settings column may
        # narrow (a small window gives the chat priority); the open list shows modes in full.
        self.speculative.setSizeAdjustPolicy(
            QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.speculative.setMinimumContentsLength(10)
        self.speculative.setToolTip(
            "Decode several tokens per step from cheap guesses the model then checks: the "
            "reply is the same, only faster when the guesses are right.")
        self.overflow = QComboBox()
        for label, overflow in OVERFLOW_MODES:
            self.overflow.addItem(label, overflow)
        self.overflow.setToolTip(OVERFLOW_TIP)
        self.draft_label = QLabel("none")
        self.draft_label.setObjectName("valueLabel")
        self.draft_button = QPushButton("Choose…")
        self.draft_button.setToolTip("Pick a small model with the same vocabulary to draft for "
                                     "this one (e.g. a smaller model of the same family).")
        self.draft_name: str | None = None
        self.speculative_note = QLabel(NGRAM_SAMPLED_NOTE)  # shown while lookup would not run
        self.speculative_note.setObjectName("editBanner")
        self.speculative_note.setWordWrap(True)
        self.speculative_note.hide()
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setObjectName("systemPrompt")
        self.system_prompt.setPlaceholderText("System prompt for this chat (optional)")
        self.system_prompt.setMaximumHeight(90)
        self.system_prompt.setTabChangesFocus(True)  # Tab moves on; it never types a tab
        self._labels: dict[str, QLabel] = {}
        self._wanted_max_tokens: int | None = None
        self.source_notes = {name: QLabel() for name in
                             ("temperature", "top_p", "top_k", "repetition_penalty")}
        for note in self.source_notes.values():
            note.setObjectName("valueLabel")
        self.model_defaults = ModelDefaults({  # "from model" / "yours" / "default" notes
            "temperature": Sourced(self.temperature, 100, 70, self.source_notes["temperature"]),
            "top_p": Sourced(self.top_p, 100, 100, self.source_notes["top_p"]),
            "top_k": Sourced(self.top_k, 1, 0, self.source_notes["top_k"]),
            "repetition_penalty": Sourced(self.repetition_penalty, 1, 1.0,
                                          self.source_notes["repetition_penalty"]),
        }, self)
        self._build()
        self._wire()
        self._refresh_labels()

    # ----- layout ------------------------------------------------------------------------
    def _build(self) -> None:
        grid = QGridLayout()
        grid.setColumnStretch(1, 1)
        rows = [("temperature", "Temperature", self.temperature),
                ("top_p", "Top-p", self.top_p),
                ("max_tokens", "Max tokens", self.max_tokens)]
        for row, (key, title, slider) in enumerate(rows):
            grid.addWidget(QLabel(title), row, 0)
            grid.addWidget(slider, row, 1)
            if key == "max_tokens":
                grid.addWidget(self.max_tokens_box, row, 2)
                continue
            label = QLabel()
            label.setObjectName("valueLabel")
            label.setMinimumWidth(52)
            label.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            self._labels[key] = label
            grid.addWidget(label, row, 2)
            grid.addWidget(self.source_notes[key], row, 3)

        self.advanced_toggle = QToolButton()
        self.advanced_toggle.setText("Advanced")
        self.advanced_toggle.setCheckable(True)
        self.advanced_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.advanced_toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.advanced = QGroupBox()
        self.advanced.setFlat(True)
        form = QFormLayout(self.advanced)
        for title, key, box in (("Top-k", "top_k", self.top_k),
                                ("Repetition penalty", "repetition_penalty",
                                 self.repetition_penalty)):
            sourced = QGridLayout()
            sourced.setColumnStretch(0, 1)
            sourced.addWidget(box, 0, 0)
            sourced.addWidget(self.source_notes[key], 0, 1)
            form.addRow(title, sourced)
        form.addRow("Min-p", self.min_p)
        form.addRow("Seed", self.seed)
        form.addRow("Speculative", self.speculative)
        form.addRow("Chat too long", self.overflow)
        draft_row = QGridLayout()
        draft_row.setColumnStretch(0, 1)
        draft_row.addWidget(self.draft_label, 0, 0)
        draft_row.addWidget(self.draft_button, 0, 1)
        form.addRow("Draft model", draft_row)
        self.advanced.hide()

        layout = QVBoxLayout(self)
        layout.setContentsMargins(10, 8, 10, 8)
        layout.addLayout(grid)
        layout.addWidget(self.advanced_toggle)
        layout.addWidget(self.advanced)
        layout.addWidget(self.speculative_note)
        heading = QLabel("System prompt")
        heading.setObjectName("sectionHeading")
        layout.addWidget(heading)
        layout.addWidget(self.system_prompt)
        layout.addStretch(1)

    def focus_order(self) -> list[QWidget]:
        """The controls in reading order, as Tab should reach them (the advanced ones only
        while shown)."""
        return [self.temperature, self.top_p, self.max_tokens, self.max_tokens_box,
                self.advanced_toggle, self.top_k, self.repetition_penalty, self.min_p,
                self.seed, self.speculative, self.draft_button, self.system_prompt]

    def _wire(self) -> None:
        self.temperature.valueChanged.connect(lambda _v: self._changed("temperature"))
        self.top_p.valueChanged.connect(lambda _v: self._changed("top_p"))
        self.max_tokens.valueChanged.connect(lambda _v: self._changed("max_tokens"))
        self.max_tokens_box.valueChanged.connect(self.max_tokens.setValue)  # reported by it
        self.top_k.valueChanged.connect(lambda _v: self._changed("top_k"))
        self.min_p.valueChanged.connect(lambda _v: self._changed("min_p"))
        self.repetition_penalty.valueChanged.connect(
            lambda _v: self._changed("repetition_penalty"))
        self.sig_setting_changed.connect(
            lambda name, _v: self.model_defaults.setting_changed(name))
        self.seed.editingFinished.connect(lambda: self._changed("seed"))
        self.speculative.currentIndexChanged.connect(self._speculative_changed)
        self.draft_button.clicked.connect(self.sig_draft_requested)
        self.advanced_toggle.toggled.connect(self._toggle_advanced)
        self.system_prompt.textChanged.connect(
            lambda: self.sig_system_prompt_changed.emit(self.system_prompt.toPlainText())
        )

    def _toggle_advanced(self, shown: bool) -> None:
        self.advanced.setVisible(shown)
        arrow = Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow
        self.advanced_toggle.setArrowType(arrow)

    def _changed(self, name: str) -> None:
        self._refresh_labels()
        self.sig_setting_changed.emit(name, getattr(self.params(), name))

    def _refresh_labels(self) -> None:
        temp = self.temperature.value() / 100
        self.speculative_note.setVisible(self.speculative_mode() == "ngram" and temp > 0)
        self._labels["temperature"].setText("greedy" if temp == 0 else f"{temp:.2f}")
        self._labels["top_p"].setText(f"{self.top_p.value() / 100:.2f}")
        self.max_tokens_box.setValue(self.max_tokens.value())  # no signal when it holds it

    # ----- values ------------------------------------------------------------------------
    def params(self) -> SamplingParams:
        """The SamplingParams the next request will use."""
        return SamplingParams(
            temperature=self.temperature.value() / 100,
            top_p=self.top_p.value() / 100,
            top_k=self.top_k.value(),
            min_p=round(self.min_p.value(), 2),
            repetition_penalty=round(self.repetition_penalty.value(), 2),
            max_tokens=self.max_tokens.value(),
            seed=self._seed(),
        )

    def speculative_mode(self) -> Speculative | None:
        """GenerationRequest.speculative for the next request."""
        return self.speculative.currentData()

    def overflow_mode(self) -> Overflow:
        """GenerationRequest.overflow for the next request."""
        mode: Overflow = self.overflow.currentData()
        return mode

    def set_draft_model(self, name: str | None) -> None:
        """Show the loaded draft model (None: none; Draft model mode falls back to Off)."""
        self.draft_name = name
        self.draft_label.setText(name or "none")
        if name is None and self.speculative_mode() == "draft":
            self.speculative.setCurrentIndex(0)

    def keep_loaded_draft(self) -> None:
        """A draft choice came to nothing (cancelled, refused, failed): show the draft that is
        still loaded, or fall back to Off if there is none."""
        self.set_draft_model(self.draft_name)

    def set_capabilities(self, capabilities: Capabilities) -> None:
        """Offer what the backend runs: speculative decoding and draft models are local-engine
        features (a remote server decodes its own way)."""
        self.speculative.setEnabled(bool(capabilities.speculative))
        self.draft_button.setEnabled(capabilities.draft_model)
        # A server decides itself what an over-long prompt gets; the choice stays for later.
        self.overflow.setEnabled(capabilities.drop_oldest_turns)
        self.overflow.setToolTip(OVERFLOW_TIP if capabilities.drop_oldest_turns else
                                 "This backend decides itself what a chat too long for its "
                                 "context gets.")
        if not capabilities.runs(self.speculative_mode()):
            self.speculative.setCurrentIndex(0)

    def _speculative_changed(self, _index: int) -> None:
        if self.speculative_mode() == "draft" and self.draft_name is None:
            self.sig_draft_requested.emit()
        self._refresh_labels()
        self.sig_setting_changed.emit("speculative", self.speculative_mode() or "off")

    def _seed(self) -> int | None:
        """The seed field's number (the request validates its range), None when blank. setText
        bypasses the validator, so a bad value can only come from a file: it is sent as typed
        and refused with a one-line reason, never read as random."""
        text = self.seed.text().strip()
        if not text:
            return None
        return int(text) if text.lstrip("-").isdigit() and text.isascii() else -1

    def set_context_length(self, context_length: int) -> None:
        """Max tokens ranges up to the loaded model's context length."""
        self.max_tokens.setMaximum(max(1, context_length))
        self.max_tokens_box.setMaximum(self.max_tokens.maximum())
        if self._wanted_max_tokens is not None:  # a saved value the old range had clamped
            self.max_tokens.setValue(self._wanted_max_tokens)
        self._refresh_labels()

    def system_prompt_text(self) -> str:
        return self.system_prompt.toPlainText()

    def set_system_prompt(self, text: str) -> None:
        """Show a conversation's system prompt without reporting it as an edit."""
        blocked = self.system_prompt.blockSignals(True)
        self.system_prompt.setPlainText(text)
        self.system_prompt.blockSignals(blocked)

    # ----- QSettings -------------------------------------------------------------------------
    def save(self, settings: QSettings) -> None:
        settings.beginGroup(SETTINGS_GROUP)
        settings.setValue("temperature", self.temperature.value())
        settings.setValue("top_p", self.top_p.value())
        settings.setValue("max_tokens", self.max_tokens.value())
        settings.setValue("top_k", self.top_k.value())
        settings.setValue("min_p", self.min_p.value())
        settings.setValue("seed", self.seed.text())
        # A draft model is not reloaded at start, so only prompt lookup is remembered.
        mode = self.speculative_mode()
        settings.setValue("speculative", mode if mode == "ngram" else "off")
        settings.setValue("overflow", self.overflow_mode())
        settings.endGroup()
        self.model_defaults.save(settings)

    def restore(self, settings: QSettings) -> None:
        settings.beginGroup(SETTINGS_GROUP)
        for name, widget in (("temperature", self.temperature), ("top_p", self.top_p),
                             ("max_tokens", self.max_tokens), ("top_k", self.top_k)):
            value = settings.value(name)
            if value is not None:
                widget.setValue(int(value))
        saved_max = settings.value("max_tokens")
        self._wanted_max_tokens = int(saved_max) if saved_max is not None else None
        min_p = settings.value("min_p")
        if min_p is not None:
            self.min_p.setValue(float(min_p))
        seed = str(settings.value("seed", "") or "")
        if self._seed_validator.validate(seed, 0)[0] == QValidator.State.Acceptable:
            self.seed.setText(seed)  # a hand-edited settings file may hold anything
        if settings.value("speculative") == "ngram":
            self.speculative.setCurrentIndex(self.speculative.findData("ngram"))
        overflow = self.overflow.findData(settings.value("overflow"))
        if overflow >= 0:  # a hand-edited settings file may hold anything
            self.overflow.setCurrentIndex(overflow)
        settings.endGroup()
        self.model_defaults.restore(settings)
        self._refresh_labels()
