"""Models from the Hugging Face hub: search GGUF repositories, list a repository's quant files
(a model split over several files as one), estimate whether one fits and what a token costs it
(engine/tools/speed.py) from its header alone (an HTTP range read), and download one into
the user's models folder with progress, cancel, resume and the hub's checksum. Hugging Face
folders the torch engine runs are searched too, estimated from config.json and their
safetensors headers.

The hub's API goes through huggingface_hub (HfApi, get_hf_file_metadata); the file bytes
through its HTTP session, with the hub's auth headers. Nothing here touches the network until
a caller asks (the `phasewise models` commands, or the browser after the user agreed); with
HF_HUB_OFFLINE set every call refuses in one line.

Every failure is a HubError: one line, and nothing lost. A download writes to a hidden
".NAME.part" beside its target, with ".NAME.part.json" naming the revision and checksum it
belongs to; a cancel, a lost connection, a server error or a full disk keep it, and the next
pull of the same file resumes from its end (an HTTP Range request). A file whose checksum does
not match, or that is not a GGUF, is dropped. Only a verified file is moved into place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

from engine.errors import PhasewiseError, one_line
from engine.gguf_header import (
    GGUFHeader,
    TruncatedHeader,
    merge_split,
    parse_gguf,
    split_name,
    split_parts,
)
from engine.model_files import models_dir
from engine.tools.fit import Estimate, gguf_estimate, size
from engine.tools.speed import ModelCost

HEADER_FIRST_READ = 1 << 20  # 1 MiB: a small vocabulary's header; SmolLM2's (1.8 MB) in 2 reads
PART_READ = 64 << 10  # a split model's later part: its tensors' infos, no vocabulary
HEADER_MAX = 64 << 20  # a header larger than this is not a model we can estimate
PROGRESS_EVERY_S = 0.1
CHUNK = 1 << 20  # read at a time to hash a file
READ_TIMEOUT_S = 30.0  # a stalled connection is given up after this (the partial is kept)
DISK_MARGIN = 64 << 20  # left free after a download: a full disk breaks more than this app
_QUANT = re.compile(r"(?:^|[-_.])((?:I?Q\d[A-Z0-9_]*?)|F16|BF16|F32)(?=\.gguf$|[-.])",
                    re.IGNORECASE)


class HubError(PhasewiseError):
    """One line for the user: what failed, what was kept, what to do."""


class DownloadCancelled(HubError):
    """The caller cancelled a download; its partial file is kept for a resume."""


@dataclass(frozen=True)
class HubRepo:
    id: str
    downloads: int
    likes: int
    gated: bool
    kind: str = "gguf"  # "gguf": GGUF files; "folder": a Hugging Face folder (safetensors)


@dataclass(frozen=True)
class RemoteFolder:
    """A Hugging Face folder on the hub (config.json and safetensors weights): what the torch
    engine loads by its hub id."""

    repo: str
    revision: str
    config: RemoteFile | None
    weights: tuple[RemoteFile, ...]  # the .safetensors files

    @property
    def size(self) -> int:
        return sum(f.size for f in self.weights)

    @property
    def label(self) -> str:
        n = len(self.weights)
        return f"the folder ({n} safetensors file{'s' if n != 1 else ''})"


@dataclass(frozen=True)
class FolderFit:
    """A hub folder as its config and safetensors headers tell it, on the torch engine."""

    folder: RemoteFolder
    dtype: str  # the weights' stored dtype ("BF16"), the most common one
    estimate: Estimate | None
    cost: ModelCost | None
    why: str = ""


@dataclass(frozen=True)
class RemoteFile:
    """A .gguf file in a hub repository, as its listing describes it; or a model split over
    several files ('-00001-of-00003.gguf'), all of them listed: then `parts` are the files,
    and name, size and sha256 are the first part's name, their total and None."""

    repo: str
    name: str  # path inside the repository
    size: int
    sha256: str | None  # the LFS object's sha256 (None: not stored with LFS)
    revision: str  # the commit it was listed at: a download resumes only on the same one
    parts: tuple[RemoteFile, ...] = ()

    @property
    def incomplete_split(self) -> bool:
        """One part of a split model whose other parts are not all listed."""
        return is_split(self.name) and not self.parts

    @property
    def label(self) -> str:
        """Its file name, and for a split model how many files it is."""
        return (f"{self.local_name} ({len(self.parts)} files)" if self.parts
                else self.local_name)

    @property
    def quant(self) -> str:
        """The quantization its name says ('Q4_K_M'), '' when it does not say."""
        match = _QUANT.search(Path(self.name).name)
        return match.group(1).upper() if match else ""

    @property
    def local_name(self) -> str:
        return Path(self.name).name


