"""The model picker: engine choice with auto's reason (remembered per model), will-it-fit
with a smaller context offered, and the conversion cache listed and removable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings

from engine.tools import fit
from tests.support.gguf import write_gguf
from ui.model_picker import ModelPickerDialog

WAIT_MS = 30_000


def sized_gguf(path: Path, free_fraction: float) -> Path:
    """A GGUF whose KV cache at 8,192 tokens needs free memory / free_fraction."""
    free = fit.free_memory()
    assert free is not None
    per_token = int(free / free_fraction / 8192)
    return write_gguf(path, layers=1, kv_heads=max(1, per_token // 256))


def picker(qtbot, **kw) -> ModelPickerDialog:
    dialog = ModelPickerDialog(load_options={"device": "cpu", "engine": "auto"}, **kw)
    qtbot.addWidget(dialog)
    return dialog


def choose_gguf(dialog: ModelPickerDialog, path: Path) -> None:
    dialog.radios["gguf"].setChecked(True)
    dialog.gguf_path.setText(str(path))


def test_default_model_shows_its_engine_reason_and_what_it_needs(qtbot) -> None:
    dialog = picker(qtbot)
    assert dialog.engine_reason.text().startswith("auto: ")
    assert dialog.fit_label.text().startswith("Fits: needs ~")
    assert dialog.fit_label.text().endswith(" free")
    dialog.engine.setCurrentIndex(dialog.engine.findData("torch"))
    assert "at 8,192 tokens" in dialog.fit_label.text()
    assert dialog.choice().options == {"engine": "torch"}


def test_a_model_that_fits_only_smaller_is_offered_that_context(qtbot, tmp_path: Path) -> None:
    dialog = picker(qtbot)
    choose_gguf(dialog, sized_gguf(tmp_path / "wide.gguf", 0.25))
    dialog.engine.setCurrentIndex(dialog.engine.findData("llama.cpp"))
    assert dialog.fit_label.text().startswith("Does not fit: ")
    dialog.buttons.accepted.emit()
    assert dialog.result() == 0  # not accepted: the offer comes first
    offered = dialog.context.value()
    assert 512 <= offered < 8192
    assert f"fits with a context of {offered:,} tokens" in dialog.error.text()
    assert "\n" not in dialog.error.text()
    assert dialog.fit_label.text().startswith("Fits: ")
    dialog.buttons.accepted.emit()
    assert dialog.result() == ModelPickerDialog.DialogCode.Accepted
    assert dialog.choice().options == {"engine": "llama.cpp", "context_length": offered}


def test_a_model_that_cannot_fit_is_refused_in_one_line(qtbot, tmp_path: Path) -> None:
    dialog = picker(qtbot)
    choose_gguf(dialog, sized_gguf(tmp_path / "huge.gguf", 0.001))
    dialog.engine.setCurrentIndex(dialog.engine.findData("llama.cpp"))
    dialog.buttons.accepted.emit()
    assert dialog.result() == 0
    assert "huge.gguf does not fit in memory" in dialog.error.text()
    assert "choose a smaller model" in dialog.error.text()
    assert dialog.context.value() == 0


def test_the_engine_is_remembered_per_model(qtbot, tmp_path: Path) -> None:
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    small = write_gguf(tmp_path / "small.gguf", layers=1, kv_heads=1)
    dialog = picker(qtbot, settings=settings)
    choose_gguf(dialog, small)
    dialog.engine.setCurrentIndex(dialog.engine.findData("torch"))
    dialog.buttons.accepted.emit()
    assert dialog.result() == ModelPickerDialog.DialogCode.Accepted
    again = picker(qtbot, settings=settings)
    assert again.engine.currentData() == "auto"  # the default model: nothing remembered
    choose_gguf(again, small)
    assert again.engine.currentData() == "torch"
    assert "auto would choose" in again.engine_reason.text()


def _converted(root: Path, name: str, source: Path, size: int) -> Path:
    folder = root / "models" / name
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"\0" * size)
    (folder / "phasewise-converted.json").write_text(json.dumps(
        {"source": source.name, "size": source.stat().st_size, "dtype": "torch.float32"}))
    return folder


def test_lines_that_arrive_after_showing_never_squeeze_the_fields(
        qtbot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Choosing a model adds wrapped lines (its fit, its speed) and a downloaded model adds a
    list: the dialog grows instead of squeezing the remote server's fields."""
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path / "cache"))
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    downloaded = write_gguf(models / "tiny-Q4_K_M.gguf", layers=1, kv_heads=1)
    dialog = picker(qtbot)
    dialog.show()
    qtbot.waitExposed(dialog)
    choose_gguf(dialog, downloaded)
    assert dialog.downloaded.list.count() == 1

    def fields_whole() -> None:
        for edit in dialog.remote.edits():
            assert edit.height() >= edit.sizeHint().height()
        assert dialog.height() >= dialog.sizeHint().height()

    qtbot.waitUntil(fields_whole, timeout=WAIT_MS)


