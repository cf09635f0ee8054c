"""Device peaks for the roofline: memory bandwidth (GB/s) and matmul throughput (TFLOP/s).

Known CUDA GPUs come from a table of vendor specs (dense BF16/FP16 tensor TFLOP/s, HBM/GDDR
bandwidth). Anything else is measured once by a short torch calibration (< 2 s) and cached as
JSON in the user cache dir, keyed by device name, so later starts cost nothing.
"""

from __future__ import annotations

import json
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.errors import PhasewiseError
from engine.loader import cache_root

CACHE_FILE = "device_peaks.json"

# (substring of torch.cuda.get_device_name, lowercase) -> (GB/s, dense 16-bit TFLOP/s).
# Most specific first: "h100 pcie" must win over "h100".
GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("h200", 4800, 989),
    ("h100 nvl", 3900, 835),
    ("h100 pcie", 2000, 756),
    ("h100", 3350, 989),
    ("a100-sxm4-80gb", 2039, 312),
    ("a100 80gb pcie", 1935, 312),
    ("a100", 1555, 312),
    ("l40s", 864, 362),
    ("l4", 300, 121),
    ("a10g", 600, 70),
    ("a10", 600, 125),
    ("rtx 4090", 1008, 165),
    ("rtx 3090", 936, 71),
    ("v100", 900, 125),
    ("t4", 320, 65),
)


@dataclass(frozen=True)
class DevicePeaks:
    device: str  # a readable device name: "NVIDIA H200", "cpu: AMD EPYC 7B13"
    bandwidth_gb_s: float
    tflop_s: float
    source: str  # "spec table" | "calibrated" | "calibrated (cached)"

    def describe(self) -> str:
        return (f"peak {self.bandwidth_gb_s:,.0f} GB/s, {self.tflop_s:,.2f} TFLOP/s "
                f"({self.source}: {self.device})")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def device_name(device: str) -> str:
    """A stable, readable name for a torch device string ("cpu", "cuda:0", "mps")."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    if device.startswith("mps"):
        return f"mps: {platform.machine()}"
    from engine.kernels import cpu_name  # imports torch; calibration needs it anyway

    return f"cpu: {cpu_name()}"


def table_peaks(name: str) -> DevicePeaks | None:
    lower = name.lower()
    for key, gb_s, tflop_s in GPU_PEAKS:
        if key in lower:
            return DevicePeaks(name, gb_s, tflop_s, "spec table")
    return None


class CalibrationCancelled(PhasewiseError):
    """`stop` was set during a calibration: nothing was measured or cached."""


def measure_peaks(device: str = "cpu", budget_s: float = 1.5,
                  stop: threading.Event | None = None) -> tuple[float, float]:
    """(GB/s, TFLOP/s) from a timed copy and a timed matmul, best of a few repeats each.
    Setting `stop` ends it within one repeat (CalibrationCancelled): the app is quitting."""
    import torch

    dev = torch.device(device)
    gpu = dev.type != "cpu"
    dtype = torch.float16 if gpu else torch.float32
    copy_bytes = (256 if gpu else 64) << 20
    src = torch.ones(copy_bytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    # A copy reads and writes every byte once.
    copy_s = _best_time(lambda: dst.copy_(src), dev, budget_s / 2, stop)
    n = 4096 if gpu else 512
    a = torch.randn(n, n, dtype=dtype, device=dev)
    b = torch.randn(n, n, dtype=dtype, device=dev)
    mm_s = _best_time(lambda: torch.mm(a, b), dev, budget_s / 2, stop)
    return 2 * copy_bytes / copy_s / 1e9, 2 * n**3 / mm_s / 1e12


def _best_time(fn: Callable[[], object], dev: Any, budget_s: float,
               stop: threading.Event | None = None, reps: int = 20) -> float:
    import torch

    def sync() -> None:
        if getattr(dev, "type", "cpu") == "cuda":
            torch.cuda.synchronize(dev)

    fn()  # warm-up: allocation, kernel selection
    sync()
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    for _ in range(reps):
        if stop is not None and stop.is_set():
            raise CalibrationCancelled("calibration stopped")
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return max(best, 1e-9)


def _load_cache(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def device_peaks(
    device: str,
    *,
    name: str | None = None,
    directory: Path | None = None,
    measure: Callable[[str], tuple[float, float]] = measure_peaks,
) -> DevicePeaks:
    """Peaks for a device: spec table for known GPUs, else a cached or fresh calibration."""
    name = name or device_name(device)
    if device.startswith("cuda"):
        known = table_peaks(name)
        if known is not None:
            return known
    path = (directory or cache_root()) / CACHE_FILE
    cache = _load_cache(path)
    entry = cache.get(name)
    if isinstance(entry, dict) and {"bandwidth_gb_s", "tflop_s"} <= entry.keys():
        return DevicePeaks(name, float(entry["bandwidth_gb_s"]), float(entry["tflop_s"]),
                           "calibrated (cached)")
    gb_s, tflop_s = measure(device)
    cache[name] = {"bandwidth_gb_s": gb_s, "tflop_s": tflop_s, "device": device}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cache, indent=1), "utf-8")
    except OSError:
        pass  # a read-only cache dir only costs a re-calibration next start
    return DevicePeaks(name, gb_s, tflop_s, "calibrated")