@dataclass(frozen=True)
class Progress:
    done: int  # bytes on disk
    total: int
    rate: float  # bytes per second over the last few seconds (0 until measured)

    @property
    def eta_s(self) -> float | None:
        return (self.total - self.done) / self.rate if self.rate > 0 else None

    def line(self) -> str:
        """'312 MB of 1.2 GB (26%), 25 MB/s, 36 s left'."""
        share = self.done / self.total if self.total else 1.0
        text = f"{size(self.done)} of {size(self.total)} ({share:.0%})"
        if self.rate > 0:
            text += f", {_rate(self.rate)}"
        eta = self.eta_s
        if eta is not None:
            text += f", {_duration(eta)} left"
        return text


def _rate(bytes_per_s: float) -> str:
    """'25 MB/s'; a slow link in kB/s (not '0 MB/s')."""
    if bytes_per_s < 1e6:
        return f"{bytes_per_s / 1e3:,.0f} kB/s"
    return f"{size(int(bytes_per_s))}/s"


def _duration(seconds: float) -> str:
    if seconds < 1:
        return "under 1 s"  # not "0 s": the file is not there yet
    s = int(seconds + 0.5)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


@dataclass(frozen=True)
class LocalModel:
    """A GGUF in the models folder, or a partial download of one. A model split over
    several files, all of them there, is one: `path` is its first part (the one to load),
    `parts` all of them and `size` their total."""

    path: Path
    size: int
    partial: bool
    total: int = 0  # a partial's full size, from its record (0: unknown)
    parts: tuple[Path, ...] = ()

    @property
    def name(self) -> str:
        return self.path.name.removeprefix(".").removesuffix(".part") if self.partial \
            else self.path.name

    @property
    def label(self) -> str:
        """Its name, and for a split model how many files it is."""
        return f"{self.name} ({len(self.parts)} files)" if self.parts else self.name


def _product(dims: list[int]) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def is_split(name: str) -> bool:
    """A shard of a model split over several files ('-00001-of-00003.gguf')."""
    return split_name(Path(name).name) is not None


def group_splits(files: list[RemoteFile]) -> list[RemoteFile]:
    """The files, with each split model whose parts are all listed made one RemoteFile
    (its parts in order); the parts of an incomplete one stay as they are."""
    sets: dict[tuple[str, int], dict[int, RemoteFile]] = {}
    single = []
    for f in files:
        split = split_name(Path(f.name).name)
        if split is None:
            single.append(f)
            continue
        stem, no, count = split
        sets.setdefault((str(Path(f.name).parent / stem), count), {})[no] = f
    for (_stem, count), found in sets.items():
        if len(found) == count:
            parts = tuple(found[i] for i in range(1, count + 1))
            single.append(RemoteFile(parts[0].repo, parts[0].name, sum(p.size for p in parts),
                                     None, parts[0].revision, parts))
        else:
            single.extend(found.values())
    return single


def is_model_file(name: str) -> bool:
    """A .gguf holding a model (not a vision projector, 'mmproj-*.gguf')."""
    base = Path(name).name.lower()
    return base.endswith(".gguf") and "mmproj" not in base


