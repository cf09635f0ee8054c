"""engine/tools/hub.py against a fake hub on loopback (tests/support/fake_hub.py): search, a
repository's files, the header read by range, download with progress, resume, cancel and
checksum, and every failure in one line with nothing lost. No test reaches the internet."""

from __future__ import annotations

import errno
import hashlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import huggingface_hub.constants
import pytest

from engine.gguf_header import read_gguf, read_gguf_model
from engine.tools import fit, hub
from engine.tools.hub import DownloadCancelled, Hub, HubError, Progress, RemoteFile
from tests.support.fake_hub import COMMIT, FakeHub
from tests.support.gguf import write_gguf, write_split_gguf

REPO = "someone/Tiny-GGUF"


@pytest.fixture(scope="module")
def model_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A GGUF of about 8 MB: a header with a vocabulary, then a weight table."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf(path, layers=2, kv_heads=2, rows=8192, vocab=3000).read_bytes()


@pytest.fixture
def fake(model_bytes: bytes, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    # The suite runs with HF_HUB_OFFLINE=1 (conftest); these tests talk to loopback only.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "")  # no login on this machine leaks into a request
    server = FakeHub()
    server.add(REPO, {"tiny-Q4_K_M.gguf": model_bytes, "tiny-Q8_0.gguf": model_bytes + b"\0" * 64,
                      "mmproj-tiny-f16.gguf": model_bytes, "README.md": b"# tiny"},
               downloads=50)
    server.add("someone/Other-GGUF", {"other.Q4_0.gguf": model_bytes}, downloads=900)
    server.add("meta/Gated-GGUF", {"gated.Q4_0.gguf": model_bytes}, gated=True)
    with server:
        yield server


@pytest.fixture
def client(fake: FakeHub) -> Hub:
    return Hub(endpoint=fake.endpoint)


def q4(client: Hub) -> RemoteFile:
    return client.file(REPO, "tiny-Q4_K_M.gguf")


def test_search_lists_gguf_repositories_most_downloaded_first(client: Hub,
                                                              fake: FakeHub) -> None:
    found = client.search("gguf")
    assert [r.id for r in found] == ["someone/Other-GGUF", REPO, "meta/Gated-GGUF"]
    assert found[0].downloads == 900
    assert [r.id for r in client.search("tiny")] == [REPO]
    assert client.search("nothing-like-this") == []
    assert fake.searches[0]["sort"] == ["downloads"] and fake.searches[0]["limit"] == ["10"]


def test_files_are_the_model_ggufs_with_size_and_sha256(client: Hub, model_bytes: bytes) -> None:
    files = client.files(REPO)
    assert [f.name for f in files] == ["tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf"]  # largest first
    assert [f.quant for f in files] == ["Q8_0", "Q4_K_M"]
    assert files[1].size == len(model_bytes)
    assert files[1].sha256 == hashlib.sha256(model_bytes).hexdigest()
    assert files[1].revision == COMMIT


def test_a_repository_with_several_files_asks_which(client: Hub) -> None:
    with pytest.raises(HubError, match=r"2 GGUF files \(Q4_K_M, Q8_0\): name one"):
        client.file(REPO)
    assert client.file("someone/Other-GGUF").name == "other.Q4_0.gguf"
    with pytest.raises(HubError, match=r"has no file nope.gguf"):
        client.file(REPO, "nope.gguf")


def test_header_is_read_by_range_and_matches_the_file(client: Hub, fake: FakeHub,
                                                      tmp_path: Path, model_bytes: bytes) -> None:
    local = tmp_path / "local.gguf"
    local.write_bytes(model_bytes)
    expected = read_gguf(local)
    header = client.header(q4(client))
    assert header.metadata == expected.metadata
    assert header.tensor_dims == expected.tensor_dims
    assert header.data_start == expected.data_start
    gets = [r for r in fake.requests if r[0] == "GET" and "/resolve/" in r[1]]
    assert gets and all(rng is not None for _m, _p, rng in gets)
    assert fake.sent["tiny-Q4_K_M.gguf"] <= hub.HEADER_FIRST_READ < len(model_bytes) // 4


def test_a_header_longer_than_the_first_read_reads_on_and_no_further(
        client: Hub, fake: FakeHub, tmp_path: Path, model_bytes: bytes) -> None:
    local = tmp_path / "local.gguf"
    local.write_bytes(model_bytes)
    data_start = read_gguf(local).data_start
    assert data_start > 4096  # the vocabulary makes the header span several reads
    header = client.header(q4(client), first_read=256)
    assert header.data_start == data_start
    ranges = [rng for m, p, rng in fake.requests if m == "GET" and "/resolve/" in p]
    assert len(ranges) > 2 and ranges[0] == "bytes=0-255"
    assert fake.sent["tiny-Q4_K_M.gguf"] < 2 * data_start + 256  # never the weights


def test_remote_estimate_is_the_local_one(client: Hub, tmp_path: Path,
                                          model_bytes: bytes) -> None:
    local = tmp_path / "tiny-Q4_K_M.gguf"
    local.write_bytes(model_bytes)
    remote = client.estimate(q4(client), 4096, free=10 << 30)
    assert remote == fit.llama_cpp_estimate(local, 4096, free=10 << 30)
    tight = client.estimate(q4(client), 4096, free=remote.needed_bytes - 1)
    assert not tight.fits


@pytest.mark.parametrize(("done", "rate", "line"), [
    (0, 0.0, "0 MB of 10 MB (0%)"),
    (4_000_000, 2e6, "4 MB of 10 MB (40%), 2 MB/s, 3 s left"),
    (9_900_000, 2e6, "10 MB of 10 MB (99%), 2 MB/s, under 1 s left"),
    (0, 1e3, "0 MB of 10 MB (0%), 1 kB/s, 2 h 46 min left"),
])
def test_progress_line_says_bytes_rate_and_time_left(done: int, rate: float, line: str) -> None:
    assert Progress(done=done, total=10_000_000, rate=rate).line() == line


def test_download_lands_verified_with_progress(client: Hub, tmp_path: Path,
                                               model_bytes: bytes) -> None:
    seen: list[Progress] = []
    path = client.download(q4(client), tmp_path, progress=seen.append)
    assert path == tmp_path / "tiny-Q4_K_M.gguf"
    assert path.read_bytes() == model_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-Q4_K_M.gguf"]  # no partial
    assert seen and seen[-1].done == seen[-1].total == len(model_bytes)
    assert [p.done for p in seen] == sorted(p.done for p in seen)
    assert "8 MB of 8 MB (100%)" in seen[-1].line()
    with pytest.raises(HubError, match=r"tiny-Q4_K_M.gguf is already in the models folder"):
        client.download(q4(client), tmp_path)


def test_lost_connection_keeps_the_partial_and_the_next_pull_resumes_byte_exact(
        client: Hub, fake: FakeHub, tmp_path: Path, model_bytes: bytes) -> None:
    fake.fault("tiny-Q4_K_M.gguf", "drop:300000")
    with pytest.raises(HubError, match=r"connection to the hub failed.*kept.*resumes") as info:
        client.download(q4(client), tmp_path)
    assert "\n" not in str(info.value)
    part = tmp_path / ".tiny-Q4_K_M.gguf.part"
    assert part.stat().st_size == 300000
    assert [m.partial for m in hub.local_models(tmp_path)] == [True]
    path = client.download(q4(client), tmp_path)
    assert path.read_bytes() == model_bytes
    ranges = [rng for m, p, rng in fake.requests if m == "GET" and "/resolve/" in p]
    assert ranges == ["bytes=0-", "bytes=300000-"]
    assert fake.sent["tiny-Q4_K_M.gguf"] == len(model_bytes)  # nothing sent twice
    assert not part.exists()


def test_server_error_mid_file_keeps_the_partial(client: Hub, fake: FakeHub, tmp_path: Path,
                                                 model_bytes: bytes) -> None:
    fake.fault("tiny-Q4_K_M.gguf", "drop:100000", "500")
    with pytest.raises(HubError):
        client.download(q4(client), tmp_path)
    with pytest.raises(HubError, match=r"answered 500.*kept.*resumes") as info:
        client.download(q4(client), tmp_path)
    assert "\n" not in str(info.value)
    assert (tmp_path / ".tiny-Q4_K_M.gguf.part").stat().st_size == 100000
    assert client.download(q4(client), tmp_path).read_bytes() == model_bytes


def test_checksum_mismatch_drops_the_file(client: Hub, fake: FakeHub, tmp_path: Path) -> None:
    fake.repos[REPO].listed_sha256["tiny-Q4_K_M.gguf"] = "0" * 64
    with pytest.raises(HubError, match=r"checksum mismatch.*dropped"):
        client.download(q4(client), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_is_not_a_gguf_is_dropped_at_its_first_bytes(
        client: Hub, fake: FakeHub, tmp_path: Path) -> None:
    fake.add("someone/Fake-GGUF", {"fake.Q4_0.gguf": b"<html>login</html>" * 5000})
    with pytest.raises(HubError, match=r"not a GGUF file"):
        client.download(client.file("someone/Fake-GGUF"), tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(HubError, match=r"not a GGUF file"):
        client.header(client.file("someone/Fake-GGUF"))


def test_missing_repository_and_gated_repository_say_what_to_do(client: Hub,
                                                                fake: FakeHub) -> None:
    with pytest.raises(HubError, match=r"someone/Nope: repository not found"):
        client.files("someone/Nope")
    with pytest.raises(HubError, match=(r"gated: accept its license at "
                                        rf"{fake.endpoint}/meta/Gated-GGUF.*hf auth login")):
        client.files("meta/Gated-GGUF")


def test_missing_file_is_one_line(client: Hub, fake: FakeHub, tmp_path: Path) -> None:
    gone = RemoteFile(REPO, "gone.gguf", 10, "0" * 64, COMMIT)
    with pytest.raises(HubError, match=r"gone.gguf: file not found") as info:
        client.download(gone, tmp_path)
    assert "\n" not in str(info.value)


def test_no_network_and_offline_mode_are_one_line(fake: FakeHub,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    nowhere = Hub(endpoint="http://127.0.0.1:9")  # discard port: nothing listens
    with pytest.raises(HubError, match=r"connection to the hub failed") as info:
        nowhere.files(REPO)
    assert "\n" not in str(info.value)
    with pytest.raises(HubError, match="connection to the hub failed"):
        nowhere.search("tiny")
    assert not [r for r in caplog.records if "Retry" in r.getMessage()]  # no 23 s of retries
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubError, match=r"offline: HF_HUB_OFFLINE is set"):
        Hub(endpoint=fake.endpoint).files(REPO)
    assert not [r for r in fake.requests if r[1].startswith("/api/models/")]


def full_disk_after(monkeypatch: pytest.MonkeyPatch, allowed: int) -> None:
    """The disk fills after `allowed` bytes: the write that crosses it writes what fits and
    fails with ENOSPC, as a real one does."""
    written = 0
    real = hub.write_chunk

    def write(fh: IO[bytes], chunk: bytes) -> None:
        nonlocal written
        room = allowed - written
        real(fh, chunk[:room])
        written += min(room, len(chunk))
        if room < len(chunk):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hub, "write_chunk", write)


def test_disk_full_keeps_the_partial_for_a_resume(client: Hub, tmp_path: Path,
                                                  model_bytes: bytes,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    full_disk_after(monkeypatch, 5 << 16)
    with pytest.raises(HubError, match=r"the disk is full.*kept") as info:
        client.download(q4(client), tmp_path)
    assert "\n" not in str(info.value)
    assert (tmp_path / ".tiny-Q4_K_M.gguf.part").stat().st_size == 5 << 16
    monkeypatch.setattr(hub, "write_chunk", lambda fh, chunk: fh.write(chunk))
    assert client.download(q4(client), tmp_path).read_bytes() == model_bytes


def test_not_enough_free_disk_refuses_before_downloading(client: Hub, fake: FakeHub,
                                                        tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    class Usage:
        free = 10 << 20

    monkeypatch.setattr(hub.shutil, "disk_usage", lambda _p: Usage())
    with pytest.raises(HubError, match=r"not enough disk space.*needs 8 MB more, 10 MB is free"):
        client.download(q4(client), tmp_path)
    assert not [r for r in fake.requests if r[0] == "GET" and "/resolve/" in r[1]]


def test_cancel_keeps_the_partial_and_resumes(client: Hub, fake: FakeHub, tmp_path: Path,
                                              model_bytes: bytes) -> None:
    cancel = threading.Event()
    fake.fault("tiny-Q4_K_M.gguf", "hold:300000")  # 300,000 bytes, then more once released
    client.progress_every_s = 0  # a report per read: one comes at 300,000 bytes

    def cancel_when_held(p: Progress) -> None:
        if p.done >= 300000 and not cancel.is_set():
            cancel.set()
            fake.release.set()  # the next bytes that arrive find the cancel

    with pytest.raises(DownloadCancelled, match=r"cancelled.*kept"):
        client.download(q4(client), tmp_path, progress=cancel_when_held, cancel=cancel)
    assert (tmp_path / ".tiny-Q4_K_M.gguf.part").stat().st_size == 300000
    assert client.download(q4(client), tmp_path).read_bytes() == model_bytes
    ranges = [rng for m, p, rng in fake.requests if m == "GET" and rng and rng.endswith("-")]
    assert ranges == ["bytes=0-", "bytes=300000-"]


def test_a_partial_of_another_revision_is_not_resumed(client: Hub, tmp_path: Path,
                                                      model_bytes: bytes) -> None:
    part, record = hub.partial_paths(tmp_path / "tiny-Q4_K_M.gguf")
    part.write_bytes(b"GGUF" + b"x" * 1000)  # another revision's bytes
    record.write_text('{"revision": "old"}', encoding="utf-8")
    assert client.download(q4(client), tmp_path).read_bytes() == model_bytes


def test_local_models_and_remove(tmp_path: Path, model_bytes: bytes) -> None:
    (tmp_path / "a.gguf").write_bytes(model_bytes)
    part, record = hub.partial_paths(tmp_path / "b.gguf")
    part.write_bytes(b"GGUF")
    record.write_text('{"size": 100}', encoding="utf-8")
    (tmp_path / "converted-folder").mkdir()
    models = hub.local_models(tmp_path)
    assert [(m.name, m.partial, m.size) for m in models] == [
        ("b.gguf", True, 4), ("a.gguf", False, len(model_bytes))]
    assert models[0].total == 100
    [b] = hub.find_local("b", tmp_path)
    assert hub.remove_local(b) == 4
    assert not part.exists() and not record.exists()
    assert [m.name for m in hub.local_models(tmp_path)] == ["a.gguf"]


def test_the_endpoint_setting_decides_where_file_bytes_come_from(
        fake: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub's ENDPOINT changed after import: hf_hub_url kept huggingface.co in the
    file URLs (only the API calls went to the endpoint)."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", fake.endpoint)
    client = Hub()
    assert client.url(q4(client)).startswith(f"{fake.endpoint}/{REPO}/resolve/{COMMIT}/")
    assert client.header(q4(client)).shape().vocab == 3000


def test_a_file_stored_in_git_is_checked_against_its_blob_sha1(client: Hub, fake: FakeHub,
                                                               tmp_path: Path,
                                                               model_bytes: bytes) -> None:
    """No LFS sha256 in the listing: the ETag is the git blob's sha1, and that is checked."""
    fake.add("someone/Small-GGUF", {"small.Q8_0.gguf": model_bytes}, in_git={"small.Q8_0.gguf"})
    small = client.file("someone/Small-GGUF")
    assert small.sha256 is None
    assert client.download(small, tmp_path).read_bytes() == model_bytes


def test_a_resume_answered_with_another_range_keeps_the_partial_intact(
        client: Hub, fake: FakeHub, tmp_path: Path, model_bytes: bytes) -> None:
    fake.fault("tiny-Q4_K_M.gguf", "drop:100000", "wrong-range")
    with pytest.raises(HubError):
        client.download(q4(client), tmp_path)
    with pytest.raises(HubError, match=r"another part of the file.*from byte 100,000.*kept"):
        client.download(q4(client), tmp_path)
    assert (tmp_path / ".tiny-Q4_K_M.gguf.part").read_bytes() == model_bytes[:100000]
    assert client.download(q4(client), tmp_path).read_bytes() == model_bytes


def test_a_models_folder_that_cannot_be_written_is_one_line(client: Hub,
                                                            tmp_path: Path) -> None:
    blocked = tmp_path / "models"
    blocked.write_text("a file where the folder should be", encoding="utf-8")
    with pytest.raises(HubError, match=r"tiny-Q4_K_M.gguf: cannot write to .*models") as info:
        client.download(q4(client), blocked)
    assert "\n" not in str(info.value)


def test_a_second_download_of_the_same_file_is_refused_while_the_first_runs(
        client: Hub, fake: FakeHub, tmp_path: Path, model_bytes: bytes) -> None:
    """Both would append to one partial file (two pulls, or a pull and the window)."""
    fake.fault("tiny-Q4_K_M.gguf", "hold:300000")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.download, q4(client), tmp_path)
        assert fake.holding.wait(timeout=30)
        try:
            with pytest.raises(HubError, match=r"being downloaded already") as info:
                Hub(endpoint=fake.endpoint).download(q4(client), tmp_path)
            assert "\n" not in str(info.value)
        finally:
            fake.release.set()
        assert first.result(timeout=30).read_bytes() == model_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-Q4_K_M.gguf"]  # no lock left


# ----- a model split over several files -------------------------------------------------------
@pytest.fixture
def split_repo(fake: FakeHub, tmp_path: Path) -> list[Path]:
    """someone/Split-GGUF: a model in three files, and two of another one's three."""
    local = write_split_gguf(tmp_path, "big-Q4_K_M")
    other = write_split_gguf(tmp_path, "big-Q8_0")
    fake.add("someone/Split-GGUF", {p.name: p.read_bytes() for p in [*local, *other[:2]]})
    return local


def test_a_split_model_is_one_model_estimated_from_its_parts_headers(
        client: Hub, fake: FakeHub, split_repo: list[Path]) -> None:
    files = client.files("someone/Split-GGUF")
    [whole] = [f for f in files if f.parts]
    assert [p.name for p in whole.parts] == [p.name for p in split_repo]
    assert whole.name == split_repo[0].name and whole.quant == "Q4_K_M"
    assert whole.size == sum(p.stat().st_size for p in split_repo)
    assert whole.label == f"{split_repo[0].name} (3 files)"
    incomplete = [f for f in files if not f.parts]
    assert len(incomplete) == 2 and all(f.incomplete_split for f in incomplete)
    assert client.file("someone/Split-GGUF").parts == whole.parts  # the only complete one
    # The header: every part's, read by range (no part's weights), as the local one reads.
    header = client.header(whole)
    local_header, local_size = read_gguf_model(split_repo[0])
    assert local_size == whole.size
    assert header.tensor_dims == local_header.tensor_dims and len(header.tensor_dims) == 3
    assert header.step_bytes(whole.size) == local_header.step_bytes(local_size)
    assert header.step_bytes(whole.size) == 1024 * 512 * 2 + 256 * 512 * 4 + 512 * 2
    reads = [(path, rng) for method, path, rng in fake.requests if method == "GET"
             and "/resolve/" in path]
    assert sorted(path.rsplit("/", 1)[1] for path, _ in reads) == [p.name for p in split_repo]
    assert fake.sent[split_repo[1].name] < split_repo[1].stat().st_size // 2  # header only
    [row] = [r for r in hub.iter_fits(client, [whole], 4096)]
    assert row.estimate is not None and row.estimate.weight_bytes == whole.size - header.data_start
    assert row.cost is not None and row.cost.step_bytes == header.step_bytes(whole.size)
    [part] = list(hub.iter_fits(client, incomplete[:1], None))
    assert part.estimate is None and "other parts are not all listed" in part.why


def test_a_split_model_downloads_every_part_and_resumes_the_one_cut_short(
        client: Hub, fake: FakeHub, split_repo: list[Path], tmp_path: Path) -> None:
    whole = next(f for f in client.files("someone/Split-GGUF") if f.parts)
    folder = tmp_path / "models"
    fake.fault(split_repo[1].name, "drop:300000")
    seen: list[Progress] = []
    with pytest.raises(HubError, match="kept"):
        client.download(whole, folder, progress=seen.append)
    assert (folder / split_repo[0].name).read_bytes() == split_repo[0].read_bytes()
    assert not (folder / split_repo[1].name).exists()
    assert {p.total for p in seen} == {whole.size}
    asked = len(fake.requests)
    seen.clear()
    path = client.download(whole, folder, progress=seen.append)
    assert path == folder / split_repo[0].name
    for part in split_repo:
        assert (folder / part.name).read_bytes() == part.read_bytes()
    gets = [(p.rsplit("/", 1)[1], rng) for m, p, rng in fake.requests[asked:] if m == "GET"]
    assert gets == [(split_repo[1].name, "bytes=300000-"), (split_repo[2].name, "bytes=0-")]
    assert seen[-1].done == seen[-1].total == whole.size
    assert seen[0].done > split_repo[0].stat().st_size + 300000 - 1  # the parts already there
    [model] = hub.local_models(folder)
    assert model.path == path and model.size == whole.size and len(model.parts) == 3
    assert model.label == f"{split_repo[0].name} (3 files)"
    with pytest.raises(HubError, match="already in the models folder"):
        client.download(whole, folder)
    assert hub.remove_local(model) == whole.size
    assert list(folder.iterdir()) == []
