"""Browse models: search the Hugging Face hub for GGUF repositories, see a repository's quant
files with size and whether each fits (its header read by range, engine/tools/fit.py's estimate),
and download one with a progress bar (bytes, rate, time left) and Cancel; Download again
resumes. Opened from the model picker, which then selects the downloaded file.

Nothing reaches the network until the user ticks the consent box and searches. engine/tools/hub.py
does the work on a worker thread ("phasewise-hub", one job at a time); its results come back
to the GUI thread through queued signals, so the window never waits on the network.
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

from engine.threads import start_worker
from engine.tools.fit import size
from engine.tools.hub import Hub, HubError, HubRepo, Progress, RemoteFile, iter_fits

CONSENT_KEY = "hub/allowed"  # QSettings: the user agreed to reach the hub


class ModelBrowserDialog(QDialog):
    """Search, a repository's quants with size and fit, download with progress and Cancel."""

    sig_downloaded = Signal(str)  # the verified file's path
    _sig_result = Signal(int, str, object)  # (job id, job, result) from the worker thread
    _sig_failed = Signal(int, str, str)  # (job id, job, one line)
    _sig_progress = Signal(object)  # Progress

    def __init__(self, parent: QWidget | None = None, *, settings: QSettings | None = None,
                 context: int = 0, folder: Path | None = None,
                 hub_factory: Callable[[], Hub] = Hub) -> None:
        super().__init__(parent)
        self.setWindowTitle("Browse models (Hugging Face hub)")
        self.setMinimumSize(640, 480)
        self.settings = settings
        self.folder = folder  # None: the models folder
        self.hub_factory = hub_factory
        self._hub: Hub | None = None
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
        self.query.setPlaceholderText("search GGUF models, e.g. qwen 7b instruct")
        self.search = QPushButton("Search")
        self.repos = QListWidget()
        self.context = QSpinBox()
        self.context.setRange(0, 1 << 20)
        self.context.setSingleStep(1024)
        self.context.setSpecialValueText("the model's own")
        self.context.setSuffix(" tokens")
        self.context.setValue(context)
        self.context.setKeyboardTracking(False)
        self.table = QTableWidget(0, 4)
        self.table.setHorizontalHeaderLabels(["Quant", "File", "Size", "Fits?"])
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(3, QHeaderView.ResizeMode.Stretch)
        self.table.verticalHeader().setVisible(False)
        self.download = QPushButton("Download")
        self.cancel = QPushButton("Cancel download")
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.status = QLabel("Nothing is sent to the hub until you search.")
        self.status.setObjectName("valueLabel")
        self.status.setWordWrap(True)
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
        layout.addLayout(buttons)
        layout.addWidget(self.status)

    # ----- state ---------------------------------------------------------------------------
    def busy(self) -> bool:
        return self._thread is not None

    def selected_file(self) -> RemoteFile | None:
        rows = self.table.selectionModel().selectedRows()
        return self.files[rows[0].row()] if rows else None

    def _update_buttons(self) -> None:
        allowed, idle = self.consent.isChecked(), not self.busy()
        self.search.setEnabled(allowed and idle)
        self.repos.setEnabled(idle)
        self.context.setEnabled(idle)
        self.download.setEnabled(allowed and idle and self.selected_file() is not None)
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
        self._start("search", lambda _cancel: self.hub().search(text, limit=20))

    def _current_repo(self) -> str | None:
        item = self.repos.currentItem()
        return item.data(Qt.ItemDataRole.UserRole).id if item is not None else None

    def start_files(self) -> None:
        item = self.repos.currentItem()
        if item is None or self.busy():
            return
        repo: HubRepo = item.data(Qt.ItemDataRole.UserRole)
        context = self.context.value() or None
        self.status.setText(f"Reading {repo.id}'s files and one header…")

        listed = self._listings.get(repo.id)

        def work(_cancel: threading.Event) -> tuple[str, list[tuple[RemoteFile, Any, str]]]:
            hub = self.hub()
            files = listed if listed is not None else sorted(hub.files(repo.id),
                                                             key=lambda f: f.size)
            return repo.id, list(iter_fits(hub, files, context))

        self._start("files", work)

    def start_download(self) -> None:
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
        for repo in repos:
            gated = ", gated: accept its license on the hub first" if repo.gated else ""
            item = QListWidgetItem(f"{repo.id}  ({repo.downloads:,} downloads{gated})")
            item.setData(Qt.ItemDataRole.UserRole, repo)
            self.repos.addItem(item)
        self.status.setText(f"{len(repos)} repositories; choose one to see its files"
                            if repos else "No GGUF repositories match.")

    def _show_files(self, repo: str, rows: list[tuple[RemoteFile, Any, str]]) -> None:
        self.files = self._listings[repo] = [f for f, _est, _why in rows]
        self.table.setRowCount(len(rows))
        for row, (f, est, why) in enumerate(rows):
            if est is not None:
                fit = (f"{'Fits' if est.fits else 'Does not fit'}: needs ~"
                       f"{size(est.needed_bytes)} at {est.context:,} tokens, "
                       f"{size(est.free_bytes)} free")
                if est.fitting_context:
                    fit += f"; fits at {est.fitting_context:,} tokens"
            else:
                fit = why
            for col, text in enumerate([f.quant or "–", f.local_name, size(f.size), fit]):
                self.table.setItem(row, col, QTableWidgetItem(text))
        for col in range(3):  # the fit column takes the rest
            self.table.resizeColumnToContents(col)
        self.status.setText(f"{repo}: {len(rows)} GGUF files" if rows
                            else f"{repo} has no GGUF model files")

    def done(self, result: int) -> None:
        """Closing cancels a download (its partial is kept) and waits for the worker."""
        self._cancel.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._update_buttons()
        super().done(result)
