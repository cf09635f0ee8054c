"""Browse models (ui/model_browser.py) from the window's model picker, against the fake hub on
loopback: consent first, search, a repository's quants with size and fit, a download with
progress, Cancel and resume, and the picker choosing the downloaded file."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import pytest
from PySide6.QtCore import Qt

from engine.model_files import models_dir
from engine.runtime_choice import gguf_engine
from engine.tools import speed
from engine.tools.hub import local_models
from tests.support.fake_hub import TINY_REPO, FakeHub, tiny_hub
from tests.support.speed import CountingMeasure
from ui import model_picker
from ui.model_browser import ModelBrowserDialog
from ui.model_picker import ModelPickerDialog

REPO = TINY_REPO
WAIT_MS = 30_000


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """The fake hub as huggingface_hub's own endpoint setting, and an empty models folder."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "unset")
    with tiny_hub(tmp_path, monkeypatch) as server:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.endpoint)
        yield server
        server.release.set()  # a held response never outlives its test


def open_browser(qtbot, make_window) -> tuple[ModelPickerDialog, ModelBrowserDialog]:
    window = make_window()
    picker = window.loads.picker()
    qtbot.addWidget(picker)
    qtbot.mouseClick(picker.browse_hub, Qt.MouseButton.LeftButton)
    assert picker.browser is not None and picker.browser.isVisible()
    return picker, picker.browser


def search(qtbot, browser: ModelBrowserDialog, text: str) -> None:
    browser.query.setText(text)
    qtbot.mouseClick(browser.search, Qt.MouseButton.LeftButton)
    # The search runs on the worker thread: nothing is listed before the event loop runs.
    assert browser.repos.count() == 0 and browser.busy()
    qtbot.waitUntil(lambda: not browser.busy() and browser.repos.count() > 0, timeout=WAIT_MS)


def open_repo(qtbot, browser: ModelBrowserDialog, row: int = 0) -> None:
    browser.repos.setCurrentRow(row)
    qtbot.waitUntil(lambda: not browser.busy() and browser.table.rowCount() > 0,
                    timeout=WAIT_MS)


def select_file(browser: ModelBrowserDialog, name: str) -> None:
    row = next(r for r in range(browser.table.rowCount())
               if browser.table.item(r, 1).text() == name)
    browser.table.selectRow(row)


def test_browse_search_fit_download_and_the_picker_takes_the_file(qtbot, make_window,
                                                                  fake: FakeHub) -> None:
    picker, browser = open_browser(qtbot, make_window)
    assert not browser.search.isEnabled()  # nothing goes out before the user agrees
    assert fake.requests == []
    browser.consent.setChecked(True)
    search(qtbot, browser, "tiny")
    assert browser.repos.item(0).text() == f"{REPO}  (7 downloads)"
    open_repo(qtbot, browser)
    rows = [[browser.table.item(r, c).text() for c in range(5)]
            for r in range(browser.table.rowCount())]
    assert [r[:2] for r in rows] == [["Q4_K_M", "tiny-Q4_K_M.gguf"], ["Q8_0", "tiny-Q8_0.gguf"]]
    assert all(r[2].endswith("MB") and r[3].startswith("Fits: needs ~") for r in rows), rows
    # How fast here: on the engine a GGUF runs on, from the (cached) measurement of this
    # computer, which the note under the table describes.
    engine = gguf_engine()
    assert browser.table.horizontalHeaderItem(4).text() == f"Speed here ({engine})"
    assert all(re.fullmatch(r"~[\d,]+ tok/s, 4,000-token prompt ~[\d.]+ s", r[4])
               for r in rows), rows
    assert browser.speed_note.text().startswith(
        "Speed predicted from one measurement of this computer (cpu: Test CPU, 2 threads")
    assert f"{engine} on Bundled (Q4_1): decode 100 tok/s" in browser.speed_note.text()
    assert not browser.download.isEnabled()  # no file chosen yet
    asked = len(fake.requests)
    browser.context.setValue(2048)  # estimated again from what was read: no request
    qtbot.waitUntil(lambda: not browser.busy() and "at 2,048 tokens" in
                    browser.table.item(0, 3).text(), timeout=WAIT_MS)
    assert len(fake.requests) == asked
    select_file(browser, "tiny-Q4_K_M.gguf")
    with qtbot.waitSignal(browser.sig_downloaded, timeout=WAIT_MS) as got:
        qtbot.mouseClick(browser.download, Qt.MouseButton.LeftButton)
    path = Path(got.args[0])
    assert path == models_dir() / "tiny-Q4_K_M.gguf"
    assert path.read_bytes() == fake.repos[REPO].files["tiny-Q4_K_M.gguf"]
    assert browser.progress.value() == 1000 and "verified" in browser.status.text()
    assert picker.source() == "gguf" and picker.gguf_path.text() == str(path)
    assert picker.fit_label.text().startswith("Fits: needs ~")
    listed = [picker.downloaded.list.item(i).text() for i in range(picker.downloaded.list.count())]
    assert listed == ["tiny-Q4_K_M.gguf (1 MB)"]
    assert picker.choice().spec == str(path)


