"""Device functions shared by the Triton kernels."""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _exp_libdevice(x):
    return libdevice.exp(x)  # CUDA's expf, as torch's SiLU calls it (tl.exp is ex2.approx)


@triton.jit
def _exp_numpy(x):
    return tl.exp(x)  # the interpreter has no libdevice


@triton.jit
def _log1p_libdevice(x):
    return libdevice.log1p(x)  # CUDA's log1pf, as torch's softplus calls it


@triton.jit
def _log1p_numpy(x):
    w = 1.0 + x  # log(w) * x / (w - 1): log1p to a few ulps where 1 + x rounds (Goldberg)
    return tl.where(w == 1.0, x, tl.log(w) * x / (w - 1.0))


# exp as torch computes it on the device; Triton's interpreter (TRITON_INTERPRET=1, set by the
# process that runs kernels on the CPU) has no libdevice
exp = _exp_numpy if os.environ.get("TRITON_INTERPRET") == "1" else _exp_libdevice
log1p = _log1p_numpy if os.environ.get("TRITON_INTERPRET") == "1" else _log1p_libdevice
