"""A child process that runs the real app (app.cli.entry, the `phasewise` program) and ends it
the way a user does, at a chosen moment: tests/app/test_exit_paths.py runs it and checks the exit.

    python -m tests.support.exit_driver MODE [phasewise arguments...]

The driver makes the QApplication first (run_gui takes the one that exists), finds the main
window once it is shown, and acts on what the window emits:

- close-streaming / ctrl-q-streaming: at the reply's first token, close the window / press
  Ctrl+Q on it (and answer Yes to the question it asks, printing {"asked": its text});
- signal-streaming: at the first token, print "STREAMING" (the parent sends SIGTERM or SIGINT);
- close-loading: as soon as the window shows, while the model still loads;
- close-beside: while chat 1 streams, chat 2 sends a long prompt; at its first progress (the
  prompt is being read beside the stream), close the window.

Before acting it prints one JSON line, {"acted": MODE, ...the state it saw}. The process then
ends exactly as the installed app does: run_gui's shutdown, then entry()'s settle. As the
interpreter starts to finalize (atexit), it prints {"threads_at_exit": [...]}: our threads
still alive then, which must be none (a thread inside native code there aborts the process,
though only when it comes back at the wrong moment).
"""

from __future__ import annotations

import atexit
import json
import sys
import threading
from typing import Any

STREAM_PROMPT = "Count from 1 to 500, one number per line."
LONG_PROMPT_WORDS = 1200  # about 1,500 tokens: read beside the stream (over SIDE_MIN_TOKENS)


class Driver:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.window: Any = None
        self.loaded = False
        self.tokens: dict[str, int] = {}  # request id -> tokens seen
        self.first_request: str | None = None
        self.acted = False
        self.answer: Any = None  # ctrl-q-streaming: the timer that answers the quit question

    def find_window(self) -> None:
        """Polled until the app's main window exists, then hooked."""
        from PySide6.QtWidgets import QApplication

        from ui.main_window import MainWindow

        windows = [w for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow)]
        if not windows or self.window is not None:
            return
        self.window = window = windows[0]
        self.poll.stop()
        bridge = window.bridge
        bridge.sig_model_loaded.connect(self.on_loaded)
        bridge.sig_token.connect(self.on_token)
        bridge.sig_prefill_progress.connect(self.on_prefill_progress)
        if self.mode == "close-loading":
            self.act(window.close)

    def on_loaded(self, _info: object) -> None:
        self.loaded = True
        if self.mode == "close-loading":
            return
        window = self.window
        window.controls.temperature.setValue(0)
        window.controls.max_tokens.setValue(2048)
        window.composer.set_text(STREAM_PROMPT)
        assert window.send(window.composer.text()), window.notice_label.text()

    def on_token(self, event: Any) -> None:
        request = event.request_id
        self.tokens[request] = self.tokens.get(request, 0) + 1
        self.first_request = self.first_request or request
        if self.acted or request != self.first_request:
            return
        window = self.window
        if self.mode == "close-streaming":
            self.act(window.close)
        elif self.mode == "ctrl-q-streaming":
            self.act(lambda: self.press_ctrl_q(window))
        elif self.mode == "signal-streaming":
            self.act(lambda: print("STREAMING", flush=True))
        elif self.mode == "close-beside" and self.tokens[request] == 1:
            window.new_chat()
            window.composer.set_text(" ".join(["word"] * LONG_PROMPT_WORDS) + "\nSummarize.")
            assert window.send(window.composer.text()), window.notice_label.text()

    def on_prefill_progress(self, event: Any) -> None:
        if (self.mode == "close-beside" and not self.acted
                and self.first_request not in (None, event.request_id)):
            self.act(self.window.close)

    def press_ctrl_q(self, window: Any) -> None:
        """Ctrl+Q while a reply streams asks first (MainWindow.quit): answer Yes, as a user
        would, once the question shows, and print it ({"asked": text})."""
        from PySide6.QtCore import Qt, QTimer
        from PySide6.QtTest import QTest

        self.answer = QTimer()
        self.answer.timeout.connect(self.answer_quit_question)
        self.answer.start(10)
        window.activateWindow()
        QTest.keyClick(window, Qt.Key.Key_Q, Qt.KeyboardModifier.ControlModifier)

    def answer_quit_question(self) -> None:
        from PySide6.QtWidgets import QApplication, QMessageBox

        box = QApplication.activeModalWidget()
        if isinstance(box, QMessageBox):
            self.answer.stop()
            print(json.dumps({"asked": box.text()}), flush=True)
            box.button(QMessageBox.StandardButton.Yes).click()

    def act(self, action: Any) -> None:
        self.acted = True
        streaming = self.first_request in {
            r.request_id for r in self.window.session.replies.values()}
        print(json.dumps({"acted": self.mode, "loaded": self.loaded, "streaming": streaming,
                          "tokens": self.tokens}), flush=True)
        action()


def report_threads_at_exit() -> None:
    alive = [t.name for t in threading.enumerate() if t.name.startswith("phasewise-")]
    print(json.dumps({"threads_at_exit": alive}), flush=True)


def main() -> None:
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    mode, args = sys.argv[1], sys.argv[2:]
    app = QApplication(["phasewise"])
    driver = Driver(mode)
    driver.poll = QTimer(app)
    driver.poll.timeout.connect(driver.find_window)
    driver.poll.start(10)
    sys.argv = ["phasewise", *args]
    atexit.register(report_threads_at_exit)

    from app.cli import entry

    entry()


if __name__ == "__main__":
    main()
