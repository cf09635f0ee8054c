"""Make the README screenshots: the real window, offscreen, after two real greedy replies.

    QT_QPA_PLATFORM=offscreen .venv/bin/python packaging/screenshot.py assets/screenshot-chat.png \
        --hud assets/screenshot-hud.png --prefill assets/screenshot-prefill.png

--prefill then pastes a long document (about 6,000 tokens, made here) into a new chat, takes
the window while the placeholder reads between 30% and 70% of the prompt, and presses Stop;
the chat must keep the prompt and an empty reply marked stopped.
Uses throwaway chats, settings and cache (packaging/shots.py); never touches the user's data.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PySide6.QtCore import QTimer
from shots import Scratch, greedy, report, save_grab

from engine import GenerationResult
from engine.events import PrefillProgress
from ui.main_window import MainWindow
from ui.store import STOPPED

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
_PERCENT = re.compile(r"Reading your prompt: (\d+)%")


def long_prompt(words: int = PREFILL_WORDS, seed: int = 18) -> str:
    """A pasted report of varied sentences under numbered headings, then a question."""
    return ("Here is this month's report.\n" + report(words, seed)
            + "\n\nSummarise the report above in three short bullet points.")


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
            save_grab(self.window, self.out)
            print(f"  at {status!r} ({event.total_tokens:,} prompt tokens)")
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
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--hud", type=Path, default=None,
                        help="also save the Performance panel alone, from the same run")
    parser.add_argument("--prefill", type=Path, default=None,
                        help="then save the window while a long pasted prompt is being read")
    args = parser.parse_args()
    scratch = Scratch()
    for title in OTHER_CHATS:
        scratch.store.create_conversation(title)
    window, backend = scratch.open_window()
    window.new_chat()
    prompts = list(PROMPTS)
    shots: list[PrefillShot] = []

    def send_next(*_args: object) -> None:
        if prompts:
            greedy(window, args.max_tokens)
            window.send(prompts.pop(0))
        else:
            QTimer.singleShot(500, save)  # let the HUD's throttled redraw land

    def save() -> None:
        save_grab(window, args.out)
        if args.hud is not None:
            save_grab(window.hud_dock, args.hud)
        if args.prefill is None:
            scratch.app.quit()
            return
        window.sig_reply_finished.disconnect(send_next)
        shots.append(PrefillShot(window, args.prefill))
        shots[0].start(scratch.app.quit)

    window.bridge.sig_model_loaded.connect(send_next)
    window.sig_reply_finished.connect(send_next)
    window.load_model(args.model)
    scratch.app.exec()
    scratch.close_window(window, backend)
    scratch.close()
    return 1 if any(shot.failure for shot in shots) else 0


if __name__ == "__main__":
    sys.exit(main())
