"""Make the README screenshots: the real window, offscreen, after two real greedy replies.

    QT_QPA_PLATFORM=offscreen .venv/bin/python packaging/screenshot.py assets/screenshot-chat.png \
        --hud assets/screenshot-hud.png --prefill assets/screenshot-prefill.png

--prefill then pastes a long document (about 6,000 tokens, made here) into a new chat, takes
the window while the placeholder reads between 30% and 70% of the prompt, and presses Stop;
the chat must keep the prompt and an empty reply marked stopped.
Uses throwaway chats and settings; never touches the user's data.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PySide6.QtCore import QCoreApplication, QEvent, QSettings, QTimer
from PySide6.QtWidgets import QApplication

from app.gui import build_backend, build_window
from engine import GenerationResult
from engine.events import PrefillProgress
from ui.main_window import MainWindow
from ui.store import STOPPED, ChatStore
from ui.theme import apply_theme

PROMPTS = [
    "Write a short Python function that reverses a string, with an example.",
    "Now in one sentence, why is it fast?",
]
OTHER_CHATS = ["Explain KV caching", "Hello there"]

PREFILL_SHOT_PERCENT = (30, 70)  # the shot is taken while this much of the prompt is read
PREFILL_WAIT_MS = 300_000  # give up if the prompt's reading never gets there
PREFILL_WORDS = 4_100  # about 6,000 tokens on the default model's tokenizer
# Empty until a new chat's first token: hidden (as from the HUD's Panels menu) so the live
# prefill view (the breakdown) and the cache ledger are in the shot.
PREFILL_HIDDEN_PANELS = ("ttft", "itl", "throughput")
LAYOUT_PASSES = 8  # more than the HUD's widgets are deep
_PERCENT = re.compile(r"Reading your prompt: (\d+)%")

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


def long_prompt(words: int = PREFILL_WORDS, seed: int = 18) -> str:
    """A pasted report of varied sentences under numbered headings, then a question."""
    rng = random.Random(seed)
    parts, count, section = [], 0, 0
    while count < words:
        section += 1
        parts.append(f"\n## {section}. {rng.choice(_TOPICS)}, week {rng.randint(1, 52)}\n")
        for _ in range(rng.randint(4, 8)):
            why = rng.choice(_WHY).format(n=rng.randint(2, 900))
            sentence = f"{rng.choice(_WHO)} {rng.choice(_DID)} {rng.choice(_WHAT)} {why}."
            parts.append(sentence)
            count += len(sentence.split())
    return ("Here is this month's report.\n" + " ".join(parts)
            + "\n\nSummarise the report above in three short bullet points.")


def settle_layout() -> None:
    """Apply the layouts that new texts asked for before a grab, without running the event
    loop (it would deliver the next chunk's progress first): a label's new height climbs one
    level a pass (card, panel column, scroll body)."""
    for _ in range(LAYOUT_PASSES):
        QCoreApplication.sendPostedEvents(None, QEvent.Type.LayoutRequest)


class PrefillShot:
    """Paste a long prompt into a new chat, take the window while it is being read, Stop."""

    def __init__(self, window: MainWindow, out: Path) -> None:
        self.window, self.out = window, out
        self.prompt = long_prompt()
        self.request_id = ""
        self.sent_at = 0.0
        self.stopped_at = 0.0
        self.failure = ""
        self.seen: list[str] = []  # the placeholder after each chunk

    def start(self, done: Callable[[], None]) -> None:
        """Send the prompt as a user would (paste, Send); `done()` runs when it is over."""
        w = self.window
        self._done = done
        w.sig_reply_started.connect(self._started)
        w.bridge.sig_prefill_progress.connect(self._progress)  # after the chat view's slot
        w.sig_reply_finished.connect(self._finished)
        w.sig_reply_failed.connect(lambda message: self._fail(f"the reply failed: {message}"))
        QTimer.singleShot(PREFILL_WAIT_MS, lambda: self._fail("the prompt was never read"))
        w.new_chat()
        for key in PREFILL_HIDDEN_PANELS:
            w.hud.set_panel_visible(key, False)
        w.composer.set_text(self.prompt)  # greedy, max tokens as for the replies before
        self.sent_at = time.monotonic()
        w.composer.button.click()

    def _started(self, request_id: str) -> None:
        self.request_id = self.request_id or request_id

    def _progress(self, event: PrefillProgress) -> None:
        if event.request_id != self.request_id or self.stopped_at:
            return
        status = self.window.chat.status_text(self.request_id)  # what the window shows
        self.seen.append(status)
        print(f"{time.monotonic() - self.sent_at:6.1f} s  {status}")
        found = _PERCENT.search(status)
        if found is None:
            return self._fail(f"the placeholder reads {status!r}")
        low, high = PREFILL_SHOT_PERCENT
        percent = int(found.group(1))
        if percent > high:
            return self._fail(f"the prompt was {percent}% read before a shot: {self.seen}")
        if percent >= low:
            self.window.hud.flush()  # the HUD's throttled redraw, as it is due
            settle_layout()
            self.window.grab().save(str(self.out))
            print(f"saved {self.out} at {status!r} ({event.total_tokens:,} prompt tokens)")
            self.stopped_at = time.monotonic()
            self.window.composer.button.click()  # Stop, as the user would

    def _finished(self, result: GenerationResult) -> None:
        if result.request_id != self.request_id:
            return
        if not self.stopped_at:
            return self._fail(f"the reply ended before a shot ({result.finish_reason}); "
                              f"placeholders seen: {self.seen}")
        print(f"Stop took {time.monotonic() - self.stopped_at:.2f} s "
              f"(finish reason {result.finish_reason})")
        self._check_saved()
        self._done()

    def _check_saved(self) -> None:
        """The chat keeps the pasted prompt and an empty reply marked stopped."""
        w = self.window
        chat_id = w.conversation_id
        messages = w.store.messages(chat_id) if chat_id else []
        kept = [(m.role, m.status, len(m.content)) for m in messages]
        if [(m.role, m.content) for m in messages[:1]] != [("user", self.prompt)] \
                or [(m.role, m.status, m.content) for m in messages[1:]] \
                != [("assistant", STOPPED, "")]:
            self._fail(f"the chat saved {kept}")
        else:
            print(f"saved chat: {kept}")

    def _fail(self, why: str) -> None:
        if not self.failure:
            self.failure = why
            print(f"prefill shot failed: {why}", file=sys.stderr)
            self._done()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--hud", type=Path, default=None,
                        help="also save the Performance panel alone, from the same run")
    parser.add_argument("--prefill", type=Path, default=None,
                        help="then save the window while a long pasted prompt is being read")
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
    shots: list[PrefillShot] = []

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
        if args.prefill is None:
            app.quit()
            return
        window.sig_reply_finished.disconnect(send_next)
        shots.append(PrefillShot(window, args.prefill))
        shots[0].start(app.quit)

    window.bridge.sig_model_loaded.connect(send_next)
    window.sig_reply_finished.connect(send_next)
    window.load_model(args.model)
    app.exec()
    window.close()
    backend.shutdown()
    store.close()
    scratch.cleanup()
    return 1 if any(shot.failure for shot in shots) else 0


if __name__ == "__main__":
    sys.exit(main())