# ----- the hub ---------------------------------------------------------------------------
class Hub:
    """The Hugging Face hub at `endpoint` (None: huggingface_hub's own, HF_ENDPOINT or
    huggingface.co); `token` None uses the login (`hf auth login`) or HF_TOKEN."""

    def __init__(self, endpoint: str | None = None, token: str | None = None) -> None:
        from huggingface_hub import HfApi, constants

        self.endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
        self.token = token
        self.api = HfApi(endpoint=self.endpoint, token=token)
        self._headers: dict[RemoteFile, GGUFHeader] = {}  # a revision's file never changes
        # a folder's config.json and its tensors' (shape, dtype), read once per revision
        self._folder_facts: dict[RemoteFolder, tuple[Any, dict[str, tuple[list[int], str]]]] = {}
        self.progress_every_s = PROGRESS_EVERY_S  # 0: a report per read (tests)
        self._lock = threading.Lock()

    def search(self, text: str, limit: int = 10) -> list[HubRepo]:
        """GGUF repositories whose id matches `text`, most downloaded first."""
        with self._errors(f"searching for {text!r}", ""):
            self._reach()
            found = list(self.api.list_models(search=text, filter="gguf", sort="downloads",
                                              limit=limit))
        return [HubRepo(m.id, int(m.downloads or 0), int(m.likes or 0), bool(m.gated))
                for m in found]

    def search_folders(self, text: str, limit: int = 10) -> list[HubRepo]:
        """Hugging Face folders (transformers, safetensors, text generation) whose id matches
        `text`, most downloaded first: what the torch engine loads by hub id."""
        with self._errors(f"searching for {text!r}", ""):
            self._reach()
            found = list(self.api.list_models(search=text,
                                              filter=["transformers", "safetensors"],
                                              pipeline_tag="text-generation",
                                              sort="downloads", limit=limit))
        return [HubRepo(m.id, int(m.downloads or 0), int(m.likes or 0), bool(m.gated),
                        "folder") for m in found]

    def folder(self, repo: str, revision: str | None = None) -> RemoteFolder:
        """The repository's config.json and safetensors files, with sizes."""
        with self._errors(repo, repo):
            info = self.api.model_info(repo, revision=revision, files_metadata=True)
        commit = str(info.sha or revision or "main")
        files = [RemoteFile(repo, s.rfilename, int(s.size or 0),
                            s.lfs.sha256 if s.lfs is not None else None, commit)
                 for s in info.siblings or []]
        config = next((f for f in files if f.name == "config.json"), None)
        return RemoteFolder(repo, commit, config,
                            tuple(f for f in files if f.name.endswith(".safetensors")
                                  and "/" not in f.name))

    def folder_fit(self, folder: RemoteFolder, context_length: int | None = None,
                   device: str = "auto") -> FolderFit:
        """Will it fit on the torch engine, and what a token costs it: from config.json and
        each safetensors file's header, read by range (no weights)."""
        from engine.runtimes.torch.loader import config_refusal
        from engine.tools.fit import config_shape, torch_sources_estimate

        if folder.config is None or not folder.weights:
            return FolderFit(folder, "", None, None,
                             "no config.json and safetensors weights: not a folder the torch "
                             "engine loads")
        with self._lock:
            known = self._folder_facts.get(folder)
        if known is None:
            with self._errors(folder.repo, folder.repo):
                raw = self._range(folder.config, 0, max(0, folder.config.size - 1))
            try:
                config = json.loads(raw)
            except ValueError:
                return FolderFit(folder, "", None, None,
                                 f"{folder.repo}: config.json is not JSON")
            refusal = (config_refusal(config, folder.repo) if isinstance(config, dict)
                       else "config.json is not an object")
            if refusal is not None:
                return FolderFit(folder, "", None, None, refusal)
            tensors: dict[str, tuple[list[int], str]] = {}
            try:
                for f in folder.weights:
                    tensors.update(self._safetensors_header(f))
            except HubError as exc:
                return FolderFit(folder, "", None, None, str(exc))
            with self._lock:
                self._folder_facts[folder] = known = (config, tensors)
        config, tensors = known
        counts: dict[str, int] = {}
        for dims, dtype in tensors.values():
            counts[dtype] = counts.get(dtype, 0) + _product(dims)
        elements = sum(counts.values())
        estimate = torch_sources_estimate(elements, config_shape(config), device=device,
                                          context_length=context_length)
        return FolderFit(folder, max(counts, key=lambda d: counts[d], default=""), estimate,
                         ModelCost.from_config(config, tensors))

    def _safetensors_header(self, file: RemoteFile) -> dict[str, tuple[list[int], str]]:
        """name -> (shape, dtype) of a remote .safetensors file's tensors: two range reads."""
        with self._errors(file.local_name, file.repo):
            first = self._range(file, 0, 7)
            length = struct.unpack("<Q", first)[0] if len(first) == 8 else 0
            if not 0 < length <= HEADER_MAX:
                raise HubError(f"{file.local_name} in {file.repo} is not a safetensors file")
            raw = self._range(file, 8, 8 + length - 1)
        try:
            header = json.loads(raw)
            return {k: (list(v["shape"]), str(v["dtype"])) for k, v in header.items()
                    if k != "__metadata__"}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise HubError(f"{file.local_name} in {file.repo} is not a safetensors file") \
                from None

    def _reach(self) -> None:
        """Fail at once when the hub cannot be reached: huggingface_hub's search retries a
        refused connection five times with backoff (23 s, a warning per try) before failing."""
        from huggingface_hub.utils import get_session

        get_session().head(f"{self.endpoint}/", timeout=READ_TIMEOUT_S)

    def files(self, repo: str, revision: str | None = None) -> list[RemoteFile]:
        """The repository's .gguf models with sizes and checksums, largest first (a split
        model is one, its files its `parts`)."""
        with self._errors(repo, repo):
            info = self.api.model_info(repo, revision=revision, files_metadata=True)
        commit = str(info.sha or revision or "main")
        found = [RemoteFile(repo, s.rfilename, int(s.size or 0),
                            s.lfs.sha256 if s.lfs is not None else None, commit)
                 for s in info.siblings or [] if is_model_file(s.rfilename)]
        return sorted(group_splits(found), key=lambda f: -f.size)

    def file(self, repo: str, name: str | None = None) -> RemoteFile:
        """One model file of `repo`: `name`, or the repository's only one."""
        files = self.files(repo)
        if name is not None:
            for f in files:
                if name in (f.name, f.local_name, *(p.local_name for p in f.parts)):
                    return f
            raise HubError(f"{repo} has no file {name}; `phasewise models search {repo}` "
                           "lists its files")
        whole = [f for f in files if not f.incomplete_split]
        if len(whole) == 1:
            return whole[0]
        if not whole:
            raise HubError(f"{repo} has no complete GGUF model (only parts of a split one)")
        quants = ", ".join(f.quant or f.local_name for f in sorted(whole, key=lambda f: f.size))
        raise HubError(f"{repo} has {len(whole)} GGUF files ({quants}): name one as "
                       f"{repo}:FILE")

    def url(self, file: RemoteFile) -> str:
        """The file's resolve URL on this hub. Not hf_hub_url(endpoint=...): that swaps in
        the endpoint only where its template starts with huggingface_hub's ENDPOINT setting,
        so with that setting changed after import the bytes were asked of huggingface.co."""
        return (f"{self.endpoint}/{file.repo}/resolve/{quote(file.revision, safe='')}/"
                f"{quote(file.name)}")

    # ----- the header, read by range ----------------------------------------------------
    def header(self, file: RemoteFile, first_read: int = HEADER_FIRST_READ) -> GGUFHeader:
        """The file's GGUF header from its first bytes only: one range request, and more
        while the header runs past what was read (a large vocabulary); read once per file
        and revision. A split model's is every part's, merged (gguf_header.merge_split)."""
        if file.incomplete_split:
            raise HubError(f"{file.local_name} is one part of a split model whose other parts "
                           "are not all listed")
        if file.parts:  # the parts after the first hold only their tensors' infos
            return merge_split([(self._file_header(p, first_read if i == 0 else PART_READ),
                                 p.size) for i, p in enumerate(file.parts)])
        return self._file_header(file, first_read)

    def _file_header(self, file: RemoteFile, first_read: int) -> GGUFHeader:
        with self._lock:
            known = self._headers.get(file)
        if known is not None:
            return known
        header = self._read_header(file, first_read)
        with self._lock:
            self._headers[file] = header
        return header

    def _read_header(self, file: RemoteFile, first_read: int) -> GGUFHeader:
        data = b""
        want = min(first_read, file.size) if file.size else first_read
        while True:
            with self._errors(file.local_name, file.repo):
                data += self._range(file, len(data), want - 1)
            try:
                return parse_gguf(data)
            except TruncatedHeader as exc:
                if len(data) < want or want >= HEADER_MAX:  # the file ended, or too large
                    raise HubError(f"{file.local_name}: cannot read its GGUF header") from None
                want = min(HEADER_MAX, max(exc.needed + 1, want * 2))
            except ValueError:
                raise HubError(f"{file.local_name} in {file.repo} is not a GGUF file") from None

    def estimate(self, file: RemoteFile, context_length: int | None = None,
                 header: GGUFHeader | None = None, free: int | None = -1) -> Estimate:
        """Will it fit (engine/tools/fit.py), from the remote header: `header` may be another
        quant's of the same repository (same shape; the data offset differs by bytes)."""
        return gguf_estimate(header or self.header(file), file.size, context_length, free)

    def _range(self, file: RemoteFile, start: int, end: int) -> bytes:
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        headers = {**build_hf_headers(token=self.token), "Range": f"bytes={start}-{end}"}
        response = get_session().get(self.url(file), headers=headers, follow_redirects=True,
                                     timeout=READ_TIMEOUT_S)
        hf_raise_for_status(response)
        body = response.content
        if response.status_code == 200:  # the server ignored the range: take the part asked
            body = body[start:end + 1]
        return body

    # ----- download -----------------------------------------------------------------------
    def download(self, file: RemoteFile, folder: Path | None = None, *,
                 progress: Callable[[Progress], None] | None = None,
                 cancel: threading.Event | None = None) -> Path:
        """The file in `folder` (the models folder), verified; resumes a partial download of
        the same revision. HubError (DownloadCancelled) with one line otherwise. A split
        model's parts are downloaded one after the other (those already there skipped), with
        one progress over them all; the first part's path is returned (llama.cpp loads the
        rest from beside it)."""
        if file.incomplete_split:
            raise HubError(f"{file.local_name} is one part of a split model whose other parts "
                           "are not all listed")
        folder = folder or models_dir()
        if file.parts:
            return self._download_parts(file, folder, progress, cancel)
        return self._download_file(file, folder, progress, cancel)

    def _download_file(self, file: RemoteFile, folder: Path,
                       progress: Callable[[Progress], None] | None,
                       cancel: threading.Event | None) -> Path:
        target = folder / file.local_name
        part, _record = partial_paths(target)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with _exclusive(part.with_name(part.name + ".lock"), file.local_name):
                return self._download(file, folder, target, progress, cancel)
        except HubError:
            raise
        except OSError as exc:  # the models folder: not writable, an I/O error
            raise HubError(f"{file.local_name}: cannot write to {folder}: "
                           f"{exc.strerror or exc}; {_kept(part, file.size)}") from None

    def _download_parts(self, file: RemoteFile, folder: Path,
                        progress: Callable[[Progress], None] | None,
                        cancel: threading.Event | None) -> Path:
        check_absent(file, folder)
        missing = [p for p in file.parts if not (folder / p.local_name).exists()]
        have = sum(partial_size(folder / p.local_name) for p in missing)
        folder.mkdir(parents=True, exist_ok=True)
        _check_disk(folder, sum(p.size for p in missing) - have, file)
        done = file.size - sum(p.size for p in missing)  # the parts already there
        for part in missing:
            def each(p: Progress, before: int = done) -> None:
                if progress is not None:
                    progress(Progress(before + p.done, file.size, p.rate))
            self._download_file(part, folder, each, cancel)
            done += part.size
        return folder / file.parts[0].local_name

    def _download(self, file: RemoteFile, folder: Path, target: Path,
                  progress: Callable[[Progress], None] | None,
                  cancel: threading.Event | None) -> Path:
        part, record = partial_paths(target)
        check_absent(file, folder)
        expected = self._expected(file)
        have = _resume_point(part, record, expected)
        _check_disk(folder, expected["size"] - have, file)
        record.write_text(json.dumps(expected), encoding="utf-8")
        try:
            self._fetch(file, (part, record), have, expected["size"], progress, cancel)
        except DownloadCancelled:
            raise
        except HubError as exc:
            raise HubError(f"{exc}; {_kept(part, expected['size'])}") from None
        _verify(part, record, expected, file)
        os.replace(part, target)
        record.unlink(missing_ok=True)
        return target

    def _expected(self, file: RemoteFile) -> dict[str, Any]:
        """What the finished file must be: size and checksum, from the listing and the
        file's own headers (X-Linked-Etag: the LFS sha256; a git blob's sha1 otherwise)."""
        from huggingface_hub import get_hf_file_metadata

        with self._errors(file.local_name, file.repo):
            meta = get_hf_file_metadata(self.url(file), token=self.token,
                                        endpoint=self.endpoint)
        etag = (meta.etag or "").strip('"').lower()
        sha256 = file.sha256 or (etag if re.fullmatch(r"[0-9a-f]{64}", etag) else None)
        sha1 = etag if sha256 is None and re.fullmatch(r"[0-9a-f]{40}", etag) else None
        if sha256 is None and sha1 is None:
            raise HubError(f"the hub gives no checksum for {file.local_name}: not downloaded")
        total = int(meta.size if meta.size is not None else file.size)
        return {"repo": file.repo, "file": file.name, "revision": file.revision,
                "size": total, "sha256": sha256, "git_sha1": sha1}

    def _fetch(self, file: RemoteFile, paths: tuple[Path, Path], have: int, total: int,
               progress: Callable[[Progress], None] | None,
               cancel: threading.Event | None) -> None:
        """Append the bytes from `have` on to the partial file (paths: it and its record)."""
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        part, record = paths
        if have >= total:
            return
        headers = {**build_hf_headers(token=self.token), "Range": f"bytes={have}-",
                   "Accept-Encoding": "identity"}
        meter = _Meter(have, total, self.progress_every_s)
        with self._errors(file.local_name, file.repo), \
                get_session().stream("GET", self.url(file), headers=headers,
                                     follow_redirects=True, timeout=READ_TIMEOUT_S) as response:
            if response.status_code >= 400:
                response.read()
                hf_raise_for_status(response)
            mode = "ab"
            if response.status_code == 200:  # the server ignored the range: from the start
                mode, have, meter = "wb", 0, _Meter(0, total, self.progress_every_s)
            elif not response.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
                raise HubError(f"{file.local_name}: the hub sent another part of the file "
                               f"than the one asked for (from byte {have:,})")
            with part.open(mode) as fh:
                for chunk in response.iter_bytes():  # as it arrives: a drop loses none
                    if cancel is not None and cancel.is_set():
                        raise DownloadCancelled(f"download of {file.local_name} cancelled; "
                                                f"{_kept(part, total, fh.tell())}")
                    if have == 0 and fh.tell() == 0 and chunk[:4] != b"GGUF"[:len(chunk)]:
                        fh.close()
                        _drop(part, record)
                        raise HubError(f"{file.local_name} in {file.repo} is not a GGUF file "
                                       "(dropped)")
                    write_chunk(fh, chunk)
                    meter.add(len(chunk))
                    if progress is not None and meter.due():
                        progress(meter.progress())

    def _errors(self, what: str, repo: str) -> contextlib.AbstractContextManager[None]:
        return _hub_errors(what, f"{self.endpoint}/{repo}")