def test_converted_models_are_listed_and_removed_but_never_the_one_in_use(
        qtbot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path / "cache"))
    used = tmp_path / "used.gguf"
    used.write_bytes(b"GGUF" + b"\0" * 60)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + b"\0" * 30)
    used_folder = _converted(tmp_path / "cache", "used-abc-fp32", used, 3_000_000)
    other_folder = _converted(tmp_path / "cache", "other-def-fp32", other, 2_000_000)
    (tmp_path / "cache" / "models" / ".converting-x").mkdir()  # being written: not listed
    answers: list[bool] = []
    monkeypatch.setattr("ui.model_picker.confirm", lambda *_a: answers.pop(0))

    box = picker(qtbot, loaded_path=str(used)).converted
    texts = [box.list.item(i).text() for i in range(box.list.count())]
    assert len(texts) == 2
    assert texts[0].startswith("used.gguf (float32, 3 MB)") and texts[0].endswith("(in use)")
    assert texts[1] == "other.gguf (float32, 2 MB)"
    box.list.setCurrentRow(0)
    assert not box.remove.isEnabled()  # the one in use
    box.list.setCurrentRow(1)
    assert box.remove.isEnabled()
    answers.append(False)
    box.remove.click()
    assert other_folder.exists() and box.list.count() == 2
    answers.append(True)
    box.remove.click()
    assert not other_folder.exists() and used_folder.exists()
    assert box.list.count() == 1
    assert box.note.text() == "Removed other.gguf: 2 MB freed"


def test_window_refuses_a_model_that_cannot_fit_and_keeps_its_own(
        qtbot, make_window, tiny_engine, tmp_path: Path) -> None:
    window = make_window()
    before = tiny_engine.model_info
    huge = sized_gguf(tmp_path / "huge.gguf", 0.001)
    with qtbot.waitSignal(window.bridge.sig_model_load_failed, timeout=WAIT_MS) as failed:
        window.loads.load_model(str(huge), engine="llama.cpp")
    assert "huge.gguf does not fit in memory" in failed.args[0]
    text = window.notice_label.text()
    assert text.startswith("Model not loaded: huge.gguf does not fit") and "\n" not in text
    assert tiny_engine.model_info == before


# ----- conversion progress -------------------------------------------------------------------
def test_conversion_progress_comes_from_the_engine_thread_per_percent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader counts tensors as it converts; the engine turns that into ModelLoadProgress
    events (at most one per percent), on the torch path only."""
    import threading

    from engine import ModelLoadFailed, ModelLoadProgress
    from engine.errors import ModelLoadError
    from engine.runtimes.torch import loader
    from engine.worker import Engine

    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path / "cache"))
    threads: set[str] = set()

    def fake_convert(gguf, target, record, dtype, notify, counted=None) -> None:
        for done in range(1, 401):  # 400 tensors: 100 whole percents
            counted(done, 400)
        raise ModelLoadError("stopped after counting")

    monkeypatch.setattr(loader, "_convert_gguf", fake_convert)
    events: list = []

    def keep(event) -> None:
        threads.add(threading.current_thread().name)
        events.append(event)

    with Engine() as engine:
        engine.add_listener(keep)
        engine.load_model(str(write_gguf(tmp_path / "m.gguf", layers=1, kv_heads=1)),
                          engine="torch").wait(WAIT_MS / 1000)
    progress = [e for e in events if isinstance(e, ModelLoadProgress)]
    assert [e.done for e in progress] == list(range(4, 401, 4))
    assert progress[-1].fraction == 1.0 and progress[0].stage == "converting GGUF"
    assert isinstance(events[-1], ModelLoadFailed)
    assert "stopped after counting" in events[-1].message
    assert threads == {"phasewise-engine"}


def test_the_window_shows_conversion_progress_as_a_percentage(qtbot, make_window) -> None:
    from engine import ModelLoadProgress

    window = make_window()
    window.bridge.sig_model_loading.emit("converting GGUF to safetensors (first start only)")
    assert window.status.progress.maximum() == 0  # busy
    window.bridge.sig_model_load_progress.emit(ModelLoadProgress(0, "converting GGUF", 42, 100))
    assert window.status.load_label.text() == "Converting GGUF: 42%"
    assert window.status.progress.maximum() == 100 and window.status.progress.value() == 42


# ----- the model's own sampling defaults -------------------------------------------------------
def _notes(window) -> dict[str, str]:
    return {name: window.controls.model_defaults.source(name)
            for name in ("temperature", "top_p", "top_k", "repetition_penalty")}


def test_user_settings_are_kept_per_model_across_a_restart(make_window) -> None:
    """The tiny model ships no sampling defaults: the app's, until the user moves one."""
    window = make_window()
    assert set(_notes(window).values()) == {"default"}
    assert window.controls.temperature.value() == 70
    window.controls.temperature.setValue(30)
    assert _notes(window)["temperature"] == "yours"
    window.close()
    again = make_window()
    assert again.controls.temperature.value() == 30
    assert _notes(again) == {"temperature": "yours", "top_p": "default", "top_k": "default",
                             "repetition_penalty": "default"}


