"""`phasewise models search | pull | list | rm` against the fake hub on loopback."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.cli import main
from engine.tools import fit
from tests.support.fake_hub import TINY_REPO, FakeHub, tiny_hub

REPO = TINY_REPO


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with tiny_hub(tmp_path, monkeypatch) as server:
        yield server


def models(fake: FakeHub, *args: str) -> int:
    extra = ["--endpoint", fake.endpoint] if args[0] in ("search", "pull") else []
    return main(["models", *args, *extra])


def test_search_lists_quants_with_size_and_fit(fake: FakeHub,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert models(fake, "search", "tiny", "--context", "2048") == 0
    out = capsys.readouterr().out
    assert f"{REPO}  (7 downloads)" in out
    assert "Q4_K_M   tiny-Q4_K_M.gguf" in out and "Q8_0     tiny-Q8_0.gguf" in out
    assert out.count("fits: needs ~") == 2 and "at 2,048 tokens" in out
    assert "Gated" not in out


def test_search_says_does_not_fit_when_memory_is_short(fake: FakeHub, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fit, "free_memory", lambda _device="cpu": 1 << 20)
    assert models(fake, "search", "tiny") == 0
    assert capsys.readouterr().out.count("does not fit: needs ~") == 2
    # with room for the weights and a shorter context, it says which context fits
    est = fit.llama_cpp_estimate(tmp_path / "m.gguf", 8192, free=None)
    room = est.weight_bytes + (est.needed_bytes - est.weight_bytes) // 2
    monkeypatch.setattr(fit, "free_memory", lambda _device="cpu": room)
    assert models(fake, "search", "tiny", "--context", "8192") == 0
    assert "does not fit: needs ~" in (out := capsys.readouterr().out)
    assert re.search(r"at 8,192 tokens \(fits at \d,\d{3}\)", out)


def test_pull_list_rm(fake: FakeHub, tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    assert models(fake, "pull", f"{REPO}:tiny-Q4_K_M.gguf") == 0
    out, err = capsys.readouterr()
    target = tmp_path / "cache" / "models" / "tiny-Q4_K_M.gguf"
    assert out.strip() == str(target)
    assert target.read_bytes() == fake.repos[REPO].files["tiny-Q4_K_M.gguf"]
    assert "fits: needs ~" in err and "(100%)" in err and "verified" in err
    asked = len(fake.requests)
    assert models(fake, "pull", f"{REPO}:tiny-Q4_K_M.gguf") == 1  # there already
    assert "already in the models folder" in capsys.readouterr().err
    assert not [r for r in fake.requests[asked:] if "/resolve/" in r[1]]  # not even its header
    assert models(fake, "list") == 0
    assert "tiny-Q4_K_M.gguf" in capsys.readouterr().out
    assert models(fake, "rm", "tiny-Q4_K_M") == 1  # not a terminal: it needs --yes
    assert "asks first: pass --yes" in capsys.readouterr().err
    assert target.exists()
    assert models(fake, "rm", "tiny-Q4_K_M", "--yes") == 0
    assert "removed tiny-Q4_K_M.gguf" in capsys.readouterr().out
    assert not target.exists()
    assert models(fake, "rm", "tiny-Q4_K_M", "--yes") == 1


def test_pull_without_file_asks_which_and_bad_specs_are_one_line(
        fake: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    assert models(fake, "pull", REPO) == 1
    assert "has 2 GGUF files (Q4_K_M, Q8_0): name one" in capsys.readouterr().err
    assert models(fake, "pull", "not-a-repo") == 1
    assert "is not REPO[:FILE]" in capsys.readouterr().err


def test_pull_refuses_what_does_not_fit_unless_forced(fake: FakeHub, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fit, "free_memory", lambda _device="cpu": 1 << 20)
    assert models(fake, "pull", f"{REPO}:tiny-Q8_0.gguf") == 1
    err = capsys.readouterr().err
    assert "does not fit in memory" in err and "--force downloads it anyway" in err
    assert not (tmp_path / "cache" / "models" / "tiny-Q8_0.gguf").exists()
    assert models(fake, "pull", f"{REPO}:tiny-Q8_0.gguf", "--force") == 0


def test_pull_of_a_gated_repository_says_what_to_do(fake: FakeHub,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert models(fake, "pull", "meta/Gated-GGUF") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gated" in err and "hf auth login" in err


def test_an_interrupted_pull_resumes(fake: FakeHub, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    fake.fault("tiny-Q4_K_M.gguf", "ok", "drop:50000")  # the header read, then the download
    assert models(fake, "pull", f"{REPO}:tiny-Q4_K_M.gguf") == 1
    err = capsys.readouterr().err
    assert "kept" in err and "the same pull resumes it" in err
    assert models(fake, "list") == 0
    assert "partial download" in capsys.readouterr().out
    assert models(fake, "pull", f"{REPO}:tiny-Q4_K_M.gguf") == 0
    data = fake.repos[REPO].files["tiny-Q4_K_M.gguf"]
    assert (tmp_path / "cache" / "models" / "tiny-Q4_K_M.gguf").read_bytes() == data
    assert fake.sent["tiny-Q4_K_M.gguf"] - header_bytes(fake) == len(data)


def header_bytes(fake: FakeHub) -> int:
    """Bytes the two fit estimates read (the header, by range) before the downloads."""
    ranges = [rng for m, p, rng in fake.requests
              if m == "GET" and "/resolve/" in p and rng and not rng.endswith("-")]
    return sum(int(r.split("-")[1]) + 1 - int(r.split("=")[1].split("-")[0]) for r in ranges)
