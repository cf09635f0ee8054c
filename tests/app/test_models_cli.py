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


def test_search_says_how_fast_each_file_runs_here(fake: FakeHub,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert models(fake, "search", "tiny") == 0
    out, err = capsys.readouterr()
    assert "Speed predicted from one measurement of this computer (cpu: Test CPU" in out
    lines = [line for line in out.splitlines() if ".gguf" in line]
    assert len(lines) == 2 and all("fits: needs ~" in line for line in lines)
    assert all(re.search(r"; ~[\d,]+ tok/s, 4,000-token prompt ~[\d.]+ s$", line)
               for line in lines), lines
    # The larger file reads more bytes per token: it is predicted slower.
    small, large = (int(re.search(r"~([\d,]+) tok/s", line).group(1).replace(",", ""))
                    for line in lines)
    assert large < small
    assert "measuring" not in err  # the cached measurement (tiny_hub's) was used
    assert models(fake, "search", "tiny", "--no-speed") == 0
    assert "tok/s" not in capsys.readouterr().out


def test_search_measures_this_computer_once(fake: FakeHub, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.tools import speed
    from tests.support.speed import CountingMeasure

    (tmp_path / "cache" / speed.SPEED_FILE).unlink()  # a machine not measured yet
    measure = CountingMeasure()
    monkeypatch.setattr(speed, "measure_engine", measure)
    assert models(fake, "search", "tiny") == 0
    out, err = capsys.readouterr()
    assert "measuring this computer once for the speed prediction" in err
    assert out.count("4,000-token prompt ~") == 2 and len(measure.calls) == 1
    assert models(fake, "search", "tiny") == 0  # cached: not measured again
    out, err = capsys.readouterr()
    assert out.count("4,000-token prompt ~") == 2 and "measuring" not in err
    assert len(measure.calls) == 1
    assert models(fake, "search", "tiny", "--measure-again") == 0
    assert len(measure.calls) == 2


def test_a_split_model_is_searched_pulled_listed_and_removed_as_one(
        fake: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.support.gguf import write_split_gguf

    parts = write_split_gguf(tmp_path, "big-Q4_K_M")
    fake.add("someone/Split-GGUF", {p.name: p.read_bytes() for p in parts}, downloads=3)
    assert models(fake, "search", "split") == 0
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if ".gguf" in line]
    assert f"Q4_K_M   {parts[0].name} (3 files)" in line
    assert "fits: needs ~" in line and "4,000-token prompt ~" in line
    assert models(fake, "pull", "someone/Split-GGUF") == 0
    out, err = capsys.readouterr()
    folder = tmp_path / "cache" / "models"
    assert out.strip() == str(folder / parts[0].name)
    assert all((folder / p.name).read_bytes() == p.read_bytes() for p in parts)
    assert "(3 files)" in err and "(100%)" in err
    assert models(fake, "list") == 0
    assert f"{parts[0].name} (3 files)" in capsys.readouterr().out
    assert models(fake, "rm", parts[0].name, "--yes") == 0
    assert "removed" in capsys.readouterr().out and list(folder.iterdir()) == []


def test_search_lists_hugging_face_folders_the_torch_engine_runs(
        fake: FakeHub, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = {p.name: p.read_bytes() for p in tiny_model_dir.iterdir() if p.is_file()}
    fake.add("someone/Folder-Llama", files, kind="folder", downloads=5)
    fake.add("someone/Folder-Vit", {"config.json": b'{"model_type": "vit"}',
                                    "model.safetensors": b"\0" * 64}, kind="folder")
    assert models(fake, "search", "folder", "--context", "256") == 0
    out = capsys.readouterr().out
    assert "no GGUF" not in out and "Hugging Face folders (the torch engine loads" in out
    assert "torch on Bundled (Q4_1): decode 100 tok/s" in out  # the torch measurement
    block = out.split("someone/Folder-Llama  (5 downloads)\n")[1].splitlines()[0]
    local = fit.torch_estimate(str(tiny_model_dir), context_length=256)
    assert local is not None
    assert block.startswith("  F32      the folder (1 safetensors file)")
    assert f"fits: needs ~{fit.size(local.needed_bytes)} at 256 tokens" in block
    assert re.search(r"; ~[\d,]+ tok/s, a 4,000-token prompt is over its context$", block)
    assert "is a vit model, not a text-generation (causal LM) architecture" in out
    weights = len(files["model.safetensors"])
    assert 0 < fake.sent["model.safetensors"] < weights // 10  # its header only
    assert "load one: phasewise --model someone/Folder-Llama --allow-download" in out
    assert models(fake, "search", "folder", "--no-folders") == 0
    assert "no GGUF repositories or Hugging Face folders match" in capsys.readouterr().out


def test_a_busy_measurement_is_taken_again_when_the_machine_is_idle(
        fake: FakeHub, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from engine.runtime_choice import gguf_engine
    from engine.tools import speed
    from tests.support.speed import CountingMeasure, fake_speed

    engine = gguf_engine()
    profiles = speed.SpeedProfiles()
    profiles.put(engine, speed.speed_device(engine), replace(fake_speed(engine), loadavg=5.0))
    measure = CountingMeasure()
    monkeypatch.setattr(speed, "measure_engine", measure)
    monkeypatch.setattr(speed, "_loadavg", lambda: 0.2)
    assert models(fake, "search", "tiny", "--no-folders") == 0
    assert "measuring this computer" in capsys.readouterr().err and measure.calls == [engine]
    assert models(fake, "search", "tiny", "--no-folders") == 0  # taken idle now: kept
    assert measure.calls == [engine]
