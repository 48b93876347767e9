"""One-row matrix-vector products for a one-lane decode step, with the small ops folded in.

A one-lane decode step of an 8B model reads 15 GB of weights for one token,
so it is a sequence of matrix-vector products plus a few row-wise kernels
between them, each of which costs a launch and a gap in the stream. Here
each product carries its neighbours:

- `norm`: the RMSNorm of the input row is computed by every program from the
  raw residual row (8 KB, from L2), so the norm kernel before QKV and before
  gate/up disappears;
- `silu`: gate and up rows of the same index are read by the same program,
  which writes silu(gate) * up, so the SwiGLU kernel disappears;
- `residual`: the residual row is added in the epilogue (o_proj, down_proj),
  so the residual-add kernels disappear;
- `rope`: rows d and d + D/2 of a q/k/v head are read by the same program,
  which rotates them (RoPE), so the RoPE kernel disappears;
- `bias`: q/k/v biases (Qwen2).

The rounding is that of the unfused ops (`models/ops.py`, `kernels/triton/fused.py`):
the normalised row is rounded to the dtype before and after the weight, the
product is rounded before the residual add, silu(gate) is rounded before
the multiply with up. The dot products accumulate in float32 in a fixed
order per row: a program owns whole rows (no split-K, no atomics), so a
graph replay equals the eager run bit for bit. The dot products may use
fused multiply-adds (nothing else here has a product next to a sum).

Each program reads BLOCK_N weight rows in tiles of BLOCK_K columns; the tile
shape per matrix shape comes from `CONFIGS` (measured on the H200 with
`python -m benchmarks.gemv_sweep`, which passes each candidate as `config=`)
or a rule for other shapes.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from strata.kernels.triton.numerics import exp
from strata.knobs import flag

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
try:  # programmatic dependent launch (Hopper and later; Triton 3.6)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the installed Triton
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _allow_dependents():
    gdc_launch_dependents()


@triton.jit
def _wait_for_inputs():
    gdc_wait()

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NORM_MAX = 16384  # the longest input row a program normalises in one tile
MIN_BLOCK_K = 16  # rows must be a multiple of this (every model here: 576, 960, 4096 ...)
Config = tuple[int, int, int, int]  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
# (N, K) -> Config for the Llama-3.1-8B shapes, the fastest of `python -m benchmarks.gemv_sweep`
# on an H200 (docs/GPU.md); N counts gate rows only for gate/up. Other shapes take the rule in
# `default_config`.
CONFIGS: dict[tuple[int, int], Config] = {
    (6144, 4096): (4, 1024, 4, 1),  # q/k/v (with RoPE: 2 rows and their 2 partners)
    (4096, 4096): (2, 1024, 4, 1),  # o_proj
    (14336, 4096): (2, 1024, 4, 1),  # gate/up
    (4096, 14336): (2, 1024, 4, 1),  # down_proj
    (49152, 4096): (1, 1024, 4, 1),  # output head (SmolLM2's vocabulary)
    (128256, 4096): (1, 1024, 4, 1),  # output head (Llama 3's vocabulary)
}


def default_config(n: int, k: int) -> Config:
    """The launch shape for n output rows over k columns."""
    if (n, k) in CONFIGS:
        return CONFIGS[(n, k)]
    bk = 1024  # the widest tile (up to 1,024 columns) that divides the row, 2,048 weights a tile
    while bk > MIN_BLOCK_K and k % bk:
        bk //= 2
    return max(1, 2048 // bk), bk, 4, 1


@triton.jit
def _input_tile(x, nw, inv, c, dt: tl.constexpr, NORM: tl.constexpr):
    """Columns c of the input row in float32: x, or weight * round(x * inv) rounded (RMSNorm)."""
    xv = tl.load(x + c).to(tl.float32)
    if NORM:
        xn = (xv * inv).to(dt).to(tl.float32)
        xv = (tl.load(nw + c).to(tl.float32) * xn).to(dt).to(tl.float32)
    return xv


@triton.jit
def _gemv_kernel(
    x, w, out, res, bias, nw, cos, sin, eps, N, K: tl.constexpr, PAIR_OFF,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, NORM_BLOCK: tl.constexpr,
    SILU: tl.constexpr, ROPE: tl.constexpr, HEAD_D: tl.constexpr, ROT_HEADS,
    RESIDUAL: tl.constexpr, BIAS: tl.constexpr, PDL: tl.constexpr,
):
    """SILU: rows r (gate) and r + N (up) in one program. ROPE: rows d and d + HEAD_D / 2 of a
    head in one program (PAIR_OFF is the second row set's offset in weights)."""
    pid = tl.program_id(0)
    if ROPE:  # BLOCK_N rows of the first half of a head, and their partners
        half: tl.constexpr = HEAD_D // 2
        per_head: tl.constexpr = half // BLOCK_N
        head = pid // per_head
        rows = head * HEAD_D + (pid % per_head) * BLOCK_N + tl.arange(0, BLOCK_N)
    else:
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    PAIR: tl.constexpr = SILU or ROPE
    row_ok = rows < N
    rows_c = tl.where(row_ok, rows, 0).to(tl.int64)  # in-bounds reads for the tail rows
    cols = tl.arange(0, BLOCK_K)
    dt = x.dtype.element_ty
    w_rows = w + rows_c[:, None] * K
    # The first weight tile is asked for before anything that depends on the previous
    # kernel: with PDL this program may start while that kernel is still finishing.
    if PDL:
        _allow_dependents()
    w0 = tl.load(w_rows + cols[None, :])
    if PAIR:
        u0 = tl.load(w_rows + PAIR_OFF + cols[None, :])
    if PDL:
        _wait_for_inputs()  # x, the residual and `out` belong to the kernels before
    if NORM:  # 1 / rms of the input row, as fused._rms_kernel computes it
        nc = tl.arange(0, NORM_BLOCK)
        v = tl.load(x + nc, mask=nc < K, other=0.0).to(tl.float32)
        mean = tl.math.div_rn(tl.sum(v * v, 0), tl.full([], K, tl.float32))
        inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(mean + eps))
    xv = _input_tile(x, nw, inv if NORM else eps, cols, dt, NORM)
    acc = w0.to(tl.float32) * xv[None, :]
    if PAIR:
        acc2 = u0.to(tl.float32) * xv[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        c = k0 + cols
        xv = _input_tile(x, nw, inv if NORM else eps, c, dt, NORM)
        acc += tl.load(w_rows + c[None, :]).to(tl.float32) * xv[None, :]
        if PAIR:
            acc2 += tl.load(w_rows + PAIR_OFF + c[None, :]).to(tl.float32) * xv[None, :]
    y = tl.sum(acc, 1)
    if BIAS:
        y += tl.load(bias + rows_c).to(tl.float32)
    y = y.to(dt).to(tl.float32)
    if PAIR:
        y2 = tl.sum(acc2, 1)
        if BIAS and ROPE:
            y2 += tl.load(bias + rows_c + half).to(tl.float32)
        y2 = y2.to(dt).to(tl.float32)
    if SILU:
        y = tl.math.div_rn(y, 1.0 + exp(-y)).to(dt).to(tl.float32) * y2
    if ROPE:  # q and k heads: x * cos + roll(x, D/2) * sin, each product rounded (fused.rope_qkv)
        d = rows_c % HEAD_D
        lo_c = tl.load(cos + d).to(tl.float32)
        lo_s = tl.load(sin + d).to(tl.float32)
        hi_c = tl.load(cos + d + half).to(tl.float32)
        hi_s = tl.load(sin + d + half).to(tl.float32)
        rot = head < ROT_HEADS
        lo = (y * lo_c).to(dt).to(tl.float32) + (y2 * lo_s).to(dt).to(tl.float32)
        hi = (y2 * hi_c).to(dt).to(tl.float32) + (y * hi_s).to(dt).to(tl.float32)
        y = tl.where(rot, lo, y)
        tl.store(out + rows + half, tl.where(rot, hi, y2).to(out.dtype.element_ty), mask=row_ok)
    if RESIDUAL:
        y = tl.load(res + rows_c).to(tl.float32) + y
    tl.store(out + rows, y.to(out.dtype.element_ty), mask=row_ok)


@functools.cache
def pdl_on(index: int) -> bool:
    """PDL for launches on CUDA device `index`: Hopper or later, Triton's intrinsics present,
    not switched off with STRATA_GPU_PDL=0 (read once)."""
    if INTERPRET or gdc_wait is None or not flag("STRATA_GPU_PDL"):
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One contiguous row against a contiguous [N, K] weight of its dtype (bf16, fp16, fp32)."""
    return (
        x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and weight.shape[1] == x.shape[1]
        and takes_weight(x, weight)
    )


def takes_weight(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A contiguous [N, K] weight of x's dtype with K a multiple of MIN_BLOCK_K (x may be
    another layer's input: only the dtype is compared)."""
    return (
        x.dtype in DTYPES and weight.dtype == x.dtype and weight.dim() == 2
        and weight.is_contiguous() and weight.shape[1] % MIN_BLOCK_K == 0
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    silu: bool = False,
    rope: tuple[torch.Tensor, torch.Tensor, int, int] | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """[1, K] x weight[N, K]^T -> [1, N] (silu: [1, N/2]) with the folded ops named.

    norm_weight: the input row is `rms_norm(x, norm_weight, eps)` first.
    silu: weight holds gate rows then up rows; the result is silu(gate) * up.
    rope: (cos, sin, rotated heads, head_dim) for a fused q/k/v projection: the first
        `rotated heads` heads of head_dim rows are rotated by the position's cos and sin
        rows ([head_dim] each, `rope_tables`), the rest (v) are left as they are.
    residual: [1, N] added to the rounded product.
    out_dtype: store the (rounded) result in another dtype (float32 logits).
    config: the launch shape instead of `default_config(N, K)`'s (the sweep's candidates).
    """
    if not takes(x, weight):
        raise ValueError(f"gemv takes one contiguous row against [N, K] of its dtype: "
                         f"x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    if silu:
        if n % 2:
            raise ValueError(f"gate/up weight has an odd number of rows ({n})")
        n //= 2
    if norm_weight is not None and (norm_weight.numel() != k or k > NORM_MAX):
        raise ValueError(f"norm weight of {norm_weight.numel()} for rows of {k} (at most {NORM_MAX})")
    if residual is not None and (residual.numel() != n or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} for {n} outputs")
    out = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    bn, bk, warps, stages = config if config is not None else default_config(n, k)
    if k % bk:
        raise ValueError(f"BLOCK_K {bk} does not divide rows of {k}")
    cos = sin = x
    rot_heads = head_d = 0
    pair_off = n * k if silu else 0
    programs = triton.cdiv(n, bn)
    if rope is not None:
        cos, sin, rot_heads, head_d = rope
        if silu or residual is not None or head_d % 2 or n % head_d or cos.numel() != head_d \
                or sin.numel() != head_d or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError(f"rope needs rows of whole heads of {head_d} and cos, sin of "
                             f"{head_d} (got {cos.numel()}, {sin.numel()}), without silu or residual")
        bn = max(1, bn // 2)  # a program reads bn rows and their bn partners
        while (head_d // 2) % bn:
            bn //= 2
        pair_off = head_d // 2 * k
        programs = n // (2 * bn)
    pdl = x.is_cuda and pdl_on(x.device.index if x.device.index is not None else 0)
    _gemv_kernel[(programs,)](
        x, weight, out, residual if residual is not None else x,
        bias if bias is not None else x, norm_weight if norm_weight is not None else x,
        cos, sin, eps, n, K=k, PAIR_OFF=pair_off, BLOCK_N=bn, BLOCK_K=bk,
        NORM=norm_weight is not None, NORM_BLOCK=triton.next_power_of_2(k), SILU=silu,
        ROPE=rope is not None, HEAD_D=head_d, ROT_HEADS=rot_heads, RESIDUAL=residual is not None,
        BIAS=bias is not None, PDL=pdl, num_warps=warps, num_stages=stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out
