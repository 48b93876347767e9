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
from types import ModuleType

import torch
import torch.nn.functional as F

from strata.kernels.cpu.loader import cpu_kernel
from strata.knobs import flag

try:  # the CPU machines and CI have no Triton: CUDA tensors then take the torch expressions
    from strata.kernels.triton import fused, gemv, matmul
except ImportError:
    fused = gemv = matmul = None  # type: ignore[assignment]


@functools.cache
def _switched_on(name: str) -> bool:
    """A knob read once: the ops below run several times a layer and step."""
    return flag(name)


def cpu_kernels(x: torch.Tensor) -> ModuleType | None:
    """The C++ kernels for a CPU tensor (None: another device, not built, STRATA_CPU_KERNEL=0)."""
    return cpu_kernel() if x.device.type == "cpu" else None


def fused_kernels(x: torch.Tensor) -> ModuleType | None:
    """The Triton row-wise kernels (`kernels/triton/fused.py`) for a CUDA tensor (None: another
    device, no Triton, STRATA_GPU_FUSED=0 keeps the torch expressions)."""
    if fused is None or not x.is_cuda or not _switched_on("STRATA_GPU_FUSED"):
        return None
    return fused


def gemv_kernels() -> ModuleType | None:
    """The one-row products (`kernels/triton/gemv.py`) (None: no Triton, STRATA_GPU_GEMV=0 keeps
    cuBLAS and separate ops)."""
    if gemv is None or not _switched_on("STRATA_GPU_GEMV"):
        return None
    return gemv


def row_kernels(h: torch.Tensor, *linears: torch.nn.Module) -> ModuleType | None:
    """`strata.kernels.triton.gemv` when h is one CUDA row that its kernels take against every
    linear's weight (plain weights, not quantized modules, not ones set to the batch-invariant
    product: the one-row kernels sum in another order), else None.

    A one-lane decode step on the GPU then runs each sublayer as matrix-vector
    products that carry the norms, SwiGLU and residual adds (`DecoderLayer`).
    """
    if not h.is_cuda or h.shape[0] != 1:
        return None
    g = gemv_kernels()
    if g is None:
        return None
    for m in linears:
        w = getattr(m, "weight", None)
        if getattr(m, "invariant", False) or not isinstance(w, torch.Tensor) or not g.takes_weight(h, w):
            return None
    return g


def invariant_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """x @ weight.T (+ bias) by `kernels/triton/matmul.py`, whose rows have the same bits at any
    number of rows (None: not a CUDA tensor it takes; the caller falls back)."""
    if matmul is None or x.dim() != 2 or not x.is_cuda or not matmul.takes(x, weight):
        return None
    return matmul.matmul(x, weight, bias, out_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalise(x): normalised in float32, rounded to x's dtype, then scaled (HF's order)."""
    k = cpu_kernels(x)
    if k is not None and x.is_contiguous():
        return k.rms_norm(x, weight, eps)
    g = fused_kernels(x)
    if g is not None and g.takes(x, weight):
        return g.rms_norm(x, weight, eps)
    return weight * F.rms_norm(x, weight.shape, eps=eps)


def add_rms_norm(h: torch.Tensor, a: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum h + a and its norm (the next sublayer's input)."""
    k = cpu_kernels(h)
    if k is not None and h.is_contiguous() and a.is_contiguous():
        return k.add_rms_norm(h, a, weight, eps)
    g = fused_kernels(h)
    if g is not None and g.takes(h, a, weight):
        return g.add_rms_norm(h, a, weight, eps)
    s = h + a
    return s, rms_norm(s, weight, eps)


def zero_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(1 + weight) * normalise(x), in float32 and rounded once (Qwen3-Next's zero-centred norm)."""
    g = fused_kernels(x)
    if g is not None and g.takes(x, weight):
        return g.rms_norm(x, weight, eps, zero_centred=True)
    normed = F.rms_norm(x.float(), x.shape[-1:], eps=eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def add_zero_rms_norm(h: torch.Tensor, a: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum h + a and its zero-centred norm."""
    g = fused_kernels(h)
    if g is not None and g.takes(h, a, weight):
        return g.add_rms_norm(h, a, weight, eps, zero_centred=True)
    s = h + a
    return s, zero_rms_norm(s, weight, eps)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalise(x) (rounded, then rounded again) times silu(z) taken in float32: the
    gated DeltaNet's output norm, in Hugging Face's order."""
    g = fused_kernels(x)
    if g is not None and g.takes(x, z, weight) and weight.numel() <= g.NORM_BLOCK:
        return g.gated_rms_norm(x, z, weight, eps)
    normed = F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)
    return (weight * normed * F.silu(z.float())).to(x.dtype)


def deltanet_gates(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """beta = sigmoid(b) and the log decay g = -exp(A_log) * softplus(a + dt_bias) in float32."""
    g = fused_kernels(b)
    if g is not None and g.takes(b, a) and a_log.is_contiguous() and dt_bias.is_contiguous() and b.dim() == 2:
        return g.deltanet_gates(b, a, a_log, dt_bias)
    return b.sigmoid(), -a_log.float().exp() * F.softplus(a.float() + dt_bias)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous q, k (rotated) and v [T, heads, D] out of the fused projection [T, width].

    cos, sin: [T, 1, D] rows of `rope_tables`.
    """
    k = cpu_kernels(qkv)
    if k is not None and qkv.is_contiguous():
        return k.rope_qkv(qkv, cos, sin, hq, hkv)
    g = fused_kernels(qkv)
    if g is not None and g.takes(qkv, cos, sin):
        return g.rope_qkv(qkv, cos, sin, hq, hkv, head_dim)
    x = qkv.view(qkv.shape[0], -1, head_dim)
    qk = x[:, : hq + hkv]
    qk = qk * cos + torch.roll(qk, head_dim // 2, dims=-1) * sin
    return qk[:, :hq].contiguous(), qk[:, hq:].contiguous(), x[:, hq + hkv :].contiguous()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate the first half of the last dimension."""
    k = cpu_kernels(gate_up)
    if k is not None and gate_up.is_contiguous():
        return k.silu_mul(gate_up)
    g = fused_kernels(gate_up)
    if g is not None and g.takes(gate_up):
        return g.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
