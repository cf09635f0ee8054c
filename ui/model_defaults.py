"""The model's own sampling defaults in the controls, unless the user moved a setting for it.

For temperature, top-p, top-k and repetition penalty the value comes from, in order: what the
user set while this model was loaded ("yours", remembered per model across restarts), the
model's generation_config (ModelInfo.sampling_defaults: "from model"), or the app's default
("default"). A small note beside each control says which.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from PySide6.QtCore import QObject, QSettings
from PySide6.QtWidgets import QDoubleSpinBox, QLabel, QSlider, QSpinBox

from engine.events import SamplingDefaults

SETTINGS_KEY = "sampling/by_model"  # JSON: {model name: {setting: control value}}
YOURS, FROM_MODEL, DEFAULT = "yours", "from model", "default"
TIPS = {YOURS: "You set this for this model (kept for it across restarts)",
        FROM_MODEL: "From the model's generation_config (what its authors suggest)",
        DEFAULT: "The app's default: the model suggests none"}


@dataclass(frozen=True)
class Sourced:
    """One control whose value can come from the model: its widget, the factor from the
    SamplingParams value to the control's (sliders hold hundredths), the app's default."""

    widget: QSlider | QSpinBox | QDoubleSpinBox
    scale: float
    default: float
    note: QLabel

    def get(self) -> float:
        return float(self.widget.value())

    def set(self, value: float) -> None:
        if isinstance(self.widget, QDoubleSpinBox):
            self.widget.setValue(value)
        else:
            self.widget.setValue(round(value))


class ModelDefaults(QObject):
    """Applies a model's sampling defaults to the controls and tracks where each value is from."""

    def __init__(self, sourced: dict[str, Sourced], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.sourced = sourced
        self.model: str | None = None
        self.yours: dict[str, dict[str, float]] = {}  # model name -> setting -> control value
        self._applying = False
        for name in sourced:
            self.show_source(name, DEFAULT)

    def setting_changed(self, name: str) -> None:
        """A control moved: the user's value for this model, unless a model load moved it."""
        if self._applying or self.model is None or name not in self.sourced:
            return
        self.yours.setdefault(self.model, {})[name] = self.sourced[name].get()
        self.show_source(name, YOURS)

    def use_model(self, name: str, defaults: SamplingDefaults) -> None:
        """A model is loaded: each setting from the user's value for it, else the model's
        own, else the app's default."""
        self.model = name
        own = self.yours.get(name, {})
        suggestions = asdict(defaults)
        self._applying = True
        try:
            for key, control in self.sourced.items():
                suggested = suggestions[key]
                if key in own:
                    control.set(own[key])
                    self.show_source(key, YOURS)
                elif suggested is not None:
                    control.set(suggested * control.scale)
                    self.show_source(key, FROM_MODEL)
                else:
                    control.set(control.default)
                    self.show_source(key, DEFAULT)
        finally:
            self._applying = False

    def source(self, name: str) -> str:
        return self.sourced[name].note.text()

    def show_source(self, name: str, source: str) -> None:
        note = self.sourced[name].note
        note.setText(source)
        note.setToolTip(TIPS[source])

    def save(self, settings: QSettings) -> None:
        settings.setValue(SETTINGS_KEY, json.dumps(self.yours))

    def restore(self, settings: QSettings) -> None:
        try:
            saved = json.loads(str(settings.value(SETTINGS_KEY, "{}")))
        except ValueError:
            return  # a hand-edited settings file: start afresh
        if isinstance(saved, dict):
            self.yours = {str(model): {str(k): float(v) for k, v in values.items()
                                       if k in self.sourced and isinstance(v, (int, float))}
                          for model, values in saved.items() if isinstance(values, dict)}
