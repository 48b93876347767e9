"""The row-wise pieces of a decoder layer as Triton kernels, for CUDA tensors (`models/ops.py`).

In a CUDA-graph decode step of the 8B shape the GPU spent about 0.6 ms in
small torch kernels: RMSNorm (several kernels a norm), the residual add,
RoPE's roll, multiplies and add, SiLU times up, and the copies that make q,
k and v contiguous. Each function here is one launch.

The arithmetic is that of the torch expressions in `ops.py` (and of the CPU
kernels in `kernels/cpu/csrc/elementwise.cpp`): every intermediate torch rounds to
the compute dtype is rounded here too, products and sums are separate
float32 operations (launched with `enable_fp_fusion=False`, so no fused
multiply-adds), divisions and square roots are IEEE (`div_rn`, `sqrt_rn`).
RoPE, the residual sum and the copies are therefore bit-identical to torch;
the norm's float32 statistics (a tree sum, then `1 / sqrt(mean + eps)`) and
SiLU's `exp` (libdevice's `expf`, as CUDA's) may differ from torch's in the
last float32 bit, which the rounding to bf16 or fp16 almost always hides.

Each program works on one row (or a tile of one row) with tile sizes and
warp counts chosen from the row length only, so a row's result never
depends on how many rows there are. Nothing here synchronizes with the
host: the functions allocate their outputs with torch and launch, which is
what CUDA-graph capture (`engine/graphs.py`) needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.triton.numerics import exp, log1p

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NORM_BLOCK = 8192  # the longest row a norm holds in registers; longer ones go in tiles of this
SILU_BLOCK = 1024  # elements of one SiLU program
ROPE_TILE = 1024  # elements (heads x padded head_dim) of one RoPE program




def takes(*tensors: torch.Tensor) -> bool:
    """Contiguous tensors of one dtype that the kernels compute in (bf16, fp16, fp32)."""
    dt = tensors[0].dtype
    return dt in DTYPES and all(t.dtype == dt and t.is_contiguous() for t in tensors)


@triton.jit
def _residual(x, a, s_out, offs, mask, ADD: tl.constexpr, STORE: tl.constexpr):
    """A tile of the norm's input as float32: x, or x + a rounded to the dtype (stored if STORE)."""
    v = tl.load(x + offs, mask=mask, other=0.0)
    if ADD:
        v = (v.to(tl.float32) + tl.load(a + offs, mask=mask, other=0.0).to(tl.float32)).to(v.dtype)
        if STORE:
            tl.store(s_out + offs, v, mask=mask)
    return v.to(tl.float32)


