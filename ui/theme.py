"""App-wide look: the style sheet and icon from assets/, on top of the system palette."""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QIcon, QPainter, QPaintEvent, QPalette, QPen
from PySide6.QtWidgets import QApplication, QFocusFrame, QWidget

STYLE_SHEET = "phasewise.qss"
ICON = "phasewise.svg"
RING_PX = 2  # the keyboard focus ring's width (QFocusFrame's margin outside the widget)
RING_RADIUS_PX = 4


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


class FocusRing(QFocusFrame):
    """A clear ring around the widget that has the keyboard focus (the platform's own mark is
    faint, and some widgets, such as sliders, show next to none): 2 px in the palette's
    highlight colour, just outside the widget (QFocusFrame's margins), so it never covers
    what the widget shows. One per window; it follows the focus as Tab moves it, and shows
    nothing for a click (the click shows where the focus went)."""

    def __init__(self, window: QWidget) -> None:
        super().__init__(window)
        self._window = window  # QFocusFrame moves to the focused widget's parent
        app = QApplication.instance()
        assert isinstance(app, QApplication)
        app.focusChanged.connect(self._follow)

    def _follow(self, _old: QWidget | None, new: QWidget | None) -> None:
        clicked = QApplication.mouseButtons() != Qt.MouseButton.NoButton
        if new is not None and new.window() is self._window and not clicked:
            self.setWidget(new)
        else:
            self.setWidget(None)  # type: ignore[arg-type]  # Qt takes nullptr: no ring

    def paintEvent(self, event: QPaintEvent) -> None:
        if self.widget() is None:
            return
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(QPen(self.palette().color(QPalette.ColorRole.Highlight), RING_PX))
        half = RING_PX / 2
        painter.drawRoundedRect(QRectF(self.rect()).adjusted(half, half, -half, -half),
                                RING_RADIUS_PX, RING_RADIUS_PX)
