"""Browse models: search the Hugging Face hub for GGUF repositories, see a repository's quant
files with size, whether each fits (its header read by range, engine/tools/fit.py's estimate) and
how fast it would run here (engine/tools/speed.py: decode tok/s and a 4,000-token prompt's time on
the engine the file would run on), and download one with a progress bar (bytes, rate, time
left) and Cancel; Download again resumes. Opened from the model picker, which then selects the
downloaded file.

Nothing reaches the network until the user ticks the consent box and searches. engine/tools/hub.py
does the work on a worker thread ("phasewise-hub", one job at a time); its results come back
to the GUI thread through queued signals, so the window never waits on the network. The speed
prediction needs one measurement of this computer (seconds, at most once: cached); when there
is none yet, it runs on its own thread ("phasewise-speed") from the moment the dialog opens,
and the note under the table says what it measures, then what it measured.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import QSettings, Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.errors import PhasewiseError
from engine.runtime_choice import TORCH, gguf_engine
from engine.threads import start_worker
from engine.tools.fit import size
from engine.tools.hub import (
    FileFit,
    FolderFit,
    Hub,
    HubError,
    HubRepo,
    Progress,
    RemoteFile,
    RemoteFolder,
    iter_fits,
)
from engine.tools.speed import EngineSpeed, SpeedProfiles, predict, speed_device

CONSENT_KEY = "hub/allowed"  # QSettings: the user agreed to reach the hub


class ModelBrowserDialog(QDialog):
    """Search, a repository's quants with size and fit, download with progress and Cancel."""

    sig_downloaded = Signal(str)  # the verified file's path
    sig_hub_id = Signal(str)  # a Hugging Face folder chosen: the torch engine loads it by id
    _sig_result = Signal(int, str, object)  # (job id, job, result) from the worker thread
    _sig_failed = Signal(int, str, str)  # (job id, job, one line)
    _sig_progress = Signal(object)  # Progress
    _sig_speed = Signal(str, object)  # (engine, EngineSpeed or a one-line failure)

    def __init__(self, parent: QWidget | None = None, *, settings: QSettings | None = None,
                 context: int = 0, folder: Path | None = None,
                 hub_factory: Callable[[], Hub] = Hub, device: str = "auto",
                 profiles: SpeedProfiles | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Browse models (Hugging Face hub)")
        self.setMinimumSize(760, 520)
        self.settings = settings
        self.folder = folder  # None: the models folder
        self.hub_factory = hub_factory
        self._hub: Hub | None = None
        # How fast here: the engine a GGUF would run on (a folder runs on torch), and this
        # computer's measurement of each (cached, or measured on its own thread, one at a time).
        self.engine = gguf_engine(device)
        self.device = device
        self.profiles = profiles or SpeedProfiles()
        self.speeds: dict[str, EngineSpeed] = {}
        self._speed_failed: dict[str, str] = {}
        self._cached(self.engine)
        self._measuring: threading.Thread | None = None
        self._measuring_engine = ""
        self._remeasured: set[str] = set()  # engines measured again (a busy measurement)
        self._stop_measuring = threading.Event()
        self._rows: list[FileFit | FolderFit] = []
        self._folders: dict[str, RemoteFolder] = {}  # repo -> its listing (no re-listing)
        # The job under way: its thread, until its result was handled here (so `busy` holds
        # until then, and a new job never starts while an old result is still queued).
        self._thread: threading.Thread | None = None
        self._job_id = 0
        self._cancel = threading.Event()  # the running job's: Cancel and closing set it
        self._job = ""  # "search", "files" or "download"
        self.files: list[RemoteFile] = []
        self._listings: dict[str, list[RemoteFile]] = {}  # repo -> files: a new context
        # re-estimates from these and the hub's cached headers, without the network
        self.consent = QCheckBox("Allow connecting to the Hugging Face hub (huggingface.co) to "
                                 "search and download")
        self.consent.setChecked(bool(settings is not None and
                                     settings.value(CONSENT_KEY, False, type=bool)))
        self.query = QLineEdit()
        self.query.setPlaceholderText("search GGUF models and Hugging Face folders, e.g. qwen "
                                      "7b instruct")
        self.search = QPushButton("Search")
        self.repos = QListWidget()
        self.context = QSpinBox()
        self.context.setRange(0, 1 << 20)
        self.context.setSingleStep(1024)
        self.context.setSpecialValueText("the model's own")
        self.context.setSuffix(" tokens")
        self.context.setValue(context)
        self.context.setKeyboardTracking(False)
        self.table = QTableWidget(0, 5)
        self.table.setHorizontalHeaderLabels(["Quant", "File", "Size", "Fits?",
                                              f"Speed here ({self.engine})"])
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(3, QHeaderView.ResizeMode.Stretch)
        self.table.horizontalHeader().setSectionResizeMode(4, QHeaderView.ResizeMode.Stretch)
        self.table.verticalHeader().setVisible(False)
        self.download = QPushButton("Download")
        self.cancel = QPushButton("Cancel download")
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.status = QLabel("Nothing is sent to the hub until you search.")
        self.status.setObjectName("valueLabel")
        self.status.setWordWrap(True)
        self.speed_note = QLabel()  # what the speed prediction comes from
        self.speed_note.setObjectName("valueLabel")
        self.speed_note.setWordWrap(True)
        self.measure_again = QPushButton("Measure again")
        self.measure_again.setToolTip("Measure this computer again for the speed prediction "
                                      "(after a measurement taken while it was busy)")
        self.measure_again.clicked.connect(
            lambda: self.start_measuring(self._rows_engine(), again=True))
        self._show_speed_note()
        self._layout()
        self.search.clicked.connect(self.start_search)
        self.query.returnPressed.connect(self.start_search)
        self.repos.currentItemChanged.connect(lambda item, _old: self.start_files())
        self.context.valueChanged.connect(lambda _v: self.start_files())
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.download.clicked.connect(self.start_download)
        self.cancel.clicked.connect(lambda: self._cancel.set())
        self.consent.toggled.connect(self._consent_changed)
        self._sig_result.connect(self._on_result)
        self._sig_failed.connect(self._on_failed)
        self._sig_progress.connect(self._on_progress)
        self._sig_speed.connect(self._on_speed)
        self.progress.setVisible(False)
        self._update_buttons()

    def _layout(self) -> None:
        search_row = QHBoxLayout()
        search_row.addWidget(self.query, 1)
        search_row.addWidget(self.search)
        context_row = QHBoxLayout()
        context_row.addWidget(QLabel("Fit at a context of"))
        context_row.addWidget(self.context)
        context_row.addStretch(1)
        buttons = QHBoxLayout()
        buttons.addWidget(self.progress, 1)
        buttons.addWidget(self.download)
        buttons.addWidget(self.cancel)
        layout = QVBoxLayout(self)
        layout.addWidget(self.consent)
        layout.addLayout(search_row)
        layout.addWidget(self.repos, 1)
        layout.addLayout(context_row)
        layout.addWidget(self.table, 2)
        speed_row = QHBoxLayout()
        speed_row.addWidget(self.speed_note, 1)
        speed_row.addWidget(self.measure_again, 0, Qt.AlignmentFlag.AlignTop)
        layout.addLayout(speed_row)
        layout.addLayout(buttons)
        layout.addWidget(self.status)

    # ----- state ---------------------------------------------------------------------------
    def busy(self) -> bool:
        return self._thread is not None

    @property
    def speed(self) -> EngineSpeed | None:
        """This computer's measurement of the engine a GGUF runs on (None: not yet)."""
        return self.speeds.get(self.engine)

    def _selected_row(self) -> FileFit | FolderFit | None:
        rows = self.table.selectionModel().selectedRows()
        return self._rows[rows[0].row()] if rows and rows[0].row() < len(self._rows) else None

    def selected_file(self) -> RemoteFile | None:
        row = self._selected_row()
        return row.file if isinstance(row, FileFit) else None

    def _update_buttons(self) -> None:
        allowed, idle = self.consent.isChecked(), not self.busy()
        self.search.setEnabled(allowed and idle)
        self.repos.setEnabled(idle)
        self.context.setEnabled(idle)
        folder = isinstance(self._selected_row(), FolderFit)
        self.download.setText("Choose (downloads when loaded)" if folder else "Download")
        self.download.setEnabled(allowed and idle and (folder or self.selected_file() is not None))
        self.cancel.setEnabled(not idle and self._job == "download")

    def _consent_changed(self, allowed: bool) -> None:
        if self.settings is not None:
            self.settings.setValue(CONSENT_KEY, allowed)
        self._update_buttons()

    def hub(self) -> Hub:
        if self._hub is None:
            self._hub = self.hub_factory()
        return self._hub

    # ----- jobs on the worker thread ---------------------------------------------------------
    def _start(self, job: str, work: Callable[[threading.Event], Any]) -> None:
        """Run `work(cancel)` on the worker thread; its result or its one-line failure comes
        back to the GUI thread as a signal."""
        if self.busy() or not self.consent.isChecked():
            return
        self._job = job
        self._job_id += 1
        job_id = self._job_id
        cancel = self._cancel = threading.Event()

        def run() -> None:
            try:
                result = work(cancel)
            except HubError as exc:
                self._emit(self._sig_failed, job_id, job, str(exc))
            except Exception as exc:  # a bug: still one line, and the dialog stays usable
                self._emit(self._sig_failed, job_id, job, f"{type(exc).__name__}: {exc}")
            else:
                self._emit(self._sig_result, job_id, job, result)

        self._thread = start_worker(run, "hub")
        self._update_buttons()

    @staticmethod
    def _emit(signal: Any, *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the dialog was deleted meanwhile
            signal.emit(*args)

    def start_search(self) -> None:
        text = self.query.text().strip()
        if not text:
            return
        self.status.setText(f"Searching the hub for {text!r}…")
        self._start("search", lambda _cancel: [*self.hub().search(text, limit=20),
                                               *self.hub().search_folders(text, limit=10)])

    def _current_repo(self) -> str | None:
        item = self.repos.currentItem()
        return item.data(Qt.ItemDataRole.UserRole).id if item is not None else None

    def start_files(self) -> None:
        item = self.repos.currentItem()
        if item is None or self.busy():
            return
        repo: HubRepo = item.data(Qt.ItemDataRole.UserRole)
        context = self.context.value() or None
        if repo.kind == "folder":
            self._start_folder(repo, context)
            return
        self.status.setText(f"Reading {repo.id}'s files and one header…")

        listed = self._listings.get(repo.id)

        def work(_cancel: threading.Event) -> tuple[str, list[FileFit]]:
            hub = self.hub()
            files = listed if listed is not None else sorted(hub.files(repo.id),
                                                             key=lambda f: f.size)
            return repo.id, list(iter_fits(hub, files, context))

        self._start("files", work)

    def _start_folder(self, repo: HubRepo, context: int | None) -> None:
        self.status.setText(f"Reading {repo.id}'s config and its weights' headers…")
        listed = self._folders.get(repo.id)
        device = self.device

        def work(_cancel: threading.Event) -> tuple[str, list[FolderFit]]:
            hub = self.hub()
            folder = listed if listed is not None else hub.folder(repo.id)
            return repo.id, [hub.folder_fit(folder, context, device)]

        self._start("files", work)

    def start_download(self) -> None:
        row = self._selected_row()
        if isinstance(row, FolderFit):  # the torch engine downloads a folder as it loads it
            self.status.setText(f"Chosen: {row.folder.repo}. It is downloaded when loaded.")
            self.sig_hub_id.emit(row.folder.repo)
            self.accept()
            return
        file = self.selected_file()
        if file is None:
            return
        self.progress.setValue(0)
        self.progress.setVisible(True)
        self.status.setText(f"Downloading {file.local_name}…")

        def work(cancel: threading.Event) -> str:
            return str(self.hub().download(file, self.folder, cancel=cancel,
                                           progress=lambda p: self._emit(self._sig_progress, p)))

        self._start("download", work)

    # ----- how fast here: one measurement of this computer per engine ----------------------
    def showEvent(self, event: Any) -> None:
        """Opening the dialog starts the measurement for GGUF files when there is none yet:
        it is local (no network) and usually done before the first search answers."""
        super().showEvent(event)
        self._measure_what_is_missing()

    def measuring(self) -> bool:
        return self._measuring is not None

    def _cached(self, engine: str) -> EngineSpeed | None:
        if engine not in self.speeds:
            known = self.profiles.cached(engine, speed_device(engine, self.device))
            if known is not None:
                self.speeds[engine] = known
        return self.speeds.get(engine)

    def _row_engine(self, row: FileFit | FolderFit) -> str:
        return TORCH if isinstance(row, FolderFit) else self.engine

    def _rows_engine(self) -> str:
        """The engine of the files shown (a GGUF repository's, or torch for a folder)."""
        return self._row_engine(self._rows[0]) if self._rows else self.engine

    def _measure_what_is_missing(self) -> None:
        """Measure the engine of the rows shown (or the GGUF one) if it has no measurement,
        no failure and none is running."""
        engine = self._rows_engine()
        if self._measuring is not None or engine in self._speed_failed:
            return
        known = self._cached(engine)
        if known is None:
            self.start_measuring(engine)
        elif known.worth_measuring_again() and engine not in self._remeasured:
            self._remeasured.add(engine)  # taken busy, idle now: once more, shown meanwhile
            self.start_measuring(engine, again=True)

    def start_measuring(self, engine: str | None = None, again: bool = False) -> None:
        if self._measuring is not None:
            return
        engine = engine or self.engine
        stop = self._stop_measuring = threading.Event()
        device = speed_device(engine, self.device)

        def run() -> None:
            try:
                result: object = self.profiles.get(engine, device, stop, again=again)
            except PhasewiseError as exc:
                result = str(exc)
            except Exception as exc:  # a bug: still one line, and the dialog stays usable
                result = f"{type(exc).__name__}: {exc}"
            if not stop.is_set():
                self._emit(self._sig_speed, engine, result)

        self._speed_failed.pop(engine, None)
        self._measuring_engine = engine
        self._measuring = start_worker(run, "speed")
        self._show_speed_note()
        self._render_rows()

    def _on_speed(self, engine: str, result: EngineSpeed | str) -> None:
        if self._measuring is not None:
            self._measuring.join()  # it has emitted its last signal: it ends at once
            self._measuring = None
        self._measuring_engine = ""
        if isinstance(result, EngineSpeed):
            self.speeds[engine] = result
        else:
            self._speed_failed[engine] = result
        self._show_speed_note()
        self._render_rows()
        self._measure_what_is_missing()  # the rows shown meanwhile may need another engine

    def _show_speed_note(self) -> None:
        engine = self._rows_engine()
        if self._measuring is not None:
            text = (f"Measuring this computer once for the speed column: its memory "
                    f"bandwidth, then {self._measuring_engine} on the bundled model (a short "
                    "reply and four prompts, up to a minute; cached after)…")
        elif engine in self._speed_failed:
            text = f"No speed prediction on {engine}: {self._speed_failed[engine]}"
        elif engine in self.speeds:
            text = self.speeds[engine].describe()
        else:
            text = ""
        self.speed_note.setText(text)
        self.measure_again.setVisible(self._measuring is None and engine in self.speeds)

    def stop_measuring(self) -> None:
        """Stop the measurement (its child process is killed; nothing is cached) and join."""
        self._stop_measuring.set()
        if self._measuring is not None:
            self._measuring.join()
            self._measuring = None
            self._measuring_engine = ""

    # ----- results, in the GUI thread ---------------------------------------------------------
    def _finish(self, job_id: int) -> bool:
        """The job's thread joined (it has emitted its last signal: it ends at once); False
        for a result of a job no longer current (one that ran when the dialog closed)."""
        if job_id != self._job_id or self._thread is None:
            return False
        self._thread.join()
        self._thread = None
        self._update_buttons()
        return True

    def _on_result(self, job_id: int, job: str, result: Any) -> None:
        if not self._finish(job_id) and job != "download":  # a finished download still counts
            return
        if job == "search":
            self._show_repos(result)
        elif job == "files":
            self._show_files(*result)
            if self._current_repo() != result[0]:  # chosen meanwhile (the list was busy)
                self.start_files()
        elif job == "download":
            self.progress.setValue(1000)
            self.status.setText(f"Downloaded and verified: {result}")
            self.sig_downloaded.emit(result)

    def _on_failed(self, job_id: int, job: str, message: str) -> None:
        if not self._finish(job_id):
            return
        self.status.setText(message)
        if job == "download" and "kept" in message:
            self.status.setText(f"{message}. Download again to resume.")

    def _on_progress(self, p: Progress) -> None:
        self.progress.setValue(int(1000 * p.done / p.total) if p.total else 0)
        self.progress.setFormat(p.line())

    def _show_repos(self, repos: list[HubRepo]) -> None:
        self.repos.clear()
        self.table.setRowCount(0)
        self.files = []
        self._rows = []
        for repo in repos:
            gated = ", gated: accept its license on the hub first" if repo.gated else ""
            kind = "Hugging Face folder for torch, " if repo.kind == "folder" else ""
            item = QListWidgetItem(f"{repo.id}  ({kind}{repo.downloads:,} downloads{gated})")
            item.setData(Qt.ItemDataRole.UserRole, repo)
            self.repos.addItem(item)
        self.status.setText(f"{len(repos)} repositories; choose one to see its files"
                            if repos else "No GGUF repositories or Hugging Face folders match.")

    def _show_files(self, repo: str, rows: list[FileFit] | list[FolderFit]) -> None:
        self._rows = list(rows)
        self.files = [row.file for row in rows if isinstance(row, FileFit)]
        if rows and isinstance(rows[0], FolderFit):
            self._folders[repo] = rows[0].folder
        else:
            self._listings[repo] = self.files
        self._cached(self._rows_engine())  # a measurement on disk: before the rows show
        self._render_rows()
        self._show_speed_note()
        self._measure_what_is_missing()
        kind = "Hugging Face folder" if self._rows_engine() == TORCH and rows else "GGUF files"
        self.status.setText(f"{repo}: {len(rows)} {kind}" if rows
                            else f"{repo} has no GGUF model files")

    def _render_rows(self) -> None:
        """The listed files with fit and speed (again when a measurement arrives)."""
        self.table.setHorizontalHeaderItem(
            4, QTableWidgetItem(f"Speed here ({self._rows_engine()})"))
        self.table.setRowCount(len(self._rows))
        for i, row in enumerate(self._rows):
            est = row.estimate
            if est is not None:
                fit = (f"{'Fits' if est.fits else 'Does not fit'}: needs ~"
                       f"{size(est.needed_bytes)} at {est.context:,} tokens, "
                       f"{size(est.free_bytes)} free")
                if est.fitting_context:
                    fit += f"; fits at {est.fitting_context:,} tokens"
            else:
                fit = row.why
            if isinstance(row, FolderFit):
                cells = [row.dtype or "–", row.folder.label, size(row.folder.size)]
            else:
                cells = [row.file.quant or "–", row.file.label, size(row.file.size)]
            for col, text in enumerate([*cells, fit, self._speed_text(row)]):
                self.table.setItem(i, col, QTableWidgetItem(text))
        for col in range(3):  # the fit and speed columns take the rest
            self.table.resizeColumnToContents(col)

    def _speed_text(self, row: FileFit | FolderFit) -> str:
        engine = self._row_engine(row)
        speed = self.speeds.get(engine)
        if row.cost is None:
            return "–"
        if speed is None:
            if self._measuring is not None and self._measuring_engine == engine:
                return "measuring…"
            return "not measured" if engine not in self._speed_failed else "–"
        return predict(row.cost, speed).text()

    def done(self, result: int) -> None:
        """Closing cancels a download (its partial is kept) and a measurement, and waits for
        the workers."""
        self._cancel.set()
        self.stop_measuring()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._update_buttons()
        super().done(result)
