"""What the screenshot scripts (screenshot.py, screenshot_resume.py) share: the real window
through the app's own factory on throwaway chats, settings and cache, greedy replies, made-up
reports to paste or attach, and grabs taken with the layout settled.

Imported from those scripts as a sibling module (run them as `python packaging/NAME.py`).
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PySide6.QtCore import QCoreApplication, QEvent, QRect, QSettings
from PySide6.QtWidgets import QApplication, QWidget

from app.gui import build_backend, build_window
from engine.backends import BackendRouter
from engine.model_files import kv_snapshot_dir
from ui.main_window import MainWindow
from ui.store import ChatStore
from ui.theme import apply_theme

CACHE_ENV = "PHASEWISE_CACHE_DIR"  # engine/model_files.py: converted models, KV snapshots
WINDOW_SIZE = (1400, 860)
LAYOUT_PASSES = 8  # more than the HUD's widgets are deep

_WHO = ["The night shift", "Our supplier in Lyon", "The river survey team", "Mara's lab",
        "The finance office", "A volunteer from Tromsø", "The build server", "The school board",
        "The bakery on Elm Street", "Ravi", "The orchard cooperative", "The port authority"]
_DID = ["reported", "measured", "rejected", "scheduled", "rewrote", "audited", "postponed",
        "photographed", "estimated", "shipped", "questioned", "archived"]
_WHAT = ["the quarterly budget", "three broken pumps", "a draft of the safety rules",
         "the tide tables", "seventeen crates of apples", "the migration plan",
         "a noisy ventilation fan", "the library's opening hours", "the bridge inspection",
         "an old customer survey", "the compiler upgrade", "the spring concert"]
_WHY = ["because the forecast changed", "after a long meeting", "without telling anyone",
        "to save about {n} euros", "while the road was closed", "for the {n}th time",
        "before the deadline on day {n}", "as the manual suggests on page {n}"]
_TOPICS = ["Operations", "Harbour", "Budget", "Research", "Schools", "Harvest", "Software"]


def report(words: int, seed: int) -> str:
    """A made-up report of about `words` words: varied sentences under numbered headings
    (about 1.45 tokens a word on the default model's tokenizer)."""
    rng = random.Random(seed)
    parts: list[str] = []
    count, section = 0, 0
    while count < words:
        section += 1
        parts.append(f"\n## {section}. {rng.choice(_TOPICS)}, week {rng.randint(1, 52)}\n")
        for _ in range(rng.randint(4, 8)):
            why = rng.choice(_WHY).format(n=rng.randint(2, 900))
            sentence = f"{rng.choice(_WHO)} {rng.choice(_DID)} {rng.choice(_WHAT)} {why}."
            parts.append(sentence)
            count += len(sentence.split())
    return " ".join(parts)


def settle_layout() -> None:
    """Apply the layouts that new texts asked for before a grab, without running the event
    loop (it would deliver the next chunk's progress first): a label's new height climbs one
    level a pass (card, panel column, scroll body)."""
    for _ in range(LAYOUT_PASSES):
        QCoreApplication.sendPostedEvents(None, QEvent.Type.LayoutRequest)


def save_grab(widget: QWidget, out: Path, area: QRect | None = None) -> None:
    """Save the widget as on screen (only `area` of it, in its own coordinates, if given)."""
    settle_layout()
    image = widget.grab(area) if area is not None else widget.grab()
    out.parent.mkdir(parents=True, exist_ok=True)
    if not image.save(str(out)):
        raise OSError(f"could not write {out}")
    print(f"saved {out} ({image.width()}x{image.height()})")


def greedy(window: MainWindow, max_tokens: int) -> None:
    """The next replies greedy (the same words every run) and at most `max_tokens` long."""
    window.controls.temperature.setValue(0)
    window.controls.max_tokens.setValue(max_tokens)


class Scratch:
    """The app's QApplication and theme, and a temporary folder for the chats, the settings
    and the cache (CACHE_ENV: the KV snapshots and anything converted), so nothing of the
    user's is read or written. Windows opened on it share those, as the app's restarts do."""

    def __init__(self) -> None:
        existing = QApplication.instance()
        self.app = existing if isinstance(existing, QApplication) else QApplication([])
        apply_theme(self.app)
        self._folder = tempfile.TemporaryDirectory(prefix="phasewise-shots-")
        self.root = Path(self._folder.name)
        self._cache_before = os.environ.get(CACHE_ENV)
        os.environ[CACHE_ENV] = str(self.root / "cache")
        self.store = ChatStore(self.root / "chats.sqlite3")
        self.settings = QSettings(str(self.root / "settings.ini"), QSettings.Format.IniFormat)

    def open_window(self) -> tuple[MainWindow, BackendRouter]:
        """A start of the app: a new engine (router) and window, as app.gui wires them."""
        backend = build_backend().start()
        window = build_window(backend, self.store, self.settings, hud_calibrate=False)
        window.resize(*WINDOW_SIZE)
        window.show()
        return window, backend

    @staticmethod
    def close_window(window: MainWindow, backend: BackendRouter) -> None:
        """The app quits: the window closes (replies stopped, settings saved), then the
        engine (its snapshot writer finishes first)."""
        window.close()
        backend.shutdown()

    def snapshots(self) -> list[Path]:
        """The KV snapshot files on disk now."""
        folder = kv_snapshot_dir()  # under this scratch's cache while it is open
        return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []

    def close(self) -> None:
        self.store.close()
        if self._cache_before is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = self._cache_before
        self._folder.cleanup()