@contextlib.contextmanager
def _hub_errors(what: str, page: str) -> Iterator[None]:
    """Turns what huggingface_hub and its HTTP client raise into one HubError line."""
    try:
        yield
    except HubError:
        raise
    except Exception as exc:
        line = hub_error_line(exc, what, page)
        if line is None:
            raise
        raise HubError(line) from exc


def hub_error_line(exc: BaseException, what: str, page: str) -> str | None:
    """One line for a hub failure (`page`: the repository's page); None for an exception that
    is not one (a bug: re-raised as it is)."""
    import httpx2
    from huggingface_hub import errors

    if isinstance(exc, errors.OfflineModeIsEnabled):
        return "offline: HF_HUB_OFFLINE is set, so the hub is not contacted (unset it to search "\
               "or download models)"
    if isinstance(exc, errors.GatedRepoError):
        return (f"{what}: the repository is gated: accept its license at {page}, then log in "
                "with `hf auth login` (or set HF_TOKEN)")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (f"{what}: repository not found on the hub (if it is private or gated, log in "
                "with `hf auth login` or set HF_TOKEN)")
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        return f"{what}: file not found on the hub"
    if isinstance(exc, errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "an error"
        return f"{what}: the hub answered {status}; try again later"
    if isinstance(exc, httpx2.TransportError):
        return f"{what}: connection to the hub failed ({one_line(exc)})"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return f"{what}: the disk is full"
    return None


# ----- the models folder -------------------------------------------------------------------
def check_absent(file: RemoteFile, folder: Path | None = None) -> None:
    """HubError when the models folder has this file already (a download would not start;
    a split model: all its parts)."""
    folder = folder or models_dir()
    if all((folder / p.local_name).exists() for p in file.parts or (file,)):
        raise HubError(f"{file.local_name} is already in the models folder ({folder}): "
                       "choose it, or remove it first to download it again")


def partial_size(target: Path) -> int:
    """Bytes of `target` already downloaded (its partial file), 0 when none."""
    try:
        return partial_paths(target)[0].stat().st_size
    except OSError:
        return 0


def partial_paths(target: Path) -> tuple[Path, Path]:
    """(".NAME.part", ".NAME.part.json") beside `target`."""
    part = target.with_name(f".{target.name}.part")
    return part, part.with_name(part.name + ".json")


def local_models(folder: Path | None = None) -> list[LocalModel]:
    """The GGUF files in the models folder and the partial downloads, by name (a split
    model with all its parts there: one, by its first part's name)."""
    folder = folder or models_dir()
    found: list[LocalModel] = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if not path.is_file():
            continue
        if path.name.startswith(".") and path.name.endswith(".gguf.part"):
            total = 0
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                total = int(json.loads(path.with_name(path.name + ".json").read_text(
                    encoding="utf-8"))["size"])
            found.append(LocalModel(path, path.stat().st_size, True, total))
        elif path.suffix.lower() == ".gguf" and not path.name.startswith("."):
            found.append(LocalModel(path, path.stat().st_size, False))
    return _group_local_splits(found)


def _group_local_splits(models: list[LocalModel]) -> list[LocalModel]:
    """Each split model whose parts are all there made one LocalModel, where its first part
    was; the parts of an incomplete one stay as they are."""
    complete: dict[Path, list[LocalModel]] = {}
    for m in models:
        parts = split_parts(m.path) if not m.partial else None
        if parts is not None and all(p.is_file() for p in parts):
            complete.setdefault(parts[0], []).append(m)
    out = []
    for m in models:
        shards = split_parts(m.path) if not m.partial else None
        if shards is None or shards[0] not in complete:
            out.append(m)
        elif m.path == shards[0]:
            group = complete[shards[0]]
            out.append(LocalModel(m.path, sum(g.size for g in group), False,
                                  parts=tuple(shards)))
    return out


def find_local(name: str, folder: Path | None = None) -> list[LocalModel]:
    """Models named `name` (with or without '.gguf'): the file, its partial download, or both."""
    wanted = {name, f"{name}.gguf"}
    return [m for m in local_models(folder) if m.name in wanted]


def remove_local(model: LocalModel) -> int:
    """Delete a model file (every part of a split one; or a partial download and its
    record); the bytes freed."""
    freed = model.size
    for part in model.parts[1:]:
        part.unlink(missing_ok=True)
    model.path.unlink()
    if model.partial:  # its record, and a lock file a crashed download left behind
        model.path.with_name(model.path.name + ".json").unlink(missing_ok=True)
        model.path.with_name(model.path.name + ".lock").unlink(missing_ok=True)
    return freed


# ----- download helpers -------------------------------------------------------------------
def write_chunk(fh: IO[bytes], chunk: bytes) -> None:
    """One write of a download (its own function: the tests inject a full disk here)."""
    fh.write(chunk)


class _Meter:
    """Bytes done and the rate over the last few seconds; due() says when to report, at most
    every `every_s` and at the end: a socket read can be a few KB, and a report per
    read flooded the window with ~10,000 progress signals per 40 MB (30 s to paint them)."""

    WINDOW_S = 5.0

    def __init__(self, done: int, total: int, every_s: float) -> None:
        self.done, self.total, self.every_s = done, total, every_s
        self.samples: deque[tuple[float, int]] = deque([(time.monotonic(), done)])
        self.reported = float("-inf")

    def add(self, n: int) -> None:
        self.done += n

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.reported < self.every_s and self.done < self.total:
            return False
        self.reported = now
        self.samples.append((now, self.done))
        while len(self.samples) > 2 and now - self.samples[1][0] > self.WINDOW_S:
            self.samples.popleft()
        return True

    def progress(self) -> Progress:
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        rate = (d1 - d0) / (t1 - t0) if t1 - t0 > 0.2 else 0.0
        return Progress(self.done, self.total, rate)


def _resume_point(part: Path, record: Path, expected: dict[str, Any]) -> int:
    """Bytes of `part` that belong to `expected` (0: none, or another revision's: dropped)."""
    if not part.exists():
        return 0
    try:
        same = json.loads(record.read_text(encoding="utf-8")) == expected
    except (OSError, ValueError):
        same = False
    have = part.stat().st_size
    if not same or have > expected["size"]:
        _drop(part)
        return 0
    return have


@contextlib.contextmanager
def _exclusive(lock: Path, name: str) -> Iterator[None]:
    """One download of a file at a time (another pull, another window): both would append to
    one partial. An advisory lock (flock), so a crashed download leaves none behind; the lock
    file goes when done. Windows has no flock: there the checksum still catches a mixed file."""
    if sys.platform == "win32":
        yield
        return
    import fcntl

    with lock.open("a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise HubError(f"{name} is being downloaded already (by another pull or window); "
                           "wait for that one, or stop it") from None
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)


