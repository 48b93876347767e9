"""How much memory a device has free: what start-up and /v1/state report beside the weights and pool."""

from __future__ import annotations

import torch


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_ram() -> int | None:
    """Bytes of RAM available to new allocations (Linux MemAvailable), or None if unknown."""
    return _meminfo("MemAvailable")


def device_memory(device: torch.device) -> tuple[int | None, int | None]:
    """(free, total) bytes of `device` now: CUDA's mem_get_info, the host's MemAvailable and
    MemTotal for the CPU; None where unknown."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    if device.type == "cpu":
        return available_ram(), _meminfo("MemTotal")
    return None, None
