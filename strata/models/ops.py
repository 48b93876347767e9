"""The row-wise pieces of a decoder layer: C++ kernels on the CPU, Triton on CUDA, torch elsewhere.

A decode step on the CPU is dominated by dispatching small torch operations
(RMSNorm alone is about ten); the kernels in `kernels/cpu/csrc/elementwise.cpp` do
each piece in one call. The torch versions here are the reference and the
path on other devices (and on the CPU when the kernels are not built or
STRATA_CPU_KERNEL=0). CUDA tensors go to the Triton kernels of
`strata/kernels/triton/fused.py`, one launch each, with the same rounding (without
Triton, or with STRATA_GPU_FUSED=0, to torch). All compute every row by itself.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

import torch
import torch.nn.functional as F

from strata.kernels.cpu.loader import cpu_kernel


def _kernel(x: torch.Tensor) -> Any | None:
    return cpu_kernel() if x.device.type == "cpu" else None


@functools.cache
def _gpu_module(name: str, switch: str) -> Any | None:
    """`strata.gpu.<name>` (imports Triton), or None without Triton or with <switch>=0."""
    if os.environ.get(switch, "1") == "0":
        return None
    try:
        return importlib.import_module(f"strata.gpu.{name}")
    except ImportError:
        return None


def _fused_kernels() -> Any | None:
    """The row-wise kernels (`kernels/triton/fused.py`); STRATA_GPU_FUSED=0 keeps the torch expressions."""
    return _gpu_module("fused", "STRATA_GPU_FUSED")


def _gemv_kernels() -> Any | None:
    """The one-row products (`kernels/triton/gemv.py`); STRATA_GPU_GEMV=0 keeps cuBLAS and separate ops."""
    return _gpu_module("gemv", "STRATA_GPU_GEMV")


def row_kernels(h: torch.Tensor, *linears: torch.nn.Module) -> Any | None:
    """`strata.kernels.triton.gemv` when h is one CUDA row that its kernels take against every linear's
    weight (plain weights, not quantized modules), else None.

    A one-lane decode step on the GPU then runs each sublayer as matrix-vector
    products that carry the norms, SwiGLU and residual adds (`DecoderLayer`).
    """
    if not h.is_cuda or h.shape[0] != 1:
        return None
    g = _gemv_kernels()
    if g is None:
        return None
    for m in linears:
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor) or not g.takes_weight(h, w):
            return None
    return g


def _fused(x: torch.Tensor) -> Any | None:
    """The Triton kernels for CUDA tensors (Triton is imported on the first one)."""
    return _fused_kernels() if x.is_cuda else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalise(x): normalised in float32, rounded to x's dtype, then scaled (HF's order)."""
    k = _kernel(x)
    if k is not None and x.is_contiguous():
        return k.rms_norm(x, weight, eps)
    g = _fused(x)
    if g is not None and g.takes(x, weight):
        return g.rms_norm(x, weight, eps)
    return weight * F.rms_norm(x, weight.shape, eps=eps)


def add_rms_norm(h: torch.Tensor, a: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum h + a and its norm (the next sublayer's input)."""
    k = _kernel(h)
    if k is not None and h.is_contiguous() and a.is_contiguous():
        return k.add_rms_norm(h, a, weight, eps)
    g = _fused(h)
    if g is not None and g.takes(h, a, weight):
        return g.add_rms_norm(h, a, weight, eps)
    s = h + a
    return s, rms_norm(s, weight, eps)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous q, k (rotated) and v [T, heads, D] out of the fused projection [T, width].

    cos, sin: [T, 1, D] rows of `rope_tables`.
    """
    k = _kernel(qkv)
    if k is not None and qkv.is_contiguous():
        return k.rope_qkv(qkv, cos, sin, hq, hkv)
    g = _fused(qkv)
    if g is not None and g.takes(qkv, cos, sin):
        return g.rope_qkv(qkv, cos, sin, hq, hkv, head_dim)
    x = qkv.view(qkv.shape[0], -1, head_dim)
    qk = x[:, : hq + hkv]
    qk = qk * cos + torch.roll(qk, head_dim // 2, dims=-1) * sin
    return qk[:, :hq].contiguous(), qk[:, hq:].contiguous(), x[:, hq + hkv :].contiguous()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate the first half of the last dimension."""
    k = _kernel(gate_up)
    if k is not None and gate_up.is_contiguous():
        return k.silu_mul(gate_up)
    g = _fused(gate_up)
    if g is not None and g.takes(gate_up):
        return g.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