@triton.jit
def _scaled(v, inv, w, out, offs, cols, mask, ZERO: tl.constexpr):
    """weight * round(v * inv), stored; ZERO (zero-centred norms): (1 + weight) * (v * inv) in
    float32, rounded once (Qwen3-Next's order)."""
    dt = out.dtype.element_ty
    wv = tl.load(w + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO:
        y = (v * inv) * (1.0 + wv)
    else:
        y = wv * (v * inv).to(dt).to(tl.float32)
    tl.store(out + offs, y.to(dt), mask=mask)


@triton.jit
def _rms_kernel(x, a, s_out, w, out, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                TILES: tl.constexpr, ADD: tl.constexpr, ZERO: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    if TILES == 1:
        mask = cols < N
        v = _residual(x + row, a + row, s_out + row, cols, mask, ADD, True)
        ss = tl.sum(v * v, 0)
    else:
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(TILES):
            c = i * BLOCK + cols
            v = _residual(x + row, a + row, s_out + row, c, c < N, ADD, True)
            acc += v * v
        ss = tl.sum(acc, 0)
    mean = tl.math.div_rn(ss, tl.full([], N, tl.float32))
    inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(mean + eps))
    if TILES == 1:
        _scaled(v, inv, w, out + row, cols, cols, cols < N, ZERO)
    else:
        for i in range(TILES):  # read again (the sum recomputed: the same bits it stored)
            c = i * BLOCK + cols
            v = _residual(x + row, a + row, s_out + row, c, c < N, ADD, False)
            _scaled(v, inv, w, out + row, c, c, c < N, ZERO)


def _norm(x: torch.Tensor, a: torch.Tensor | None, weight: torch.Tensor,
          eps: float, zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n = weight.numel()
    if x.shape[-1] != n:
        raise ValueError(f"rows of {x.shape[-1]} against a weight of {n}")
    out = torch.empty_like(x)
    s = torch.empty_like(x) if a is not None else out
    rows = x.numel() // n if n else 0
    if rows:
        block = min(triton.next_power_of_2(n), NORM_BLOCK)
        _rms_kernel[(rows,)](
            x, a if a is not None else x, s, weight, out, eps, N=n, BLOCK=block,
            TILES=triton.cdiv(n, block), ADD=a is not None, ZERO=zero_centred,
            num_warps=4 if block <= 2048 else 8,
            enable_fp_fusion=False,
        )
    return s, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """weight * round(x * rsqrt(mean(x^2) + eps)) over the last dimension, statistics in float32;
    zero_centred: round((1 + weight) * x * rsqrt(...)), everything before the rounding in float32."""
    return _norm(x, None, weight, eps, zero_centred)[1]


def add_rms_norm(h: torch.Tensor, a: torch.Tensor, weight: torch.Tensor,
                 eps: float, zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + a rounded to the dtype, its rms_norm) in one launch."""
    if h.shape != a.shape:
        raise ValueError(f"h {tuple(h.shape)} and a {tuple(a.shape)} differ")
    return _norm(h, a, weight, eps, zero_centred)


@triton.jit
def _gated_rms_kernel(x, z, w, out, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    xv = tl.load(x + row + cols, mask=mask, other=0.0)
    dt = xv.dtype
    v = xv.to(tl.float32)
    mean = tl.math.div_rn(tl.sum(v * v, 0), tl.full([], N, tl.float32))
    inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(mean + eps))
    n = (v * inv).to(dt).to(tl.float32)  # the normalised row, rounded
    p = (tl.load(w + cols, mask=mask, other=0.0).to(tl.float32) * n).to(dt).to(tl.float32)
    zv = tl.load(z + row + cols, mask=mask, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(zv, 1.0 + exp(-zv))  # float32, not rounded
    tl.store(out + row + cols, (p * silu).to(dt), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """round(round(weight * round(rms_norm(x))) * silu(z)) over the last dimension (the DeltaNet's
    output gate, `deltanet.GatedRMSNorm`), silu(z) in float32; one launch."""
    n = weight.numel()
    if x.shape != z.shape or x.shape[-1] != n or n > NORM_BLOCK:
        raise ValueError(f"x {tuple(x.shape)}, z {tuple(z.shape)} against a weight of {n}")
    out = torch.empty_like(x)
    rows = x.numel() // n if n else 0
    if rows:
        block = triton.next_power_of_2(n)
        _gated_rms_kernel[(rows,)](x, z, weight, out, eps, N=n, BLOCK=block,
                                   num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False)
    return out


@triton.jit
def _gates_kernel(b, a, a_log, dt_bias, beta, g, total, HEADS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    head = i % HEADS
    bv = tl.load(b + i, mask=mask, other=0.0)
    dt = bv.dtype
    tl.store(beta + i, tl.math.div_rn(1.0, 1.0 + exp(-bv.to(tl.float32))).to(dt), mask=mask)
    x = tl.load(a + i, mask=mask, other=0.0).to(tl.float32) + tl.load(dt_bias + head, mask=mask).to(tl.float32)
    softplus = tl.where(x > 20.0, x, log1p(exp(x)))  # torch's threshold of 20
    decay = exp(tl.load(a_log + head, mask=mask).to(tl.float32))
    tl.store(g + i, -decay * softplus, mask=mask)


def deltanet_gates(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeltaNet's beta = sigmoid(b) (b's dtype) and log decay g = -exp(A_log) * softplus(a +
    dt_bias) (float32) for b, a [T, H]; one launch instead of about eight."""
    if b.shape != a.shape or b.dim() != 2 or a_log.numel() != b.shape[1] or dt_bias.numel() != b.shape[1]:
        raise ValueError(f"b {tuple(b.shape)}, a {tuple(a.shape)} against {a_log.numel()} heads")
    beta = torch.empty_like(b)
    g = torch.empty(b.shape, dtype=torch.float32, device=b.device)
    total = b.numel()
    if total:
        block = 1024
        _gates_kernel[(triton.cdiv(total, block),)](b, a, a_log, dt_bias, beta, g, total, HEADS=b.shape[1],
                                                    BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return beta, g


@triton.jit
def _rope_kernel(qkv, cos, sin, q, k, v, cs_t, HQ: tl.constexpr, HKV: tl.constexpr,
                 D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    half: tl.constexpr = D // 2
    dmask = d < D
    mask = (heads < HQ + 2 * HKV)[:, None] & dmask[None, :]
    src = qkv + t * ((HQ + 2 * HKV) * D) + heads[:, None] * D
    x = tl.load(src + d[None, :], mask=mask, other=0.0)
    dt = x.dtype
    rolled = tl.load(src + tl.where(d < half, d + half, d - half)[None, :], mask=mask, other=0.0)
    c = tl.load(cos + t * cs_t + d, mask=dmask, other=0.0).to(tl.float32)
    s = tl.load(sin + t * cs_t + d, mask=dmask, other=0.0).to(tl.float32)
    t1 = (x.to(tl.float32) * c[None, :]).to(dt).to(tl.float32)  # x * cos, rounded
    t2 = (rolled.to(tl.float32) * s[None, :]).to(dt).to(tl.float32)  # roll(x) * sin, rounded
    y = tl.where((heads < HQ + HKV)[:, None], (t1 + t2).to(dt), x)  # v heads: copied
    dst = tl.where(heads < HQ, q + (t * HQ + heads) * D,
                   tl.where(heads < HQ + HKV, k + (t * HKV + heads - HQ) * D,
                            v + (t * HKV + heads - HQ - HKV) * D))
    tl.store(dst[:, None] + d[None, :], y, mask=mask)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous q, k (rotated) and v [T, heads, D] of the fused projection [T, (hq + 2 hkv) D].

    cos, sin: [T, 1, D] rows of `rope_tables` (or one row [1, 1, D] for every token).
    """
    t = qkv.shape[0]
    d = head_dim
    heads = hq + 2 * hkv
    if qkv.dim() != 2 or qkv.shape[1] != heads * d or d % 2:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [T, {heads} x {d}] with an even head_dim")
    if cos.numel() not in (t * d, d) or sin.numel() != cos.numel():
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} are not [{t}, 1, {d}]")
    q = qkv.new_empty(t, hq, d)
    k = qkv.new_empty(t, hkv, d)
    v = qkv.new_empty(t, hkv, d)
    if t:
        block_d = triton.next_power_of_2(d)
        block_h = min(triton.next_power_of_2(heads), max(ROPE_TILE // block_d, 1))
        _rope_kernel[(t, triton.cdiv(heads, block_h))](
            qkv, cos, sin, q, k, v, d if cos.numel() == t * d else 0, HQ=hq, HKV=hkv, D=d,
            BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4, enable_fp_fusion=False,
        )
    return q, k, v


@triton.jit
def _silu_mul_kernel(gate_up, out, I: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = j < I
    src = gate_up + row * (2 * I)
    g = tl.load(src + j, mask=mask, other=0.0)
    dt = g.dtype
    g = g.to(tl.float32)
    up = tl.load(src + I + j, mask=mask, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + exp(-g)).to(dt).to(tl.float32)  # x / (1 + exp(-x)), rounded
    tl.store(out + row * I + j, (silu * up).to(dt), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """round(round(silu(gate)) * up) for gate_up [..., 2 I], gate the first half: [..., I]."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension {gate_up.shape[-1]} is odd")
    i = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], i)
    rows = gate_up.numel() // (2 * i) if i else 0
    if rows:
        block = min(triton.next_power_of_2(i), SILU_BLOCK)
        _silu_mul_kernel[(rows, triton.cdiv(i, block))](
            gate_up, out, I=i, BLOCK=block, num_warps=4, enable_fp_fusion=False,
        )
    return out
