"""The one rule that picks an attention backend for a pool.

- a pool on a CUDA device, Triton present, in a format the kernels read:
  the Triton kernels, over the pool in place (`triton_pool`) or over a
  streamed pool's device block cache (`triton_stream`);
- everything else, and a pool with a sliding-window layer: the reference
  (`reference`), which on the CPU runs the C++ kernel where it is built and
  plain torch elsewhere. (Gemma 3's sliding layers are not pool layers: they
  attend over their window's state, `models/window.py`.)

Only in-place Triton steps are captured as CUDA graphs (`graphs_possible`):
a streamed step plans its copies on the host every step.
"""

from __future__ import annotations

from strata.attention.base import AttentionBackend
from strata.attention.layout import supported
from strata.attention.reference import TableAttention
from strata.kv.pool import KvPool

try:  # the CPU path must not need Triton
    from strata.attention.triton_pool import GpuTableAttention
    from strata.attention.triton_stream import GpuStreamAttention

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the installation
    HAVE_TRITON = False


def backend_for(pool: KvPool, windowed: bool = False) -> AttentionBackend:
    """The attention backend that steps over `pool` use; `windowed` (a pool layer attends within a
    window): the reference, which alone takes a window today (torch on a CUDA device)."""
    if pool.device.type == "cuda" and HAVE_TRITON and supported(pool.fmt) and not windowed:
        return GpuTableAttention if pool.in_place else GpuStreamAttention
    return TableAttention


def graphs_possible(backend: AttentionBackend) -> bool:
    """Whether decode steps of this backend can be captured as CUDA graphs."""
    return HAVE_TRITON and backend is GpuTableAttention
