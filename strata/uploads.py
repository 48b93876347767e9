"""Small host lists to the device without waiting for the device.

`torch.tensor(values, device="cuda")` copies with `non_blocking=False`, and
torch ends such a copy with a stream synchronisation: the host waits until
every kernel queued before it has finished. A step that builds index tensors
that way in each of its layers cannot queue its next kernels while the GPU
works, so host time and GPU time add up. The driver stages a pageable source
before `cudaMemcpyAsync` returns, so a non-blocking copy of a fresh CPU
tensor is safe to let go of at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values: Sequence[int] | Sequence[bool], device: torch.device,
           dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` as a 1-D tensor on `device`, queued behind the stream's work (no wait on CUDA)."""
    host = torch.tensor(values, dtype=dtype)
    return host if device.type == "cpu" else host.to(device, non_blocking=True)
