"""HUD look: one dark palette shared by the cards and the pyqtgraph plots."""

from __future__ import annotations

import time

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont, QPaintEvent, QWheelEvent
from PySide6.QtWidgets import QGraphicsItem

BG = "#15171c"
CARD = "#1d2027"
BORDER = "#2b2f38"
TEXT = "#d8dce3"
MUTED = "#8a93a3"
GRID = "#3a3f4a"

QUEUE = "#8e9bb4"
PREFILL = "#f0a93b"
DECODE = "#3fb6c4"
OTHER = "#596170"
CACHED = "#6cc070"
RECOMPUTED = "#f0a93b"
KEPT = "#5fa8f0"
CUT = "#474d59"
CHOSEN = "#ef6f7a"
P50, P90, P99 = "#8fcf72", "#e8c062", "#ef6f7a"
MARKER = "#b58cf0"

PHASE_COLORS = {"queue": QUEUE, "prefill": PREFILL, "decode": DECODE, "other": OTHER}

STYLE_SHEET = f"""
HudWidget, #hudScrollBody {{ background: {BG}; }}
QScrollArea {{ border: none; background: {BG}; }}
QFrame#hudCard {{ background: {CARD}; border: 1px solid {BORDER}; border-radius: 8px; }}
QFrame#hudAdvisor {{ background: #20262f; border: 1px solid #33506b; border-radius: 8px; }}
QLabel, LiveLabel {{ color: {TEXT}; background: transparent; border: none; }}
QLabel#hudTitle {{ font-weight: 600; font-size: 10.5pt; }}
#hudCaption, #hudReadout {{ color: {MUTED}; font-size: 8.5pt; }}
#hudKpiValue {{ font-size: 13pt; font-weight: 600; }}
QLabel#hudKpiName {{ color: {MUTED}; font-size: 8pt; }}
#hudAdvice {{ font-size: 9.5pt; }}
QLabel#hudPinned {{ color: {P90}; font-size: 8.5pt; }}
QLabel#hudSubject {{ font-weight: 600; }}
QToolButton, QComboBox {{
    color: {TEXT}; background: {CARD}; border: 1px solid {BORDER}; border-radius: 5px;
    padding: 3px 8px;
}}
QToolButton:hover, QComboBox:hover {{ border-color: #4a5262; }}
QToolButton#hudHide {{ border: none; color: {MUTED}; padding: 0 4px; }}
QComboBox QAbstractItemView {{ background: {CARD}; color: {TEXT}; }}
QMenu {{ background: {CARD}; color: {TEXT}; border: 1px solid {BORDER}; }}
QMenu::item:selected {{ background: #2d3440; }}
"""


def pen(color: str, width: float = 1.5, style: Qt.PenStyle = Qt.PenStyle.SolidLine) -> object:
    return pg.mkPen(QColor(color), width=width, style=style)


def brush(color: str, alpha: int = 255) -> object:
    c = QColor(color)
    c.setAlpha(alpha)
    return pg.mkBrush(c)


class HudPlot(pg.PlotWidget):
    """A PlotWidget that adds up the time its paints take: painting is the HUD's main cost
    and happens after a redraw returns, so the redraw throttle has to be told about it."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.paint_s = 0.0

    def paintEvent(self, event: QPaintEvent) -> None:
        started = time.perf_counter()
        super().paintEvent(event)
        self.paint_s += time.perf_counter() - started

    def wheelEvent(self, event: QWheelEvent) -> None:
        """The wheel scrolls what holds the plot (the HUD's column), never the plot: its view
        would take the event (and zoom, were the mouse enabled) even with pan and zoom off.
        Ignored here, Qt hands it on to the parent widgets, up to the scroll area."""
        event.ignore()

    def take_paint_s(self) -> float:
        """Seconds spent painting since the last call."""
        spent, self.paint_s = self.paint_s, 0.0
        return spent


def make_plot(height: int = 150) -> HudPlot:
    """A quiet plot: dark, light grid, no mouse pan/zoom (the dock scrolls instead)."""
    plot = HudPlot(background=CARD)
    plot.setMinimumHeight(height)
    plot.setMaximumHeight(height + 40)
    plot.setFocusPolicy(Qt.FocusPolicy.NoFocus)  # nothing to do there by keyboard: Tab skips it
    item = plot.getPlotItem()
    item.showGrid(x=True, y=True, alpha=0.18)
    item.setMouseEnabled(x=False, y=False)
    item.hideButtons()
    item.setMenuEnabled(False)
    font = QFont()
    font.setPointSizeF(7.5)
    for name in ("left", "bottom"):
        axis = item.getAxis(name)
        axis.setPen(pen(GRID, 1))
        axis.setTextPen(pen(MUTED, 1))
        axis.setStyle(tickFont=font)
        axis.label.setFont(font)
        # An axis (ticks, labels and the grid across the plot) is the costliest item to paint
        # and changes only with the range: keep it as a pixmap, so a new curve point repaints
        # the curve, not the text.
        axis.setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)
    return plot


def axis_label(plot: pg.PlotWidget, side: str, text: str, units: str | None = None) -> None:
    plot.getPlotItem().setLabel(side, text, units=units, color=MUTED)
