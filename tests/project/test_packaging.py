"""The installed app, as a user gets it: unpack the .deb and run the frozen bundle.

Needs `make package` first (dist/phasewise_<version>_amd64.deb); run with
`make test-packaging`. A bundle built from other sources than this tree's is refused (its
source-stamp.json, packaging/source_stamp.py). Every run uses a clean environment: an empty
HOME, a minimal PATH, nothing from this virtualenv, and fails on a Python traceback or a C++
abort on stderr, whatever its exit code. The bundle ships the default model as its GGUF and
the llama.cpp engine's libraries: on this CUDA-less machine the app runs it on llama.cpp,
converting nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[2]
SMOKE_TIMEOUT_S = 600
BUNDLE = "opt/phasewise"
MODEL_DIR = f"{BUNDLE}/_internal/models/SmolLM2-135M-Instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "What is the capital of France? Answer in one sentence."
FRESH_UNPACKS = 10  # the frozen app once aborted as it quit in 5 runs of 6 on one CPU kind


def _source_stamp() -> ModuleType:
    spec = importlib.util.spec_from_file_location("source_stamp",
                                                  ROOT / "packaging" / "source_stamp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _version() -> str:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r'^version = "([^"]+)"$', text, re.MULTILINE)
    assert match, "no version in pyproject.toml"
    return match.group(1)


@pytest.fixture(scope="module")
def deb() -> Path:
    path = ROOT / "dist" / f"phasewise_{_version()}_amd64.deb"
    if not path.is_file():
        pytest.fail(f"{path.relative_to(ROOT)} is missing: run `make package` first")
    return path


def _unpack(deb: Path, root: Path) -> Path:
    subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    return root


@pytest.fixture(scope="module")
def unpacked(deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The .deb unpacked, checked to be built from this tree (else every test fails)."""
    root = _unpack(deb, tmp_path_factory.mktemp("deb-root"))
    stamp_module = _source_stamp()
    stamp = root / BUNDLE / "_internal" / stamp_module.STAMP_NAME
    if not stamp.is_file():
        pytest.fail(f"{deb.name} has no {stamp_module.STAMP_NAME}: rebuild it (`make package`)")
    built_from = json.loads(stamp.read_text())["sources_sha256"]
    if built_from != stamp_module.source_digest(ROOT):
        pytest.fail(f"{deb.name} was built from other sources than this tree: `make package`")
    return root


def _assert_no_crash_text(stderr: str) -> None:
    """A run that 'passed' while printing a traceback or aborting as it quit did not pass."""
    for sign in ("Traceback", "terminate called", "Fatal Python error"):
        assert sign not in stderr, stderr[-3000:]


def _smoke(exe: Path, home: Path) -> dict:
    """The frozen app's --smoke-test (the window, one greedy reply, quit): its JSON line."""
    proc = subprocess.run(
        [str(exe), "--smoke-test"], env=_clean_env(home, QT_QPA_PLATFORM="offscreen"),
        cwd=home, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S,
    )
    _assert_no_crash_text(proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0])


def _clean_env(home: Path, **extra: str) -> dict[str, str]:
    return {"HOME": str(home), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **extra}


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_control_file_and_layout(deb: Path, unpacked: Path) -> None:
    fields = subprocess.run(["dpkg-deb", "-f", str(deb), "Package", "Version", "Architecture"],
                            check=True, capture_output=True, text=True).stdout
    assert fields.split("\n")[:3] == ["Package: phasewise", f"Version: {_version()}",
                                      "Architecture: amd64"]
    exe = unpacked / "opt/phasewise/phasewise"
    assert exe.is_file() and os.access(exe, os.X_OK)
    assert os.readlink(unpacked / "usr/bin/phasewise") == "/opt/phasewise/phasewise"
    desktop = (unpacked / "usr/share/applications/phasewise.desktop").read_text()
    assert "Exec=phasewise" in desktop and "Icon=phasewise" in desktop
    assert (unpacked / "usr/share/icons/hicolor/scalable/apps/phasewise.svg").is_file()
    model = unpacked / MODEL_DIR
    assert (model / "phasewise-bundled.json").is_file()


def test_bundle_ships_the_gguf_and_the_llama_cpp_libraries(unpacked: Path) -> None:
    model = unpacked / MODEL_DIR
    assert sorted(p.name for p in model.iterdir()) == [GGUF, "phasewise-bundled.json"]
    marker = json.loads((model / "phasewise-bundled.json").read_text())
    assert marker["gguf"] == GGUF
    assert marker["files"] == {GGUF: (model / GGUF).stat().st_size}
    assert (model / GGUF).read_bytes()[:4] == b"GGUF"
    # No converted weights anywhere in the installation.
    assert not [p for p in (unpacked / BUNDLE).rglob("*.safetensors")]
    # The library llama_cpp opens by name and the ggml libraries it links, where it looks
    # (llama_cpp/lib), with the CPU backend's variants that engine/llamacpp/cpu_backend.py
    # loads from there; the multimodal libraries it never loads stay out.
    libs = {p.name for p in (unpacked / BUNDLE / "_internal/llama_cpp/lib").iterdir()}
    assert {"libllama.so", "libggml.so.0", "libggml-base.so.0"} <= libs
    assert {"libggml-cpu-x64.so", "libggml-cpu-haswell.so", "libggml-cpu-zen4.so"} <= libs
    assert not [name for name in libs if "mtmd" in name or "llava" in name]
    # the sampler's native pass (engine/core/_weights.c), compiled by the install
    assert list((unpacked / BUNDLE / "_internal/engine/core").glob("_weights.*.so"))


