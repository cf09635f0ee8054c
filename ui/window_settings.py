"""The window's layout and the generation settings, restored at start and saved at close."""

from __future__ import annotations

from PySide6.QtCore import QByteArray, QSettings
from PySide6.QtWidgets import QMainWindow

from ui.controls import ControlsPanel

DEFAULT_SIZE = (1320, 820)  # the first start's window size


def restore_layout(window: QMainWindow, controls: ControlsPanel, settings: QSettings) -> None:
    """Geometry and dock layout as last saved (the default size on a first start), and the
    generation settings."""
    geometry = settings.value("window/geometry")
    if isinstance(geometry, QByteArray) and not geometry.isEmpty():
        window.restoreGeometry(geometry)
    else:
        window.resize(*DEFAULT_SIZE)
    state = settings.value("window/state")
    if isinstance(state, QByteArray) and not state.isEmpty():
        window.restoreState(state)
    controls.restore(settings)


def save_layout(window: QMainWindow, controls: ControlsPanel, settings: QSettings) -> None:
    settings.setValue("window/geometry", window.saveGeometry())
    settings.setValue("window/state", window.saveState())
    controls.save(settings)
    settings.sync()
