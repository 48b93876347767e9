"""Products with GGUF-quantized weights read in their blocks, on the GPU.

Dense bf16 copies of a 4-bit file take 3.3 times its bytes, and a decode step
reads every weight once, so the kernels here read the blocks (`blocks_decode.py`
says how, in the file's layout or `pack`ed into planes) and decode them in
registers:

- `block_gemv`: one row (a one-lane decode step), with gemv.py's folds
  (RMSNorm of the input, SwiGLU of gate and up rows, the residual add, float32
  logits) and its rounding points; a program owns whole rows and sums them in
  a fixed order (no split-K), so a graph replay equals the eager run;
- `block_mm`: M >= 2 rows (batched decode, prompts) through `tl.dot`, each
  weight rounded once from its float32 value to the input's dtype (fp32 inputs
  multiply in IEEE fp32), so the product is the dense path's with the weights
  dequantized to that dtype.

Callers that can, `pack` the blocks once at load and pass packed=True: the
same bytes, with the quants of a row in one aligned run (blocks_decode.py).
`takes(qtype)` says which types are read (`SUPPORTED`).

Launch shapes come from `GEMV_CONFIGS` / `MM_CONFIGS` (filled from
`python -m benchmarks.block_sweep` on an H200) or the rules below them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.triton import kquant_rows
from strata.kernels.triton.blocks_decode import (
    SUPPORTED,
    TYPES,
    column,
    decode,
    layout,
    pack,
    takes,
    unpack,
)
from strata.kernels.triton.gemv import (
    DTYPES,
    NORM_MAX,
    _allow_dependents,
    _input_tile,
    _wait_for_inputs,
    pdl_on,
)
from strata.kernels.triton.numerics import exp

__all__ = ["SUPPORTED", "block_gemv", "block_mm", "pack", "takes", "unpack"]

GemvConfig = tuple[int, int, int, int]  # (BLOCK_N rows, blocks per tile, num_warps, num_stages)
MmConfig = tuple[int, int, int, int, int]  # (BLOCK_M, BLOCK_N, blocks per tile, warps, stages)
# (N, K, qtype) -> GemvConfig; N counts gate rows only for gate/up
GEMV_CONFIGS: dict[tuple[int, int, int], GemvConfig] = {}
# (M bucket, N, K, qtype) -> MmConfig; buckets from `m_bucket`
MM_CONFIGS: dict[tuple[int, int, int, int], MmConfig] = {}


def default_gemv_config(n: int, k: int, qtype: int, silu: bool = False) -> GemvConfig:
    """4 warps whose runs of 8 values cover 1,024 values of each part of a row (G * E), 4 rows
    a program (2 gate and 2 up rows with silu, which holds both in registers): each thread
    then reuses its inputs for all the rows."""
    if (n, k, qtype) in GEMV_CONFIGS:
        return GEMV_CONFIGS[(n, k, qtype)]
    bt = TYPES[qtype]
    per = min(triton.next_power_of_2(k // bt.block), max(1, 1024 // (bt.groups * bt.group)))
    return 2 if silu else 4, per, 4, 1


def m_bucket(m: int) -> int:
    """16 (batched decode of up to 16 lanes), 64, or 512 (prompts)."""
    return 16 if m <= 16 else 64 if m <= 64 else 512


def default_mm_config(m: int, n: int, k: int, qtype: int) -> MmConfig:
    """Small M is memory-bound: narrow row tiles so every SM streams weights; large M takes
    square tiles that reuse each decoded weight over 128 rows."""
    bucket = m_bucket(m)
    if (bucket, n, k, qtype) in MM_CONFIGS:
        return MM_CONFIGS[(bucket, n, k, qtype)]
    bt = TYPES[qtype]  # 128 columns a part and step (a super-block of the K-quants)
    per = max(1, min(128 * bt.parts // bt.block, triton.next_power_of_2(k // bt.block)))
    if bucket == 16:
        return 16, 32 if n <= 8192 else 64, per, 4, 2
    if bucket == 64:
        return 64, 64, per, 4, 2
    return 128, 128, per, 8, 2


def _check(x: torch.Tensor, blocks: torch.Tensor, qtype: int, name: str, one_row: bool) -> int:
    """The number of blocks per row, or ValueError naming what does not fit."""
    if not takes(qtype):
        raise ValueError(f"{name}: no block kernel for qtype {qtype}")
    bt = TYPES[qtype]
    if x.dtype not in DTYPES or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"{name}: x must be a contiguous 2-D bf16, fp16 or fp32 tensor, got "
                         f"{tuple(x.shape)} {x.dtype}")
    if one_row != (x.shape[0] == 1) or x.shape[0] < 1:
        raise ValueError(f"{name}: takes {'one row' if one_row else 'two or more rows'}, "
                         f"got x of {x.shape[0]}")
    k = x.shape[1]
    if k % bt.block:
        raise ValueError(f"{name}: rows of {k} columns are not whole blocks of {bt.block}")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous() \
            or blocks.shape[1] != k // bt.block * bt.size or blocks.shape[0] < 1:
        raise ValueError(f"{name}: blocks must be contiguous uint8 [N, {k // bt.block * bt.size}] "
                         f"for rows of {k}, got {tuple(blocks.shape)} {blocks.dtype}")
    if blocks.device != x.device:
        raise ValueError(f"{name}: blocks on {blocks.device}, x on {x.device}")
    return k // bt.block


def _type_args(qtype: int, nb: int, packed: bool) -> dict:
    bt = TYPES[qtype]
    lay = layout(qtype, nb, packed)
    names = ("OQ", "SQ", "OH", "SH", "OSC", "SSC", "OD", "SD", "OM", "SM")
    return dict(QT=int(qtype), BLOCK=bt.block, GPB=bt.groups, E=bt.group, PARTS=bt.parts,
                NG=nb * bt.groups, RS=nb * bt.size, **dict(zip(names, lay)))


@triton.jit
def _inputs(x, nw, inv, g, e, NG: tl.constexpr, dt: tl.constexpr, NORM: tl.constexpr,
            QT: tl.constexpr, BLOCK: tl.constexpr, GPB: tl.constexpr, PARTS: tl.constexpr):
    """The input values at both parts' columns, float32. Groups past the row read the last
    group's (their weights are 0), which keeps the columns contiguous runs."""
    gc = tl.minimum(g, NG - 1)
    x0 = _input_tile(x, nw, inv, column(gc, e, 0, QT, BLOCK, GPB), dt, NORM)
    x1 = x0
    if PARTS == 2:
        x1 = _input_tile(x, nw, inv, column(gc, e, 1, QT, BLOCK, GPB), dt, NORM)
    return x0, x1