def test_frozen_smoke_test_offline_with_empty_home(unpacked: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    before = _tree(unpacked / "opt")
    result = _smoke(unpacked / BUNDLE / "phasewise", home)
    assert result["ok"] is True
    assert result["model"] == "SmolLM2-135M-Instruct"
    assert result["device"] == "cpu"
    assert result["engine"] == "llama.cpp"  # no CUDA here: auto runs the bundled GGUF on it
    assert result["dtype"] == "Q4_1"
    # one of the CPU backend variants the bundle ships, smoke-run in a child and loaded
    assert re.fullmatch(r"llama\.cpp-(x64|haswell|alderlake|skylakex|cascadelake|icelake|zen4|"
                        r"sapphirerapids)-\d+t(-fa)?", result["kernel"]), result["kernel"]
    assert "Paris" in result["reply"]
    # The bundled model is used as shipped: no GGUF conversion into the user cache...
    assert not list(home.rglob("*.safetensors"))
    # ...and nothing is written inside the installation (user data lives in HOME).
    assert _tree(unpacked / "opt") == before


# Each fresh HOME is a first start: the CPU backend's smoke run in a child and the attention
# timing come on top of the reply (~20 s a run on a loaded 2-core machine).
@pytest.mark.timeout(900)
def test_frozen_smoke_test_on_fresh_unpacks_never_aborts(unpacked: Path, deb: Path,
                                                          tmp_path: Path) -> None:
    """A first start (empty HOME: the HUD calibrates while the reply runs) that quits at once,
    FRESH_UNPACKS times in a row, each from a new unpack: the exit must be clean every time."""
    for run in range(FRESH_UNPACKS):
        root = _unpack(deb, tmp_path / f"root-{run}")
        home = tmp_path / f"home-{run}"
        home.mkdir()
        result = _smoke(root / BUNDLE / "phasewise", home)
        assert (result["ok"], result["engine"]) == (True, "llama.cpp"), f"run {run}: {result}"
        shutil.rmtree(root)


def test_frozen_app_without_display_prints_one_clear_line(unpacked: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(unpacked / "opt/phasewise/phasewise")],
        env=_clean_env(tmp_path), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    _assert_no_crash_text(proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("phasewise: error: no display found")


def _ask(unpacked: Path, home: Path, *options: str, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(unpacked / BUNDLE / "phasewise"), "ask", PROMPT, "--json", "--temperature", "0",
         "--max-tokens", "24", *options],
        env=_clean_env(home, **env), cwd=home, capture_output=True, text=True,
        timeout=SMOKE_TIMEOUT_S,
    )
    _assert_no_crash_text(proc.stderr)
    return proc


def test_frozen_ask_runs_the_bundled_gguf_on_llama_cpp(unpacked: Path, tmp_path: Path) -> None:
    proc = _ask(unpacked, tmp_path, "--engine", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["engine"], result["dtype"], result["model"]) == (
        "llama.cpp", "Q4_1", "SmolLM2-135M-Instruct")
    assert "Paris" in result["text"]
    assert not list(tmp_path.rglob("*.safetensors"))  # nothing converted at first start


def test_frozen_torch_engine_converts_the_bundled_gguf(unpacked: Path, tmp_path: Path) -> None:
    """--engine torch still runs the default model: the bundled GGUF, converted once into the
    user's cache (never into the installation)."""
    before = _tree(unpacked / "opt")
    # One decode path: choosing among them (--kernel auto) is not what this test is about.
    proc = _ask(unpacked, tmp_path, "--engine", "torch", "--kernel", "fp32-eager")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["engine"] == "torch"
    assert "Paris" in result["text"]
    assert [p.name for p in tmp_path.rglob("*.safetensors")] == ["model.safetensors"]
    assert _tree(unpacked / "opt") == before


def test_frozen_app_reports_a_damaged_bundled_model(unpacked: Path, tmp_path: Path) -> None:
    # A copy of the bundled model with its GGUF cut short, put in place through the loader's
    # override (copying the whole installation would cost hundreds of MB).
    shipped = unpacked / MODEL_DIR
    damaged = tmp_path / "damaged"
    shutil.copytree(shipped, damaged, ignore=shutil.ignore_patterns(GGUF))
    with (shipped / GGUF).open("rb") as src:
        (damaged / GGUF).write_bytes(src.read(1 << 20))
    proc = subprocess.run(
        [str(unpacked / BUNDLE / "phasewise"), "ask", "hello"],
        env=_clean_env(tmp_path, PHASEWISE_BUNDLED_MODEL=str(damaged)),
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1
    _assert_no_crash_text(proc.stderr)
    assert "bundled default model is damaged" in proc.stderr
    assert "choose another model" in proc.stderr