def test_cancel_keeps_the_partial_and_download_again_resumes(qtbot, make_window,
                                                             fake: FakeHub) -> None:
    _picker, browser = open_browser(qtbot, make_window)
    browser.consent.setChecked(True)
    search(qtbot, browser, "tiny")
    open_repo(qtbot, browser)
    # A new context re-estimates on the worker. Not busy must mean its result was handled:
    # handled during the download, it joined the download's thread and froze the window.
    browser.context.setValue(2048)
    qtbot.waitUntil(lambda: not browser.busy(), timeout=WAIT_MS)
    select_file(browser, "tiny-Q4_K_M.gguf")
    fake.fault("tiny-Q4_K_M.gguf", "hold:200000")
    browser.hub().progress_every_s = 0  # a report per read: one at the 200,000 held bytes
    held = 1000 * 200000 // len(fake.repos[REPO].files["tiny-Q4_K_M.gguf"])
    qtbot.mouseClick(browser.download, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: browser.progress.value() >= held, timeout=WAIT_MS)
    assert "of 1 MB" in browser.progress.format()
    assert browser.cancel.isEnabled() and not browser.download.isEnabled()
    qtbot.mouseClick(browser.cancel, Qt.MouseButton.LeftButton)
    fake.release.set()  # more bytes arrive: the download sees the cancel
    qtbot.waitUntil(lambda: not browser.busy() and "cancelled" in browser.status.text(),
                    timeout=WAIT_MS)
    assert "Download again to resume" in browser.status.text()
    [partial] = local_models()
    assert partial.partial and partial.size == 200000 and partial.total > 200000
    with qtbot.waitSignal(browser.sig_downloaded, timeout=WAIT_MS):
        qtbot.mouseClick(browser.download, Qt.MouseButton.LeftButton)
    data = fake.repos[REPO].files["tiny-Q4_K_M.gguf"]
    assert (models_dir() / "tiny-Q4_K_M.gguf").read_bytes() == data
    ranges = [rng for m, p, rng in fake.requests if m == "GET" and rng and rng.endswith("-")]
    assert ranges == ["bytes=0-", f"bytes={partial.size}-"]


def test_a_gated_repository_is_one_line_in_the_browser(qtbot, make_window,
                                                       fake: FakeHub) -> None:
    _picker, browser = open_browser(qtbot, make_window)
    browser.consent.setChecked(True)
    search(qtbot, browser, "gated")
    assert "gated: accept its license" in browser.repos.item(0).text()
    browser.repos.setCurrentRow(0)
    qtbot.waitUntil(lambda: not browser.busy() and "hf auth login" in browser.status.text(),
                    timeout=WAIT_MS)
    assert "\n" not in browser.status.text() and browser.table.rowCount() == 0


