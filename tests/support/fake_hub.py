"""A fake Hugging Face hub on loopback for engine/tools/hub.py's tests: the API routes
huggingface_hub calls (model search, a repository's files with sizes and LFS sha256) and the file
route (HEAD and GET of /{repo}/resolve/{revision}/{file}, with Range), with the headers the real hub
sends. Faults are queued per file and consumed by its next GETs: a status code, "drop:N"
(the headers promise the whole body, N bytes are sent, the connection closes), "hold:N"
(N bytes are sent, the rest once the test sets `release`), "rate:N" (N bytes a second: for
screenshots of a download under way, never in a test), "wrong-range" (a 206 of the file's first
bytes, whatever range was asked), or "ok".

It records every request and the body bytes it sent per file, so a test can assert that only
a header was read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import huggingface_hub
import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    gated: bool = False
    downloads: int = 0
    listed_sha256: dict[str, str] = field(default_factory=dict)  # overrides (a wrong sum)
    in_git: set[str] = field(default_factory=set)  # stored in git, not LFS: ETag = blob sha1
    kind: str = "gguf"  # "folder": a Hugging Face folder (found by the safetensors search)


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.faults: dict[str, list[str]] = defaultdict(list)  # file name -> queued faults
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.sent: dict[str, int] = defaultdict(int)  # file name -> body bytes sent
        self.searches: list[dict[str, list[str]]] = []  # each /api/models query
        self.lock = threading.Lock()
        self.release = threading.Event()  # lets a "hold:N" response go on
        self.holding = threading.Event()  # a "hold:N" response sent its N bytes and waits
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, repo: str, files: dict[str, bytes], **kwargs: Any) -> FakeRepo:
        self.repos[repo] = FakeRepo(files, **kwargs)
        return self.repos[repo]

    def fault(self, name: str, *faults: str) -> None:
        with self.lock:
            self.faults[name].extend(faults)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def git_sha1(self, repo: str, name: str) -> str:
        data = self.repos[repo].files[name]
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def sha256(self, repo: str, name: str) -> str:
        listed = self.repos[repo].listed_sha256.get(name)
        return listed or hashlib.sha256(self.repos[repo].files[name]).hexdigest()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection: a drop is a real close

        def log_message(self, *_args: Any) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        def _route(self, head: bool) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path)
            with hub.lock:
                hub.requests.append((self.command, path, self.headers.get("Range")))
            if path == "/api/models":
                return self._search(parse_qs(url.query))
            info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
            if info:
                return self._info(info.group(1))
            resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if resolve:
                return self._file(resolve.group(1), resolve.group(3), head)
            self._error(404, "EntryNotFound")

        def _json(self, body: Any, status: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, code: str | None, message: str = "error") -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _search(self, query: dict[str, list[str]]) -> None:
            with hub.lock:
                hub.searches.append(query)
            filters = query.get("filter", [])
            if filters == ["gguf"]:
                kind = "gguf"
            elif "safetensors" in filters and query.get("pipeline_tag") == ["text-generation"]:
                kind = "folder"
            else:  # the real hub would list every model
                return self._json([])
            text = query.get("search", [""])[0].lower()
            found = [{"id": rid, "modelId": rid, "downloads": r.downloads, "likes": 0,
                      "tags": [kind], "gated": "auto" if r.gated else False,
                      "private": False}
                     for rid, r in hub.repos.items() if text in rid.lower() and r.kind == kind]
            found.sort(key=lambda m: -int(m["downloads"]))  # type: ignore[call-overload]
            limit = int(query.get("limit", ["1000"])[0])
            self._json(found[:limit])

        def _gate(self, repo: str) -> bool:
            """Answer 401/404 for a gated or missing repository; True when it did."""
            if repo not in hub.repos:
                self._error(404, "RepoNotFound", "Repository not found")
                return True
            if hub.repos[repo].gated and not self.headers.get("Authorization"):
                self._error(401, "GatedRepo", "Access to this model is restricted")
                return True
            return False

        def _info(self, repo: str) -> None:
            if self._gate(repo):
                return
            r = hub.repos[repo]
            siblings = [{"rfilename": name, "size": len(data), "blobId": "b" * 40,
                         **({} if name in r.in_git else {
                             "lfs": {"sha256": hub.sha256(repo, name), "size": len(data),
                                     "pointerSize": 134}})}
                        for name, data in r.files.items()]
            self._json({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                        "gated": "auto" if r.gated else False, "tags": ["gguf"],
                        "downloads": r.downloads, "likes": 0, "siblings": siblings})

        def _file(self, repo: str, name: str, head: bool) -> None:
            if self._gate(repo):
                return
            data = hub.repos[repo].files.get(name)
            if data is None:
                return self._error(404, "EntryNotFound", "Entry not found")
            fault = None
            if not head:
                with hub.lock:
                    queue = hub.faults.get(name)
                    fault = queue.pop(0) if queue else None
            if fault is not None and fault.isdigit():
                return self._error(int(fault), None, "Internal Error")
            start, end = 0, len(data) - 1
            ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
            if ranged:
                start = int(ranged.group(1))
                end = min(end, int(ranged.group(2))) if ranged.group(2) else end
                if start >= len(data):
                    return self._error(416, None, "Range Not Satisfiable")
            body = data[start:end + 1]
            if fault == "wrong-range":  # a range from 0 whatever was asked, labelled so
                start, end = 0, len(body) - 1
                body = data[:len(body)]
            self.send_response(206 if ranged else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            if name in hub.repos[repo].in_git:
                self.send_header("ETag", f'"{hub.git_sha1(repo, name)}"')
            else:
                sha = hub.sha256(repo, name)
                self.send_header("ETag", f'"{sha}"')
                self.send_header("X-Linked-Etag", f'"{sha}"')
                self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(body)))
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            self.end_headers()
            if head:
                return
            if fault is not None and fault.startswith("drop:"):
                body = body[:int(fault[5:])]
            held = int(fault[5:]) if fault is not None and fault.startswith("hold:") else None
            try:
                if held is not None:
                    self._send(name, body[:held])
                    hub.holding.set()
                    hub.release.wait(timeout=60)  # a test that failed first: not forever
                    body = body[held:]
                if fault is not None and fault.startswith("rate:"):
                    self._send_slowly(name, body, int(fault[5:]))
                else:
                    self._send(name, body)
            except (BrokenPipeError, ConnectionResetError):
                return  # the client stopped reading (a cancel, a file that is not a GGUF)

        def _send_slowly(self, name: str, body: bytes, rate: int) -> None:
            piece = max(1, rate // 20)
            for start in range(0, len(body), piece):
                self._send(name, body[start:start + piece])
                time.sleep(piece / rate)

        def _send(self, name: str, body: bytes) -> None:
            self.wfile.write(body)
            self.wfile.flush()
            with hub.lock:
                hub.sent[name] += len(body)

    return Handler


TINY_REPO = "someone/Tiny-GGUF"


@contextlib.contextmanager
def tiny_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             speeds: bool = True) -> Iterator[FakeHub]:
    """A fake hub serving two quants of a tiny GGUF (and a gated repository), with an empty
    models folder and no token: what the CLI and the browser tests search and pull. With
    `speeds`, the cache dir holds a made-up measurement of this machine (tests/support/
    speed.py), so the speed prediction measures nothing."""
    from tests.support.gguf import write_gguf
    from tests.support.speed import install_speeds

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "")
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path / "cache"))
    if speeds:
        install_speeds()
    data = write_gguf(tmp_path / "m.gguf", layers=2, kv_heads=2, rows=1024).read_bytes()
    server = FakeHub()
    server.add(TINY_REPO, {"tiny-Q4_K_M.gguf": data, "tiny-Q8_0.gguf": data + b"\0" * 32},
               downloads=7)
    server.add("meta/Gated-GGUF", {"gated.Q4_0.gguf": data}, gated=True)
    with server:
        yield server