def test_model_defaults_apply_unless_the_user_set_them_for_that_model(
        qtbot, tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import GenerationConfig

    from app.gui import build_backend, build_window
    from engine.worker import Engine
    from tests.support.tiny_model import build_tiny_model
    from ui.store import ChatStore

    suggests = build_tiny_model(tmp_path / "suggests")
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20,
                     repetition_penalty=1.1).save_pretrained(suggests)
    store = ChatStore(tmp_path / "chats.sqlite3")
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    with Engine() as engine:
        engine.load_model_sync(str(suggests), kernel="fp32-eager")
        window = build_window(build_backend(engine), store, settings, hud_calibrate=False)
        qtbot.addWidget(window)
        controls = window.controls
        params = controls.params()
        assert (params.temperature, params.top_p, params.top_k,
                params.repetition_penalty) == (0.6, 0.95, 20, 1.1)
        assert set(_notes(window).values()) == {"from model"}
        controls.top_k.setValue(5)
        assert _notes(window)["top_k"] == "yours" and _notes(window)["top_p"] == "from model"

        def load(folder: Path) -> None:
            with qtbot.waitSignal(window.bridge.sig_model_loaded, timeout=WAIT_MS):
                window.loads.load_model(str(folder), kernel="fp32-eager")

        load(tiny_model_dir)  # suggests nothing: the app's defaults, not the last model's
        assert (controls.params().temperature, controls.params().top_k) == (0.7, 0)
        assert set(_notes(window).values()) == {"default"}
        load(suggests)
        assert controls.params().top_k == 5 and controls.params().temperature == 0.6
        assert _notes(window) == {"temperature": "from model", "top_p": "from model",
                                  "top_k": "yours", "repetition_penalty": "from model"}
        window.close()
    store.close()


def test_a_context_beyond_the_model_s_limit_is_clamped_with_a_word(
    qtbot, tmp_path: Path
) -> None:
    """Issue 31 item 6: the box took 999,999 and the estimate silently used the model's
    limit."""
    dialog = picker(qtbot)
    choose_gguf(dialog, write_gguf(tmp_path / "short.gguf", layers=1, kv_heads=1, context=4096))
    dialog.engine.setCurrentIndex(dialog.engine.findData("llama.cpp"))
    dialog.context.setValue(999_999)
    assert dialog.context.value() == 4096
    assert dialog.fit_label.text().startswith(
        "Context set to the model's limit, 4,096 tokens (999,999 is more). Fits: needs ~")
    assert "at 4,096 tokens" in dialog.fit_label.text()
    assert dialog.choice().options == {"engine": "llama.cpp", "context_length": 4096}
    dialog.context.setValue(2048)  # within the limit: no word
    assert dialog.fit_label.text().startswith("Fits: needs ~")


def test_the_picker_reopens_on_the_model_in_use(qtbot, make_window, tiny_model_dir: Path) -> None:
    """Issue 31 item 10: reopened, it showed the bundled default whatever was loaded."""
    window = make_window()
    dialog = window.loads.picker()
    qtbot.addWidget(dialog)
    assert dialog.source() == "folder"
    assert dialog.folder_path.text() == str(tiny_model_dir)
    assert dialog.in_use.text() == f"In use: {tiny_model_dir.name} (torch, float32)"
    assert dialog.choice().spec == str(tiny_model_dir)
    draft = window.loads.picker(draft=True)  # a draft is another model: nothing preselected
    qtbot.addWidget(draft)
    assert draft.source() == "default" and draft.in_use.text() == ""


@pytest.mark.parametrize("source", ["gguf", "remote"])
def test_the_picker_fills_in_a_gguf_or_a_server_in_use(qtbot, tmp_path: Path,
                                                       source: str) -> None:
    from engine import ModelInfo

    path = str(write_gguf(tmp_path / "m.gguf", layers=1, kv_heads=1)) if source == "gguf" \
        else "http://gpu-box:8000/v1"
    info = ModelInfo(name="m" if source == "gguf" else "qwen", source=source, path=path,
                     device="cpu", dtype="Q4_K_M", context_length=4096, parameters=1,
                     weight_bytes_per_step=1, kernel="k", engine="llama.cpp")
    dialog = picker(qtbot, current=info)
    assert dialog.source() == source
    if source == "gguf":
        assert dialog.gguf_path.text() == path
        assert dialog.in_use.text() == "In use: m (llama.cpp, Q4_K_M)"
    else:
        assert (dialog.remote_url.text(), dialog.remote_model.text()) == (path, "qwen")
