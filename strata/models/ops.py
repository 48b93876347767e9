"""The row-wise pieces of a decoder layer: Strata's C++ kernels on the CPU, torch elsewhere.

A decode step on the CPU is dominated by dispatching small torch operations
(RMSNorm alone is about ten); the kernels in `kv/csrc/elementwise.cpp` do
each piece in one call. The torch versions here are the reference and the
path on other devices (and on the CPU when the kernels are not built or
STRATA_CPU_KERNEL=0). Both compute every row by itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from strata.kv.cpu_kernel import cpu_kernel


def _kernel(x: torch.Tensor) -> Any | None:
    return cpu_kernel() if x.device.type == "cpu" else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalise(x): normalised in float32, rounded to x's dtype, then scaled (HF's order)."""
    k = _kernel(x)
    if k is not None and x.is_contiguous():
        return k.rms_norm(x, weight, eps)
    return weight * F.rms_norm(x, weight.shape, eps=eps)


def add_rms_norm(h: torch.Tensor, a: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum h + a and its norm (the next sublayer's input)."""
    k = _kernel(h)
    if k is not None and h.is_contiguous() and a.is_contiguous():
        return k.add_rms_norm(h, a, weight, eps)
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
    x = qkv.view(qkv.shape[0], -1, head_dim)
    qk = x[:, : hq + hkv]
    qk = qk * cos + torch.roll(qk, head_dim // 2, dims=-1) * sin
    return qk[:, :hq].contiguous(), qk[:, hq:].contiguous(), x[:, hq + hkv :].contiguous()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate the first half of the last dimension."""
    k = _kernel(gate_up)
    if k is not None and gate_up.is_contiguous():
        return k.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
