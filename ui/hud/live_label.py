"""A label for text that changes at every redraw (live numbers) without re-laying out the dock.

QLabel.setText always invalidates its parent's layout, and that relayout re-shapes the text of
every changed word-wrapped label up the scroll area, several times (size hint, height for
width, resize): measured at about a quarter of the HUD's redraw cost, all of it on the GUI
thread a decode shares. This widget asks for a new layout only when the text's height at the
current width changes; otherwise a new text is just a repaint of its own rectangle.
"""

from __future__ import annotations

import math

from PySide6.QtCore import QEvent, QSize
from PySide6.QtGui import (
    QAbstractTextDocumentLayout,
    QPainter,
    QPaintEvent,
    Qt,  # QtGui's Qt namespace has mightBeRichText
    QTextDocument,
)
from PySide6.QtWidgets import QSizePolicy, QWidget

_MIN_WIDTH = 40  # px: the narrowest a wrapped label may be squeezed


class LiveLabel(QWidget):
    """Plain or rich text (detected like QLabel's AutoText), optionally word-wrapped."""

    def __init__(self, text: str = "", *, word_wrap: bool = False,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._text = ""
        self._word_wrap = word_wrap
        self._doc = QTextDocument(self)
        self._doc.setDocumentMargin(0)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Minimum)
        self.setText(text)

    # ----- QLabel's interface, as far as the HUD uses it ---------------------------------
    def text(self) -> str:
        return self._text

    def setText(self, text: str) -> None:
        if text == self._text:
            return
        before = self._needed_height()
        self._text = text
        if Qt.mightBeRichText(text):
            self._doc.setHtml(text)
        else:
            self._doc.setPlainText(text)
        if self._needed_height() != before or self._too_wide():
            self.updateGeometry()
        self.update()

    def _needed_height(self) -> int:
        """The text's height at the current width (unwrapped: on one line)."""
        return self._height_for(self.width())

    def _too_wide(self) -> bool:
        """Unwrapped text wider than the rectangle the layout gave this label."""
        if self._word_wrap:
            return False
        self._doc.setTextWidth(-1)
        return math.ceil(self._doc.idealWidth()) > self.width()

    # ----- geometry ----------------------------------------------------------------------
    def hasHeightForWidth(self) -> bool:
        return self._word_wrap

    def heightForWidth(self, width: int) -> int:
        return self._height_for(width)

    def sizeHint(self) -> QSize:
        self._doc.setTextWidth(-1)
        ideal = math.ceil(self._doc.idealWidth())
        if self._word_wrap:
            ideal = min(ideal, 360)
        return QSize(ideal, self._height_for(ideal))

    def minimumSizeHint(self) -> QSize:
        if self._word_wrap:
            return QSize(_MIN_WIDTH, self._height_for(max(self.width(), _MIN_WIDTH)))
        return self.sizeHint()

    def _height_for(self, width: int) -> int:
        self._doc.setTextWidth(width if self._word_wrap and width > 0 else -1)
        return math.ceil(self._doc.size().height())

    # ----- painting and style ------------------------------------------------------------
    def paintEvent(self, event: QPaintEvent) -> None:
        self._doc.setTextWidth(self.width() if self._word_wrap else -1)
        painter = QPainter(self)
        context = QAbstractTextDocumentLayout.PaintContext()
        context.palette = self.palette()  # the style sheet's colour lands in the palette
        context.palette.setColor(context.palette.ColorRole.Text,
                                 self.palette().color(self.foregroundRole()))
        self._doc.documentLayout().draw(painter, context)
        painter.end()

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() in (QEvent.Type.FontChange, QEvent.Type.StyleChange):
            self._doc.setDefaultFont(self.font())
            self.updateGeometry()