def test_downloaded_models_are_listed_chosen_and_removed_but_not_the_one_in_use(
        qtbot, fake: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = models_dir()
    folder.mkdir(parents=True)
    used = folder / "used.gguf"
    used.write_bytes(fake.repos[REPO].files["tiny-Q4_K_M.gguf"])
    (folder / "spare.gguf").write_bytes(b"GGUF" + b"\0" * 1000)
    dialog = ModelPickerDialog(load_options={"device": "cpu"}, loaded_path=str(used))
    qtbot.addWidget(dialog)
    box = dialog.downloaded
    assert [box.list.item(i).text() for i in range(box.list.count())] == [
        "spare.gguf (0 MB)", "used.gguf (1 MB)  (in use)"]
    box.list.setCurrentRow(1)
    assert dialog.source() == "gguf" and dialog.gguf_path.text() == str(used)
    assert not box.remove.isEnabled()
    box.list.setCurrentRow(0)
    monkeypatch.setattr(model_picker, "confirm", lambda *_a, **_k: True)
    qtbot.mouseClick(box.remove, Qt.MouseButton.LeftButton)
    assert not (folder / "spare.gguf").exists() and used.exists()
    assert box.note.text().startswith("Removed spare.gguf")


def test_this_computer_is_measured_once_off_the_gui_thread_and_then_reused(
        qtbot, make_window, fake: FakeHub, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cache" / speed.SPEED_FILE).unlink()  # a machine not measured yet
    measure = CountingMeasure(hold=True)
    monkeypatch.setattr(speed, "measure_engine", measure)
    # Opening the browser starts the measurement; closing it stops it (nothing cached).
    _picker, browser = open_browser(qtbot, make_window)
    qtbot.waitUntil(lambda: len(measure.calls) == 1, timeout=WAIT_MS)
    assert browser.measuring() and "Measuring this computer once" in browser.speed_note.text()
    browser.reject()
    assert not browser.measuring() and speed.SpeedProfiles().cached(gguf_engine()) is None
    # Opened again, it measures again, and the window goes on meanwhile: a search answers.
    _picker, browser = open_browser(qtbot, make_window)
    qtbot.waitUntil(lambda: len(measure.calls) == 2, timeout=WAIT_MS)
    browser.consent.setChecked(True)
    search(qtbot, browser, "tiny")
    open_repo(qtbot, browser)
    assert browser.measuring()
    assert [browser.table.item(r, 4).text() for r in range(2)] == ["measuring…"] * 2
    assert not browser.measure_again.isVisible()
    measure.release.set()
    qtbot.waitUntil(lambda: not browser.measuring(), timeout=WAIT_MS)
    assert all("4,000-token prompt" in browser.table.item(r, 4).text() for r in range(2))
    assert browser.speed_note.text().startswith("Speed predicted from one measurement")
    assert browser.measure_again.isVisible()
    browser.reject()
    # A new browser takes the cached measurement: no third one.
    _picker, browser = open_browser(qtbot, make_window)
    assert not browser.measuring() and browser.speed is not None
    assert len(measure.calls) == 2
    # Unless the user asks for one.
    qtbot.mouseClick(browser.measure_again, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not browser.measuring(), timeout=WAIT_MS)
    assert len(measure.calls) == 3 and browser.speed.when == "call 3"


def test_a_hugging_face_folder_shows_fit_and_speed_on_torch_and_is_chosen_by_hub_id(
        qtbot, make_window, fake: FakeHub, tiny_model_dir: Path) -> None:
    files = {p.name: p.read_bytes() for p in tiny_model_dir.iterdir() if p.is_file()}
    fake.add("someone/Tiny-Llama", files, kind="folder", downloads=3)
    picker, browser = open_browser(qtbot, make_window)
    browser.consent.setChecked(True)
    search(qtbot, browser, "tiny")
    listed = [browser.repos.item(i).text() for i in range(browser.repos.count())]
    assert listed == [f"{REPO}  (7 downloads)",
                      "someone/Tiny-Llama  (Hugging Face folder for torch, 3 downloads)"]
    browser.repos.setCurrentRow(1)
    qtbot.waitUntil(lambda: not browser.busy() and browser.table.rowCount() == 1
                    and browser.table.item(0, 0).text() == "F32", timeout=WAIT_MS)
    row = [browser.table.item(0, c).text() for c in range(5)]
    assert row[1] == "the folder (1 safetensors file)" and row[3].startswith("Fits: needs ~")
    assert browser.table.horizontalHeaderItem(4).text() == "Speed here (torch)"
    assert re.fullmatch(r"~[\d,]+ tok/s, a 4,000-token prompt is over its context", row[4])
    assert "torch on Bundled (Q4_1)" in browser.speed_note.text()
    asked = len(fake.requests)
    browser.context.setValue(128)  # estimated again from what was read: no request
    qtbot.waitUntil(lambda: not browser.busy() and "at 128 tokens" in
                    browser.table.item(0, 3).text(), timeout=WAIT_MS)
    assert len(fake.requests) == asked
    browser.table.selectRow(0)
    assert browser.download.text() == "Choose (downloads when loaded)"
    qtbot.mouseClick(browser.download, Qt.MouseButton.LeftButton)
    assert not browser.isVisible()
    assert picker.source() == "hub" and picker.hub_id.text() == "someone/Tiny-Llama"
    assert picker.consent.isChecked() and picker.choice().options["allow_download"]


def test_a_busy_measurement_is_shown_then_taken_again_when_the_machine_is_idle(
        qtbot, make_window, fake: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from tests.support.speed import fake_speed

    engine = gguf_engine()
    speed.SpeedProfiles().put(engine, speed.speed_device(engine),
                              replace(fake_speed(engine), loadavg=5.0))
    measure = CountingMeasure(hold=True)
    monkeypatch.setattr(speed, "measure_engine", measure)
    monkeypatch.setattr(speed, "_loadavg", lambda: 0.2)
    _picker, browser = open_browser(qtbot, make_window)
    assert browser.speed is not None and browser.speed.busy  # shown meanwhile
    qtbot.waitUntil(lambda: measure.calls == [engine], timeout=WAIT_MS)
    measure.release.set()
    qtbot.waitUntil(lambda: not browser.measuring(), timeout=WAIT_MS)
    assert browser.speed is not None and not browser.speed.busy
    assert "busy then" not in browser.speed_note.text()