def _check_disk(folder: Path, needed: int, file: RemoteFile) -> None:
    free = shutil.disk_usage(folder).free
    if needed + DISK_MARGIN > free:
        raise HubError(f"not enough disk space for {file.local_name}: it needs {size(needed)} "
                       f"more, {size(free)} is free in {folder}")


def _verify(part: Path, record: Path, expected: dict[str, Any], file: RemoteFile) -> None:
    """The finished partial is the file the hub lists, byte for byte; dropped otherwise."""
    have = part.stat().st_size
    if have != expected["size"]:
        _drop(part, record)
        raise HubError(f"{file.local_name}: {have:,} bytes arrived, the hub lists "
                       f"{expected['size']:,} (dropped; pull again)")
    if expected["sha256"]:
        digest = hashlib.sha256()
    else:
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(f"blob {have}\0".encode())  # git's blob id
    with part.open("rb") as fh:
        head = fh.read(4)
        digest.update(head)
        for block in iter(lambda: fh.read(CHUNK), b""):
            digest.update(block)
    if digest.hexdigest() != (expected["sha256"] or expected["git_sha1"]):
        _drop(part, record)
        raise HubError(f"{file.local_name}: checksum mismatch with the hub's (file dropped; "
                       "pull again)")
    if head != b"GGUF":
        _drop(part, record)
        raise HubError(f"{file.local_name} in {file.repo} is not a GGUF file (dropped)")