@triton.jit
def _gemv_kernel(
    x, b, h, out, res, nw, eps, N, K: tl.constexpr, RS: tl.constexpr, NG: tl.constexpr,
    QT: tl.constexpr, BLOCK: tl.constexpr, GPB: tl.constexpr, E: tl.constexpr, PARTS: tl.constexpr,
    OQ: tl.constexpr, SQ: tl.constexpr, OH: tl.constexpr, SH: tl.constexpr, OSC: tl.constexpr,
    SSC: tl.constexpr, OD: tl.constexpr, SD: tl.constexpr, OM: tl.constexpr, SM: tl.constexpr,
    BLOCK_N: tl.constexpr, G: tl.constexpr, NORM: tl.constexpr, NORM_BLOCK: tl.constexpr,
    SILU: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
):
    """SILU: rows r (gate) and r + N (up) in one program; G scale groups a step.

    Tiles are [rows, G, E / 8, 8]: the weight bytes and the (16-bit) inputs then load as
    runs of 8 in one layout, so the input tile is not moved between layouts, and once the
    G * E / 8 runs cover all threads each thread keeps its inputs for all its rows."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_c = tl.where(row_ok, rows, 0).to(tl.int64)
    rb = (rows_c * RS)[None, None, :, None]
    ub = ((rows_c + N) * RS)[None, None, :, None]
    g = tl.arange(0, G)[:, None, None, None]
    e = tl.arange(0, E // 8)[None, :, None, None] * 8 + tl.arange(0, 8)[None, None, None, :]
    dt = x.dtype.element_ty
    ok = g < NG
    # The first tile is read before anything the previous kernel writes (PDL, as gemv.py).
    if PDL:
        _allow_dependents()
    w0, w1 = decode(b, h, rb, g, e, ok, QT, GPB, E, OQ, SQ, OH, SH, OSC, SSC, OD, SD, OM, SM)
    if SILU:
        u0, u1 = decode(b, h, ub, g, e, ok, QT, GPB, E, OQ, SQ, OH, SH, OSC, SSC, OD, SD, OM,
                          SM)
    if PDL:
        _wait_for_inputs()
    if NORM:  # 1 / rms of the input row, as fused._rms_kernel computes it
        nc = tl.arange(0, NORM_BLOCK)
        v = tl.load(x + nc, mask=nc < K, other=0.0).to(tl.float32)
        mean = tl.math.div_rn(tl.sum(v * v, 0), tl.full([], K, tl.float32))
        inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(mean + eps))
    x0, x1 = _inputs(x, nw, inv if NORM else eps, g, e, NG, dt, NORM, QT, BLOCK, GPB, PARTS)
    acc = w0 * x0
    if PARTS == 2:
        acc += w1 * x1
    if SILU:
        acc2 = u0 * x0
        if PARTS == 2:
            acc2 += u1 * x1
    for g0 in range(G, NG, G):
        gt = g0 + g
        okt = gt < NG
        w0, w1 = decode(b, h, rb, gt, e, okt, QT, GPB, E, OQ, SQ, OH, SH, OSC, SSC, OD, SD, OM,
                          SM)
        x0, x1 = _inputs(x, nw, inv if NORM else eps, gt, e, NG, dt, NORM, QT, BLOCK, GPB, PARTS)
        acc += w0 * x0
        if PARTS == 2:
            acc += w1 * x1
        if SILU:
            u0, u1 = decode(b, h, ub, gt, e, okt, QT, GPB, E, OQ, SQ, OH, SH, OSC, SSC, OD, SD,
                              OM, SM)
            acc2 += u0 * x0
            if PARTS == 2:
                acc2 += u1 * x1
    y = tl.sum(tl.sum(tl.sum(acc, 3), 1), 0).to(dt).to(tl.float32)
    if SILU:
        y2 = tl.sum(tl.sum(tl.sum(acc2, 3), 1), 0).to(dt).to(tl.float32)
        y = tl.math.div_rn(y, 1.0 + exp(-y)).to(dt).to(tl.float32) * y2
    if RESIDUAL:
        y = tl.load(res + rows_c).to(tl.float32) + y
    tl.store(out + rows, y.to(out.dtype.element_ty), mask=row_ok)


@triton.jit
def _mm_kernel(
    x, b, h, out, M, N, K: tl.constexpr, RS: tl.constexpr, NG: tl.constexpr,
    QT: tl.constexpr, BLOCK: tl.constexpr, GPB: tl.constexpr, E: tl.constexpr, PARTS: tl.constexpr,
    OQ: tl.constexpr, SQ: tl.constexpr, OH: tl.constexpr, SH: tl.constexpr, OSC: tl.constexpr,
    SSC: tl.constexpr, OD: tl.constexpr, SD: tl.constexpr, OM: tl.constexpr, SM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, PRECISION: tl.constexpr,
):
    """Axis 0 walks the row tiles of x, so the programs that share a weight tile run together."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    xr = tl.where(rm < M, rm, 0).to(tl.int64)[:, None] * K
    rb = (tl.where(rn < N, rn, 0).to(tl.int64) * RS)[:, None, None]
    g = tl.arange(0, G)[None, :, None]
    e = tl.arange(0, E)[None, None, :]
    f = tl.arange(0, G * E)  # the flattened tile's columns: group f // E, element f % E
    gf = f // E
    ef = f % E
    dt = x.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g0 in range(0, NG, G):
        w0, w1 = decode(b, h, rb, g0 + g, e, g0 + g < NG, QT, GPB, E, OQ, SQ, OH, SH, OSC, SSC,
                          OD, SD, OM, SM)
        gc = tl.minimum(g0 + gf, NG - 1)  # as in _inputs
        xt = tl.load(x + xr + column(gc, ef, 0, QT, BLOCK, GPB)[None, :])
        wt = tl.reshape(w0, (BLOCK_N, G * E)).to(dt)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PRECISION)
        if PARTS == 2:
            xt = tl.load(x + xr + column(gc, ef, 1, QT, BLOCK, GPB)[None, :])
            wt = tl.reshape(w1, (BLOCK_N, G * E)).to(dt)
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PRECISION)
    y = acc.to(dt).to(out.dtype.element_ty)
    tl.store(out + rm[:, None].to(tl.int64) * N + rn[None, :], y,
             mask=(rm < M)[:, None] & (rn < N)[None, :])


