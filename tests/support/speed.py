"""A made-up measurement of this machine (engine/tools/speed.py's EngineSpeed) for tests, so nothing
measures for real: written into the run's cache dir under this machine's key, or counted
when a test checks that measuring happens once."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

from engine.runtime_choice import LLAMA_CPP, TORCH
from engine.tools.speed import EngineSpeed, SpeedProfiles, speed_device


def fake_speed(engine: str = LLAMA_CPP, decode_tok_s: float = 100.0) -> EngineSpeed:
    """A measurement with round numbers: 20 GB/s, the engine reading 100 MB per decode step
    at `decode_tok_s`; prompts cost 2 ms per token plus 1e-7 s x n^2 / 2, 50 ms set-up."""
    return EngineSpeed(
        engine=engine, device="cpu: Test CPU", build="test build", threads=2,
        bandwidth_gb_s=20.0, bandwidth_method="made up for a test", model="Bundled (Q4_1)",
        kernel="test", decode_tok_s=decode_tok_s, decode_bytes=100_000_000,
        decode_parameters=134_000_000, prefill_points=((128, 0.3), (512, 1.1), (1536, 3.3)),
        prefill_line=(0.002, 1e-7, 0.05), prompt_flops_per_token=2e8, attention=34560,
        measured_s=12.0, loadavg=0.3, when="2026-12-02 12:00")


def install_speeds(directory: Path | None = None, decode_tok_s: float = 100.0) -> None:
    """fake_speed for both engines, cached as this machine's measurement (in the cache dir
    PHASEWISE_CACHE_DIR names unless `directory` is given)."""
    profiles = SpeedProfiles(directory)
    for engine in (LLAMA_CPP, TORCH):
        profiles.put(engine, speed_device(engine), fake_speed(engine, decode_tok_s))


class CountingMeasure:
    """A stand-in for engine.tools.speed.measure_engine that counts its calls (a fake measurement
    that can be held until `release` is set, to see the dialog while it measures)."""

    def __init__(self, hold: bool = False) -> None:
        self.calls: list[str] = []
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def __call__(self, engine: str, device: str = "cpu",
                 stop: threading.Event | None = None) -> EngineSpeed:
        self.calls.append(engine)
        while not self.release.wait(0.05):
            if stop is not None and stop.is_set():
                from engine.tools.speed import MeasureCancelled

                raise MeasureCancelled("measuring stopped")
        return replace(fake_speed(engine), when=f"call {len(self.calls)}")
