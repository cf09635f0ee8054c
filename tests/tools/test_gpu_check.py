"""benchmarks/gpu_check.py: the device check runs on CPU (small sizes) and reports every step;
a missing piece is one line and the rest still runs; carried wheels and model parts.

The full run happens in a child process, as on the GPU machine: its own imports, its own
threads, its exit status. Timings are printed by the script, never asserted here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.timeout(960)  # the CPU run's own limit is 900 s
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
STATUSES = {"pass", "fail", "measured", "skipped", "error"}
CORRECTNESS = {"load", "greedy = generate()", "cached turn = cold", "alternatives = one by one",
               "batch = one by one", "cancel", "out of memory", "static cache = engine"}


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, str]:
    out = tmp_path_factory.mktemp("gpu-check")
    # One torch thread: steadier on a shared 2-core machine; a generous budget so that no
    # step is skipped for time on a slow one.
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--model", "tiny", "--threads", "1",
           "--budget", "900", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text("utf-8"))
    return report, (out / "report.md").read_text("utf-8"), proc.stdout


def test_cpu_run_passes_every_correctness_check(cpu_report: tuple[dict, str, str]) -> None:
    report, _table, _stdout = cpu_report
    steps = {s["name"]: s for s in report["steps"]}
    assert report["ok"] is True
    assert {s["status"] for s in report["steps"]} <= STATUSES
    assert steps.keys() >= CORRECTNESS
    failed = {n: steps[n]["line"] for n in CORRECTNESS if steps[n]["status"] != "pass"}
    assert not failed
    assert steps["transformers takes cache="]["status"] == "pass"
    assert steps["load"]["data"]["dtype"] == "float32"


def test_cpu_run_measures_speed_and_skips_only_cuda_graphs(
        cpu_report: tuple[dict, str, str]) -> None:
    report, _table, _stdout = cpu_report
    errors = {s["name"]: s["line"] for s in report["steps"] if s["status"] == "error"}
    assert not errors
    skipped = {s["name"]: s["line"] for s in report["steps"] if s["status"] == "skipped"}
    assert set(skipped) == {"cpu-b: static + CUDA graphs", "cpu-a: static + CUDA graphs"}
    assert all(line == "CUDA graphs need a CUDA device" for line in skipped.values())
    speed = report["speed"]
    for shape in ("cpu-b", "cpu-a"):
        assert {"eager", "static"} <= speed[shape].keys()
        assert all(row["tok_s"] > 0 and row["gb_s"] > 0 for row in speed[shape].values())
    assert [row["batch"] for row in speed["batch"]["rows"]] == [1, 8, 64]
    assert speed["ttft"]["cached_tokens"] == 256
    assert speed["speculation"]["spec_output_identical"] is True
    hud = {s["name"]: s for s in report["steps"] if s["section"] == "hud"}
    assert set(hud) == {"HUD = engine stamps", "HUD vs caller's clock"}
    # The HUD equals the events' stamps, inside the caller's interval: a check on any machine.
    stamps = hud["HUD = engine stamps"]
    assert stamps["status"] == "pass", stamps["line"]
    assert stamps["data"]["hud"] == pytest.approx(stamps["data"]["stamps"], rel=1e-9)
    # How far from the caller's own clock: a timing, measured and reported, not asserted.
    clock = hud["HUD vs caller's clock"]
    assert clock["status"] == "measured"
    assert set(clock["data"]["relative_difference"]) == {"ttft_s", "decode_tok_s", "e2e_s"}
    assert isinstance(clock["data"]["within_tolerance"], bool)


def test_cpu_run_writes_the_table_and_the_targets(cpu_report: tuple[dict, str, str]) -> None:
    report, table, stdout = cpu_report
    targets = {t["target"]: t for t in report["targets"]}
    assert len(targets) == 3
    assert targets["cpu-b static+graphs decode >= 70% of copy bandwidth"]["status"] == "missing"
    assert {t["status"] for t in targets.values()} <= {"pass", "fail", "missing"}
    assert table.startswith("# Phasewise device check: cpu")
    for step in report["steps"]:
        assert f"| {step['section']} | {step['name']} | {step['status']} |" in table
    assert "| target | result | measured |" in table
    assert table.strip() in stdout  # the table is printed last, for a device run's tail
    assert report["meta"]["qt_imported"] is False  # the GPU machine has no Qt
    assert report["meta"]["complete"] is True


def test_a_missing_package_is_one_line_and_the_rest_still_runs(gpu_check: ModuleType) -> None:
    report = gpu_check.Report(60, {"setup"})
    written: list[int] = []
    report.after_step = lambda: written.append(len(report.steps))  # the partial report

    def needs_gguf() -> tuple[str, str, dict]:
        raise ModuleNotFoundError("No module named 'gguf'", name="gguf")

    def broken() -> tuple[str, str, dict]:
        raise RuntimeError("first line\nsecond line")

    first = report.run("setup", "convert", needs_gguf, provides="model")
    after = report.run("setup", "uses the model", lambda: ("pass", "ok", {}), needs=("model",))
    other = report.run("setup", "independent", lambda: ("measured", "42", {}))
    error = report.run("setup", "broken", broken)
    off = report.run("speed", "not selected", lambda: ("pass", "", {}))
    assert (first.status, first.line) == ("skipped", "missing package gguf")
    assert (after.status, after.line) == ("skipped", "needs model (convert: skipped)")
    assert other.status == "measured"
    assert (error.status, error.line) == ("error", "RuntimeError: first line")
    assert "traceback" in error.data
    assert (off.status, off.line) == ("skipped", "section not selected")
    assert written == [1, 2, 3, 4, 5]


def test_steps_past_the_budget_are_skipped_with_the_reason(gpu_check: ModuleType) -> None:
    report = gpu_check.Report(0, {"speed"})
    step = report.run("speed", "compile", lambda: ("pass", "", {}), min_s=1)
    assert step.status == "skipped" and step.line.startswith("over the time budget")


def _wheel(folder: Path, name: str, version: str, body: str) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}/__init__.py", body)
        archive.writestr(f"{name}-{version}.dist-info/METADATA",
                         f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return path


def test_carried_wheels_are_used_only_where_the_installed_version_differs(
        gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "phasewise_carried_probe", "1.0", "VALUE = 'carried'\n")
    pytest_version = importlib.metadata.version("pytest")
    _wheel(wheels, "pytest", pytest_version, "raise ImportError('must not be unpacked')\n")
    used = gpu_check.use_carried_wheels(wheels, tmp_path / "site")
    assert used == ["phasewise_carried_probe 1.0 (installed: none)"]
    assert sys.path[0] == str(tmp_path / "site")
    assert not (tmp_path / "site" / "pytest").exists()
    module = importlib.import_module("phasewise_carried_probe")
    try:
        assert module.VALUE == "carried"
    finally:
        sys.modules.pop("phasewise_carried_probe", None)


def test_bundled_model_parts_join_only_when_complete_and_intact(
        gpu_check: ModuleType, tmp_path: Path) -> None:
    source = tmp_path / "src" / gpu_check.GGUF_NAME
    source.parent.mkdir()
    source.write_bytes(bytes(range(256)) * 41 + b"tail")
    carried = tmp_path / "carried"
    folders = gpu_check.split_gguf(source, carried)
    assert [f.name for f in folders] == ["model-1", "model-2"]
    out = tmp_path / "out"
    out.mkdir()
    joined, why = gpu_check.carried_gguf(carried, out)
    assert joined is not None and joined.read_bytes() == source.read_bytes(), why

    part2 = next(folders[1].glob("*.part2"))
    data = part2.read_bytes()
    part2.unlink()
    assert gpu_check.carried_gguf(carried, out) == (
        None, "1 of 2 parts here (each call carries one; a warm machine keeps the last call's)")
    part2.write_bytes(data[:-1] + b"?")
    joined, why = gpu_check.carried_gguf(carried, out)
    assert joined is None and "sha256 differs" in why
    assert gpu_check.carried_gguf(tmp_path / "nothing", out)[0] is None
