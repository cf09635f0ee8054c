"""HUD look: one dark palette shared by the cards and the pyqtgraph plots."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont

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
QLabel {{ color: {TEXT}; background: transparent; border: none; }}
QLabel#hudTitle {{ font-weight: 600; font-size: 10.5pt; }}
QLabel#hudCaption, QLabel#hudReadout {{ color: {MUTED}; font-size: 8.5pt; }}
QLabel#hudKpiValue {{ font-size: 13pt; font-weight: 600; }}
QLabel#hudKpiName {{ color: {MUTED}; font-size: 8pt; }}
QLabel#hudAdvice {{ font-size: 9.5pt; }}
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


def make_plot(height: int = 150) -> pg.PlotWidget:
    """A quiet plot: dark, light grid, no mouse pan/zoom (the dock scrolls instead)."""
    plot = pg.PlotWidget(background=CARD)
    plot.setMinimumHeight(height)
    plot.setMaximumHeight(height + 40)
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
    return plot


def axis_label(plot: pg.PlotWidget, side: str, text: str, units: str | None = None) -> None:
    plot.getPlotItem().setLabel(side, text, units=units, color=MUTED)
