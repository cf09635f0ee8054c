"""How much memory can be allocated now (both runtimes ask before a large allocation)."""

from __future__ import annotations


def free_memory(device: str = "cpu") -> int | None:
    """Bytes that can be allocated now: the GPU's free memory, or the system's MemAvailable."""
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)
