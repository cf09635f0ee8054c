"""App-wide look: the style sheet and icon from assets/, on top of the system palette."""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication

STYLE_SHEET = "phasewise.qss"
ICON = "phasewise.svg"


def assets_dir() -> Path:
    """assets/ beside the source tree, or inside a PyInstaller bundle (sys._MEIPASS)."""
    bundle = getattr(sys, "_MEIPASS", None)
    if bundle and (Path(bundle) / "assets").is_dir():
        return Path(bundle) / "assets"
    return Path(__file__).resolve().parents[1] / "assets"


def apply_theme(app: QApplication) -> None:
    """Fusion follows the platform palette (light or dark) everywhere; the sheet adds shape."""
    app.setStyle("Fusion")
    sheet = assets_dir() / STYLE_SHEET
    if sheet.is_file():
        app.setStyleSheet(sheet.read_text(encoding="utf-8"))
    icon = assets_dir() / ICON
    if icon.is_file():
        app.setWindowIcon(QIcon(str(icon)))
