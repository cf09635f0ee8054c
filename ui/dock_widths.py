"""The right-hand column of docks: built, and given its width back when the window grows again.

Qt squeezes the docks once the window shrinks past the central widget's minimum, and gives
every pixel of a later growth to the central widget: after a trip to the minimum size and
back, the settings and the HUD would stay narrow (the HUD scrolling sideways). This keeps the
width the user chose (the first layout's, a drag of the dock separator, or the one saved at
close) and hands it back to the docks whenever the window grows.
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, QSettings, Qt
from PySide6.QtGui import QResizeEvent
from PySide6.QtWidgets import QDockWidget, QMainWindow, QWidget

WIDTH_KEY = "window/dock_width"  # QSettings: the docks' chosen width, in pixels
TOP_HEIGHT, BOTTOM_HEIGHT = 250, 650  # the column's first split (the bottom dock gets more)


def dock_column(window: QMainWindow, width: int, top: tuple[str, str, QWidget],
                bottom: tuple[str, str, QWidget]) -> tuple[QDockWidget, QDockWidget]:
    """Two docks stacked on the window's right, `width` wide at first; each is (title, object
    name for the saved layout, widget)."""
    upper, lower = (_dock(window, *spec) for spec in (top, bottom))
    window.splitDockWidget(upper, lower, Qt.Orientation.Vertical)
    window.resizeDocks([upper, lower], [TOP_HEIGHT, BOTTOM_HEIGHT], Qt.Orientation.Vertical)
    window.resizeDocks([upper], [width], Qt.Orientation.Horizontal)
    return upper, lower


def _dock(window: QMainWindow, title: str, name: str, widget: QWidget) -> QDockWidget:
    dock = QDockWidget(title, window)
    dock.setObjectName(name)
    dock.setWidget(widget)
    window.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, dock)
    return dock


class DockWidths(QObject):
    """Remembers the chosen width of a column of docks and restores it as room allows."""

    def __init__(self, window: QMainWindow, dock: QDockWidget, width: int) -> None:
        super().__init__(window)
        self.window = window
        self.dock = dock  # one dock of the column: resizing it resizes the column
        self.wanted = width
        window.installEventFilter(self)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if watched is self.window:
            if event.type() == QEvent.Type.MouseButtonRelease:  # a dock separator was dragged
                self.remember()
            elif isinstance(event, QResizeEvent) and grew(event):
                self.restore()
        return False

    def remember(self) -> None:
        """The docks' width now is the one the user wants (they are not squeezed)."""
        if self.dock.isVisible() and not self.dock.isFloating():
            self.wanted = self.dock.width()

    def restore(self) -> None:
        """Give the docks back their chosen width, as far as the central widget's minimum
        allows (Qt clamps it)."""
        if self.dock.isVisible() and not self.dock.isFloating() \
                and self.dock.width() < self.wanted:
            self.window.resizeDocks([self.dock], [self.wanted], Qt.Orientation.Horizontal)

    def load(self, settings: QSettings) -> None:
        saved = settings.value(WIDTH_KEY)
        if saved is not None and str(saved).isdigit():
            self.wanted = int(saved)

    def save(self, settings: QSettings) -> None:
        settings.setValue(WIDTH_KEY, self.wanted)


def grew(event: QResizeEvent) -> bool:
    return event.size().width() > event.oldSize().width()
