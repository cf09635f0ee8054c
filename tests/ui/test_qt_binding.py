"""The Qt binding must not leak references to None (PySide6 6.12.0 did, one per void call):
on Python < 3.12 a long session would drive None's count to zero and abort the process."""

from __future__ import annotations

import sys

from PySide6.QtWidgets import QLabel


def test_void_qt_calls_keep_none_alive(qtbot) -> None:
    label = QLabel()
    qtbot.addWidget(label)
    before = sys.getrefcount(None)
    for i in range(5000):
        label.setText(str(i))
    assert sys.getrefcount(None) >= before - 100  # 6.12.0: before - 5000