def _drop(*paths: Path) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _kept(part: Path, total: int, have: int | None = None) -> str:
    if have is None:
        try:
            have = part.stat().st_size
        except OSError:
            have = 0
    if not have:
        return "nothing kept"
    return (f"{size(have)} of {size(total)} kept in {part.parent}: the same pull resumes it "
            f"(`phasewise models rm {part.name[1:-5]}` removes it)")


@dataclass(frozen=True)
class FileFit:
    """A remote file as its header tells it: whether it fits (`estimate`) and what a token
    costs it (`cost`, for engine/tools/speed.py's prediction); `why` where neither can be said."""

    file: RemoteFile
    estimate: Estimate | None
    cost: ModelCost | None
    why: str = ""


def iter_fits(hub: Hub, files: list[RemoteFile], context_length: int | None,
              ) -> Iterator[FileFit]:
    """Each file with its estimate and cost, reading one header per repository (every quant
    of a repository has the model's shape; its bytes per step scale with its size)."""
    header: GGUFHeader | None = None
    read: RemoteFile | None = None  # the file whose header was read
    for f in files:
        if f.incomplete_split:
            yield FileFit(f, None, None, "one part of a split model whose other parts are not "
                                         "all listed")
            continue
        try:
            if header is None:
                header, read = hub.header(f), f
            assert read is not None
            cost = ModelCost.from_gguf(header, read.size)
            if f != read:
                cost = cost.for_file_size(header, read.size, f.size, f.quant)
            yield FileFit(f, hub.estimate(f, context_length, header), cost)
        except HubError as exc:
            yield FileFit(f, None, None, str(exc))
