"""Make the README screenshots: the real window, offscreen, after two real greedy replies.

    QT_QPA_PLATFORM=offscreen .venv/bin/python packaging/screenshot.py assets/screenshot-chat.png \
        --hud assets/screenshot-hud.png

Uses throwaway chats and settings; never touches the user's data.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PySide6.QtCore import QSettings, QTimer
from PySide6.QtWidgets import QApplication

from app.gui import build_backend, build_window
from ui.store import ChatStore
from ui.theme import apply_theme

PROMPTS = [
    "Write a short Python function that reverses a string, with an example.",
    "Now in one sentence, why is it fast?",
]
OTHER_CHATS = ["Explain KV caching", "Hello there"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--hud", type=Path, default=None,
                        help="also save the Performance panel alone, from the same run")
    args = parser.parse_args()
    app = QApplication([])
    apply_theme(app)
    scratch = tempfile.TemporaryDirectory()
    store = ChatStore(Path(scratch.name) / "chats.sqlite3")
    for title in OTHER_CHATS:
        store.create_conversation(title)
    settings = QSettings(str(Path(scratch.name) / "s.ini"), QSettings.Format.IniFormat)
    backend = build_backend().start()  # the app's own wiring: a router over the engine
    window = build_window(backend, store, settings, hud_calibrate=False)
    window.resize(1400, 860)
    window.show()
    window.new_chat()
    prompts = list(PROMPTS)

    def send_next(*_args: object) -> None:
        if prompts:
            window.controls.temperature.setValue(0)
            window.controls.max_tokens.setValue(args.max_tokens)
            window.send(prompts.pop(0))
        else:
            QTimer.singleShot(500, save)  # let the HUD's throttled redraw land

    def save() -> None:
        window.grab().save(str(args.out))
        print(f"saved {args.out}")
        if args.hud is not None:
            window.hud_dock.grab().save(str(args.hud))
            print(f"saved {args.hud}")
        app.quit()

    window.bridge.sig_model_loaded.connect(send_next)
    window.sig_reply_finished.connect(send_next)
    window.load_model(args.model)
    app.exec()
    window.close()
    backend.shutdown()
    store.close()
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
