"""The About box: the version the app was built as and the model it is running."""

from __future__ import annotations

import html

from PySide6.QtCore import QCoreApplication
from PySide6.QtWidgets import QMessageBox, QWidget

from engine import ModelInfo


def about_text(model: ModelInfo | None) -> str:
    """Version (set by the app from pyproject) and the loaded model, as rich text."""
    version = QCoreApplication.applicationVersion() or "development build"
    running = (
        f"<p>Model: {html.escape(model.name)} on {model.device} ({model.dtype})</p>"
        if model else ""
    )
    return (
        f"<h3>Phasewise {version}</h3>"
        "<p>Chat with local language models and see where the time goes: queue, "
        "prefill and decode, live.</p>" + running
    )


def show_about(parent: QWidget, model: ModelInfo | None) -> None:
    QMessageBox.about(parent, "About Phasewise", about_text(model))
