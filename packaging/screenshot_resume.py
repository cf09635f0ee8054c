"""Make issue 28's screenshots: the wait forecast, a document chip, and the HUD line of a chat's
turn restored from disk after a restart; the real window, offscreen, on the default model.

    QT_QPA_PLATFORM=offscreen .venv/bin/python packaging/screenshot_resume.py docs/img

Start 1: three greedy replies of distinct prompt sizes (the forecast says a time only after
such replies), then a pasted paragraph and a question typed: the composer once its forecast
shows the time (forecast.png). A new chat, a report (a Markdown file made here) attached
through the window's attach flow and a question typed: the composer with the document's chip
(document-chip.png); sent, and its KV snapshot written to disk. The app quits.
Start 2, a new engine and window on the same chats and cache: three short replies in another
chat (this session's prefill cost, which the HUD's "reading them would take" comes from), then
the document chat's next turn, restored from disk: the HUD's headline (hud-restored.png).
Uses throwaway chats, settings and cache (packaging/shots.py); never touches the user's data.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PySide6.QtCore import QPoint, QRect, QTimer
from PySide6.QtWidgets import QFrame
from shots import Scratch, greedy, report, save_grab

from engine import GenerationResult
from engine.backends import BackendRouter
from ui.main_window import MainWindow

# Three prompts of distinct sizes (words; ~1.45 tokens each): the forecast's cost line.
WARM_UP_WORDS = (60, 220, 500)
WARM_UP_QUESTION = "In one short sentence, what is this about?"
PASTED_WORDS = 250  # the forecast shot's message: a pasted paragraph and a question
PASTED_QUESTION = "Which of these weeks was the busiest?"
DOCUMENT_NAME = "harbour-report.md"
DOCUMENT_WORDS = 1_400  # about 2,000 tokens
DOCUMENT_QUESTION = "What does this report say about the harbour? One sentence."
NEXT_QUESTION = "And the budget?"
WARM_UP_TOKENS = 8
WAIT_S = 900.0  # give up on any one step after this long (the machine may be loaded)
POLL_MS = 100
HUD_MARGIN = 8  # pixels of the HUD kept below its headline card

Condition = Callable[[], bool]


class ResumeShots:
    """The two starts as one sequence of steps; each step waits on a condition, polled."""

    def __init__(self, scratch: Scratch, out: Path, max_tokens: int, windows: bool) -> None:
        self.scratch, self.out = scratch, out
        self.max_tokens, self.windows = max_tokens, windows
        self.files = tempfile.TemporaryDirectory(prefix="phasewise-shots-docs-")
        self.failure = ""
        self.finished: list[GenerationResult] = []
        self.loaded = False
        self.window: MainWindow | None = None
        self.backend: BackendRouter | None = None
        self._steps = self._script()
        self._waiting: tuple[str, Condition] | None = None
        self._since = 0.0
        self._timer = QTimer()
        self._timer.setInterval(POLL_MS)
        self._timer.timeout.connect(self._poll)

    def run(self) -> int:
        self._timer.start()
        self.scratch.app.exec()
        self._timer.stop()
        if self.window is not None and self.backend is not None:
            self.scratch.close_window(self.window, self.backend)
        self.files.cleanup()
        return 1 if self.failure else 0

    # ----- the driver ------------------------------------------------------------------
    def _poll(self) -> None:
        try:
            if self._waiting is not None:
                what, ready = self._waiting
                if not ready():
                    if time.monotonic() - self._since > WAIT_S:
                        raise RuntimeError(f"timed out waiting for {what}")
                    return
                print(f"{time.strftime('%H:%M:%S')}  {what}: done")
            self._waiting = next(self._steps)
            self._since = time.monotonic()
        except StopIteration:
            self.scratch.app.quit()
        except Exception as exc:  # any failure ends the run with its reason
            self.failure = str(exc)
            print(f"screenshots failed: {exc}", file=sys.stderr)
            self.scratch.app.quit()

    def _start_app(self) -> MainWindow:
        self.window, self.backend = self.scratch.open_window()
        self.loaded = False
        self.window.bridge.sig_model_loaded.connect(lambda _info: setattr(self, "loaded", True))
        self.window.bridge.sig_model_load_failed.connect(self._failed)
        self.window.sig_reply_finished.connect(self.finished.append)
        self.window.sig_reply_failed.connect(self._failed)
        self.window.load_model("default")
        return self.window

    def _quit_app(self) -> None:
        assert self.window is not None and self.backend is not None
        self.scratch.close_window(self.window, self.backend)
        self.window = self.backend = None

    def _failed(self, message: str) -> None:
        self.failure = self.failure or message

    def _replied(self, before: int) -> Condition:
        def ready() -> bool:
            if self.failure:
                raise RuntimeError(self.failure)
            return len(self.finished) > before
        return ready

    def _send(self, window: MainWindow, text: str, max_tokens: int) -> tuple[str, Condition]:
        """Type `text` and press Send, as the user does; the step waits for the reply."""
        before = len(self.finished)
        greedy(window, max_tokens)
        window.composer.set_text(text)
        window.composer.button.click()
        return f"reply {before + 1} ({window.pane.title_label.text()})", self._replied(before)

    @staticmethod
    def _type(window: MainWindow, text: str) -> tuple[str, Condition]:
        """Type `text` (documents attached before it count too); the step waits for the
        forecast of this message (debounced) with its time."""
        label = window.composer.forecast
        before = label.text()  # the last message's, until the forecast runs again
        window.composer.set_text(text)
        return ("the forecast with a time",
                lambda: label.text() != before and "to first token" in label.text())

    def _shot(self, window: MainWindow, name: str) -> None:
        """The composer: the message box, its chips and its forecast."""
        save_grab(window.composer, self.out / name)
        print(f"  forecast: {window.composer.forecast.text()!r}")
        if self.windows:
            save_grab(window, self.out / name.replace(".png", "-window.png"))

    # ----- the steps -------------------------------------------------------------------
    def _script(self) -> Iterator[tuple[str, Condition]]:
        # Start 1: the forecast's cost line, the forecast, a document chip, its snapshot.
        w = self._start_app()
        yield "the model loaded", lambda: self.loaded
        w.new_chat()
        for i, words in enumerate(WARM_UP_WORDS):
            yield self._send(w, f"{report(words, seed=i)}\n\n{WARM_UP_QUESTION}", WARM_UP_TOKENS)
        yield self._type(w, f"{report(PASTED_WORDS, seed=7)}\n\n{PASTED_QUESTION}")
        self._shot(w, "forecast.png")
        w.composer.clear()

        w.new_chat()
        document = Path(self.files.name) / DOCUMENT_NAME
        document.write_text(f"# Harbour report{report(DOCUMENT_WORDS, seed=28)}\n",
                            encoding="utf-8")
        w.attacher.attach([document])
        labels = w.composer.chips.labels()
        if len(labels) != 1:
            raise RuntimeError(f"the document was not attached: {w.notice_label.text()!r}")
        print(f"  chip: {labels[0]!r}")
        yield self._type(w, DOCUMENT_QUESTION)
        self._shot(w, "document-chip.png")
        before = len(self.scratch.snapshots())
        yield self._send(w, DOCUMENT_QUESTION, self.max_tokens)
        chat = w.conversation_id
        if chat is None:
            raise RuntimeError("the document chat was not saved")
        yield ("its snapshot on disk", lambda: len(self.scratch.snapshots()) > before)
        self._quit_app()
        for path in self.scratch.snapshots():
            print(f"  snapshot {path.name}: {path.stat().st_size / 1e6:.1f} MB")

        # Start 2: the same chats and cache, a new engine with nothing in memory.
        w = self._start_app()
        yield "the model loaded again", lambda: self.loaded
        w.new_chat()
        for i, words in enumerate(WARM_UP_WORDS):
            yield self._send(w, f"{report(words, seed=10 + i)}\n\n{WARM_UP_QUESTION}",
                             WARM_UP_TOKENS)
        w.open_conversation(chat)
        yield self._type(w, NEXT_QUESTION)
        print(f"  forecast: {w.composer.forecast.text()!r}")
        yield self._send(w, NEXT_QUESTION, self.max_tokens)
        metrics = self.finished[-1].metrics
        if not metrics.restored_tokens:
            raise RuntimeError("the turn was not restored from disk "
                               f"({metrics.cached_tokens} cached)")
        w.hud.flush()  # the HUD's throttled redraw, as it is due
        advice = w.hud.advice_label.text()
        print(f"  HUD: {advice!r}")
        if "reading them would take" not in advice:
            raise RuntimeError("the HUD does not say what the restore saved")
        self._hud_shot(w, "hud-restored.png")

    def _hud_shot(self, window: MainWindow, name: str) -> None:
        """The HUD dock down to its headline card (the numbers and the advisor's line)."""
        dock = window.hud_dock
        card = window.hud.findChild(QFrame, "hudAdvisor")
        if card is None:
            raise RuntimeError("the HUD has no headline card (hudAdvisor)")
        bottom = card.mapTo(dock, QPoint(0, card.height())).y() + HUD_MARGIN
        save_grab(dock, self.out / name, QRect(0, 0, dock.width(), bottom))
        if self.windows:
            save_grab(window, self.out / name.replace(".png", "-window.png"))


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder the PNGs go to")
    parser.add_argument("--max-tokens", type=int, default=24,
                        help="the document chat's replies (the warm-ups get 8)")
    parser.add_argument("--windows", action="store_true",
                        help="also save the whole window at each shot (NAME-window.png)")
    args = parser.parse_args()
    scratch = Scratch()
    try:
        return ResumeShots(scratch, args.out, args.max_tokens, args.windows).run()
    finally:
        scratch.close()


if __name__ == "__main__":
    sys.exit(main())
