"""Device peaks for the roofline: memory bandwidth (GB/s) and matmul throughput (TFLOP/s).

Known CUDA GPUs come from a table of vendor specs (dense BF16/FP16 tensor TFLOP/s, HBM/GDDR
bandwidth). Anything else is measured once by a short torch calibration (< 2 s) and cached as
JSON in the user cache dir, keyed by device name, so later starts cost nothing: a timed copy for
bandwidth, and for compute the best of a few square GEMMs on all of torch's threads (fp32
1536 x 1536 on a CPU, fp16 4096 x 4096 on a GPU). A 512 x 512 fp32 GEMM (the first version)
read 0.09 TFLOP/s on two AVX-512 cores where llama.cpp's prefill reached 0.27.

No single GEMM is the peak of what the engines run: llama.cpp's quantized kernels use int8 dot
products (VNNI: four times fp32's rate per instruction) and a small model's weights can sit in
cache, beating the copy's bandwidth. So the roofline's ceiling (`roof`) is the measured peak
raised to the best figure achieved on this device in this session, and says so: a share of
peak above 100% cannot happen.
"""

from __future__ import annotations

import json
import platform
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from engine.errors import PhasewiseError
from engine.model_files import cache_root

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
    method: str = ""  # how the figures were measured, for the UI (empty: the spec table)
    raised: str = ""  # "" or which ceilings `roof` raised to an achieved figure

    def describe(self) -> str:
        return (f"peak {self.bandwidth_gb_s:,.0f} GB/s, {self.tflop_s:,.2f} TFLOP/s "
                f"({self.source}: {self.device})")

    def how_measured(self) -> str:
        """One sentence on where the peaks come from, for a caption or tooltip."""
        origin = (f"vendor spec for {self.device}" if self.source == "spec table"
                  else f"{self.source} on {self.device}: {self.method or 'timed copy and GEMM'}")
        return f"Peak: {origin}" + (f"; {self.raised}" if self.raised else "") + "."

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def device_name(device: str) -> str:
    """A stable, readable name for a torch device string ("cpu", "cuda:0", "mps")."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    if device.startswith("mps"):
        return f"mps: {platform.machine()}"
    from engine.runtimes.torch.kernels import cpu_name  # imports torch; calibration needs it anyway

    return f"cpu: {cpu_name()}"


def table_peaks(name: str) -> DevicePeaks | None:
    lower = name.lower()
    for key, gb_s, tflop_s in GPU_PEAKS:
        if key in lower:
            return DevicePeaks(name, gb_s, tflop_s, "spec table")
    return None


class CalibrationCancelled(PhasewiseError):
    """`stop` was set during a calibration: nothing was measured or cached."""


def gemm_size(device: str) -> int:
    """The calibration GEMM's side: large enough to keep every core's vector units busy
    (a 512 x 512 one ran at a quarter of a 2048 x 2048 one's rate on a 2-core EPYC)."""
    return 1536 if device == "cpu" else 4096


def calibration_method(device: str) -> str:
    """How measure_peaks measures on `device`, in words (shown beside the roofline)."""
    import torch

    n = gemm_size(device)
    if device == "cpu":
        gemm = f"fp32 {n}x{n} GEMM on {torch.get_num_threads()} threads"
        copy = "64 MB copy"
    else:
        gemm, copy = f"fp16 {n}x{n} GEMM", "256 MB copy"
    return f"{copy} and {gemm}, best of up to 20 runs"


def measure_peaks(device: str = "cpu", budget_s: float = 1.5,
                  stop: threading.Event | None = None) -> tuple[float, float]:
    """(GB/s, TFLOP/s) from a timed copy and a timed square GEMM (gemm_size; on all of torch's
    threads), best of a few repeats each. Setting `stop` ends it within one repeat
    (CalibrationCancelled): the app is quitting."""
    import torch

    dev = torch.device(device)
    gpu = dev.type != "cpu"
    dtype = torch.float16 if gpu else torch.float32
    copy_bytes = (256 if gpu else 64) << 20
    src = torch.ones(copy_bytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    # A copy reads and writes every byte once.
    copy_s = _best_time(lambda: dst.copy_(src), dev, budget_s / 2, stop)
    n = gemm_size(dev.type)
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
    refresh: bool = False,
) -> DevicePeaks:
    """Peaks for a device: spec table for known GPUs, else a cached or fresh calibration
    (`refresh`: fresh in any case, and cached for the HUD: engine/tools/speed.py measures the
    machine with it, so the roofline and the speed prediction share one figure)."""
    name = name or device_name(device)
    if device.startswith("cuda"):
        known = table_peaks(name)
        if known is not None:
            return known
    path = (directory or cache_root()) / CACHE_FILE
    cache = _load_cache(path)
    entry = cache.get(name)
    method = calibration_method(device)
    # An entry measured another way (an older, smaller GEMM) is measured again.
    if (not refresh and isinstance(entry, dict) and {"bandwidth_gb_s", "tflop_s"} <= entry.keys()
            and entry.get("method") == method):
        return DevicePeaks(name, float(entry["bandwidth_gb_s"]), float(entry["tflop_s"]),
                           "calibrated (cached)", method)
    gb_s, tflop_s = measure(device)
    cache[name] = {"bandwidth_gb_s": gb_s, "tflop_s": tflop_s, "device": device,
                   "method": method}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cache, indent=1), "utf-8")
    except OSError:
        pass  # a read-only cache dir only costs a re-calibration next start
    return DevicePeaks(name, gb_s, tflop_s, "calibrated", method)


def roof(peaks: DevicePeaks, achieved: Iterable[tuple[float, float]]) -> DevicePeaks:
    """The roofline's ceiling: `peaks` raised to the best (GB/s, TFLOP/s) achieved on this
    device (pass every figure that will be drawn against it, so none is above 100%). `raised`
    says which ceiling moved and from what."""
    figures = list(achieved)
    best_gb_s = max((gb_s for gb_s, _ in figures), default=0.0)
    best_tflop_s = max((tflop_s for _, tflop_s in figures), default=0.0)
    notes = []
    if best_gb_s > peaks.bandwidth_gb_s:
        notes.append(f"bandwidth raised to the best decode seen ({best_gb_s:,.1f} GB/s; "
                     f"measured {peaks.bandwidth_gb_s:,.1f})")
    if best_tflop_s > peaks.tflop_s:
        notes.append(f"compute raised to the best prefill seen ({best_tflop_s:,.3f} TFLOP/s; "
                     f"measured {peaks.tflop_s:,.3f})")
    if not notes:
        return peaks
    return replace(peaks, bandwidth_gb_s=max(peaks.bandwidth_gb_s, best_gb_s),
                   tflop_s=max(peaks.tflop_s, best_tflop_s), raised="; ".join(notes))
