"""Make issue 29's screenshots: the model browser (a search, a repository's quants with fit and
how fast here), a download in progress, and the model picker after it; the real window,
offscreen, through the app's own factory.

    QT_QPA_PLATFORM=offscreen .venv/bin/python packaging/screenshot_models.py docs/img

This machine cannot reach the hub, so the browser talks to a stand-in on loopback
(tests/support/fake_hub.py, through huggingface_hub's own endpoint setting) serving real files:
the bundled SmolLM2-135M-Instruct (Q4_1) and its requantizations to Q8_0 and Q4_K_M (llama.cpp's
quantizer, in a child process). Fit and speed are the app's own, read from those files' headers
by range request; the speed comes from this machine's measurement, taken by the browser as a
user's first visit takes it (a minute or two). Throwaway chats, settings, cache and models
folder (packaging/shots.py); nothing of the user's is read or written.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import huggingface_hub.constants
from PySide6.QtWidgets import QApplication, QLabel
from shots import Scratch, save_grab

from engine.model_files import default_gguf_path
from tests.support.fake_hub import FakeHub

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
REQUANTIZED = {"Q8_0": 7, "Q4_K_M": 15}  # llama.cpp's file types
DOWNLOAD = "smollm2-135m-instruct-q4_k_m.gguf"
HELD_SHARE = 0.42  # the download shot holds the file this far in
WAIT_S = float(os.environ.get("SHOTS_WAIT_S", "900"))

QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.allow_requantize = True
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""


def requantize(source: Path, target: Path, ftype: int) -> bytes:
    """`source` requantized by llama.cpp in a child process (native code), as bytes."""
    subprocess.run([sys.executable, "-c", QUANTIZE, str(source), str(target), str(ftype)],
                   check=True, capture_output=True)
    return target.read_bytes()


def wait_until(condition: Callable[[], bool], what: str, status: QLabel) -> None:
    """Run the event loop until `condition` holds (the browser works on its own threads)."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}; the browser says: {status.text()}")
        QApplication.processEvents()
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    scratch = Scratch()
    try:
        bundled = default_gguf_path()
        files = {"smollm2-135m-instruct-q4_1.gguf": bundled.read_bytes()}
        for quant, ftype in REQUANTIZED.items():
            target = scratch.root / f"smollm2-135m-instruct-{quant.lower()}.gguf"
            files[target.name] = requantize(bundled, target, ftype)
        hub = FakeHub()
        hub.add(REPO, files, downloads=48_213)
        with hub:
            huggingface_hub.constants.ENDPOINT = hub.endpoint
            huggingface_hub.constants.HF_HUB_OFFLINE = False
            shoot(scratch, hub, args.out)
    finally:
        scratch.close()


def shoot(scratch: Scratch, hub: FakeHub, out: Path) -> None:
    window, backend = scratch.open_window()
    try:
        picker = window.loads.picker()
        picker.show()
        picker.browse_hub.click()
        browser = picker.browser
        assert browser is not None

        def wait(condition: Callable[[], bool], what: str) -> None:
            wait_until(condition, what, browser.status)

        browser.resize(1100, 560)
        browser.consent.setChecked(True)
        browser.query.setText("SmolLM2-135M")
        browser.search.click()
        wait(lambda: not browser.busy() and browser.repos.count() > 0, "the search")
        browser.repos.setCurrentRow(0)
        wait(lambda: not browser.busy() and browser.table.rowCount() > 0
                   and not browser.measuring(), "the quants and this machine's measurement")
        row = next(r for r in range(browser.table.rowCount())
                   if browser.table.item(r, 1).text() == DOWNLOAD)
        browser.table.selectRow(row)
        save_grab(browser, out / "models-browser.png")
        size = len(hub.repos[REPO].files[DOWNLOAD])
        hub.fault(DOWNLOAD, f"hold:{int(size * HELD_SHARE)}")
        browser.hub().progress_every_s = 0
        browser.download.click()
        wait(lambda: browser.progress.value() >= int(1000 * HELD_SHARE) - 1,
                   "the download to reach the held share")
        save_grab(browser, out / "models-download.png")
        downloaded: list[str] = []
        browser.sig_downloaded.connect(downloaded.append)
        hub.release.set()
        wait(lambda: bool(downloaded), "the download to finish")
        wait(lambda: not browser.busy(), "the browser to settle")
        browser.close()
        save_grab(picker, out / "models-picker.png")
        picker.close()
    finally:
        scratch.close_window(window, backend)


if __name__ == "__main__":
    main()