def block_gemv(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    silu: bool = False,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    packed: bool = False,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """[1, K] x W[N, K]^T -> [1, N] (silu: [1, N/2]) for W in GGUF blocks, folds as gemv.gemv.

    blocks: uint8 [N, K / block * type size], row n the file's bytes of weight row n, or
        `pack(blocks, qtype)` of them with packed=True; qtype a gguf.GGMLQuantizationType
        value (`takes`). Each weight is ggml's float32 value, multiplied in float32.
    norm_weight: the input row is `rms_norm(x, norm_weight, eps)` first.
    silu: blocks hold gate rows then up rows; the result is silu(gate) * up.
    residual: [1, N] added to the rounded product.
    out_dtype: store the (rounded) result in another dtype (float32 logits).
    config: the launch shape instead of `default_gemv_config`'s (the sweep's candidates); without
        one, what `kquant_rows.takes` (bf16 rows of packed Q4_K) takes its group-sum kernel.
    """
    nb = _check(x, blocks, qtype, "block_gemv", one_row=True)
    n, k = blocks.shape[0], x.shape[1]
    if silu:
        if n % 2:
            raise ValueError(f"block_gemv: gate/up blocks have an odd number of rows ({n})")
        n //= 2
    if norm_weight is not None and (norm_weight.numel() != k or k > NORM_MAX):
        raise ValueError(f"block_gemv: norm weight of {norm_weight.numel()} for rows of {k} "
                         f"(at most {NORM_MAX})")
    if residual is not None and (residual.numel() != n or residual.dtype != x.dtype
                                 or not residual.is_contiguous()):
        raise ValueError(f"block_gemv: residual {tuple(residual.shape)} {residual.dtype} "
                         f"for {n} outputs of {x.dtype}")
    out = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    if config is None and kquant_rows.takes(x, qtype, packed):
        try:
            return kquant_rows.kq_gemv(x, blocks, qtype, norm_weight=norm_weight, eps=eps, silu=silu,
                                       residual=residual, out=out)
        except triton.CompilationError as e:  # another Triton's Gluon: this kernel instead
            kquant_rows.fall_back(qtype, e)
    bn, per, warps, stages = config or default_gemv_config(n, k, qtype, silu)
    pdl = x.is_cuda and pdl_on(x.device.index if x.device.index is not None else 0)
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x, blocks, blocks.view(torch.float16), out, residual if residual is not None else x,
        norm_weight if norm_weight is not None else x, eps, n, K=k, **_type_args(qtype, nb, packed),
        BLOCK_N=bn, G=per * TYPES[qtype].groups, NORM=norm_weight is not None,
        NORM_BLOCK=triton.next_power_of_2(k), SILU=silu, RESIDUAL=residual is not None, PDL=pdl,
        num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}),
    )
    return out


def block_mm(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    out_dtype: torch.dtype | None = None,
    *,
    packed: bool = False,
    config: MmConfig | None = None,
) -> torch.Tensor:
    """[M, K] x W[N, K]^T -> [M, N] for M >= 2, W in GGUF blocks as in `block_gemv`.

    The weights are rounded once to x's dtype (fp32 x: products in IEEE fp32), the sums run
    in float32 and are rounded to x's dtype, then stored in out_dtype.
    """
    nb = _check(x, blocks, qtype, "block_mm", one_row=False)
    m, k = x.shape
    n = blocks.shape[0]
    bm, bn, per, warps, stages = config or default_mm_config(m, n, k, qtype)
    if config is None and x.dtype == torch.float32:
        stages = 1  # float32 tiles take twice the shared memory
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    _mm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, blocks, blocks.view(torch.float16), out, m, n, K=k, **_type_args(qtype, nb, packed),
        BLOCK_M=bm, BLOCK_N=bn, G=per * TYPES[qtype].groups,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages,
    )
    return out
