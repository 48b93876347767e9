"""Products of 2-64 bf16 rows with packed Q4_K blocks by group sums, on the tensor cores.

`blocks.block_mm` decodes each weight to its float32 value, rounds it to bf16
and feeds `tl.dot`: at 16 rows the decode, not the memory, bounds it (the
8B gate/up matrix at 0.47 TB/s). Here a weight is one quant turned into the
bf16 `1 + q / 16` (exact: an or and a shift on 16 bits), each scale group of
32 values is one `tl.dot` of its own, and the group's scale and min are
applied to the [rows, columns] sums after it, as in `kquant_rows`:

    sum(w * x) = 16 a * sum((1 + q / 16) * x) - (16 a + b) * sum(x)

for ggml's w = a * q - b. The products are exact (bf16 times bf16 in
float32), so this is closer to the exact product than rounding each weight
to bf16 first. The epilogue costs 2 M / 32 fused multiply-adds a weight, so
it is taken for M <= 64 only; larger M (prompts) keep `block_mm`'s kernel,
whose decode is shared by 128 rows. The sums' order depends on K only, not
on M, but differs from `block_mm`'s: `--batch-invariant` keeps every row
count on `block_mm` (`takes`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from strata.kernels.triton.blocks_decode import layout

MAX_ROWS = 64
Config = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, warps, stages)


def default_config(m: int, n: int) -> Config:
    """16 or 64 rows a tile; narrow column tiles so that every multiprocessor streams weights."""
    return (16 if m <= 16 else 64), 64, 4, 2


def takes(x: torch.Tensor, qtype: int, packed: bool, invariant: bool) -> bool:
    """Whether this kernel computes x [M, K] (2 <= M <= 64) times packed `qtype` blocks."""
    return (qtype == T.Q4_K and packed and not invariant and x.dtype == torch.bfloat16
            and 2 <= x.shape[0] <= MAX_ROWS and x.shape[1] % 256 == 0)


@triton.jit
def _scale_min(b, at, J: tl.constexpr):
    """Sub-block J's 6-bit scale and min (ggml's get_scale_min_k4) of the rows at byte `at`."""
    if J < 4:
        sc = tl.load(b + at + J).to(tl.int32) & 63
        mn = tl.load(b + at + J + 4).to(tl.int32) & 63
    else:
        lo = tl.load(b + at + J + 4).to(tl.int32)
        sc = (lo & 15) | ((tl.load(b + at + J - 4).to(tl.int32) >> 6) << 4)
        mn = (lo >> 4) | ((tl.load(b + at + J).to(tl.int32) >> 6) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _ones_plus(q):
    """bf16 1 + q / 16 for nibbles q (bits 3-6 of the bf16 1.0)."""
    return ((q.to(tl.int16) << 3) | 0x3F80).to(tl.bfloat16, bitcast=True)


@triton.jit
def _mm_q4k_kernel(x, b, h, out, M, N, K: tl.constexpr, RS: tl.constexpr, OSC: tl.constexpr,
                   OD: tl.constexpr, OM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Axis 0 walks the row tiles of x, so the programs that share a weight tile run together."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    xr = (tl.where(rm < M, rm, 0).to(tl.int64) * K)[:, None]
    rb = tl.where(rn < N, rn, 0).to(tl.int64) * RS
    e = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for blk in range(K // 256):
        d = tl.load(h + (rb + OD + blk * 2) // 2).to(tl.float32) * 16.0
        dmin = tl.load(h + (rb + OM + blk * 2) // 2).to(tl.float32)
        for p in tl.static_range(4):  # 32 quant bytes: group 2p (low nibbles), 2p + 1 (high)
            q = tl.load(b + rb[:, None] + blk * 128 + p * 32 + e[None, :])
            col = blk * 256 + p * 64 + e[None, :]
            x_lo = tl.load(x + xr + col)
            x_hi = tl.load(x + xr + col + 32)
            s_lo = tl.dot(x_lo, tl.trans(_ones_plus(q & 15)))
            s_hi = tl.dot(x_hi, tl.trans(_ones_plus(q >> 4)))
            sc_lo, m_lo = _scale_min(b, rb + OSC + blk * 12, 2 * p)
            sc_hi, m_hi = _scale_min(b, rb + OSC + blk * 12, 2 * p + 1)
            a_lo = d * sc_lo
            a_hi = d * sc_hi
            acc += s_lo * a_lo[None, :] - tl.sum(x_lo.to(tl.float32), 1)[:, None] * (a_lo + dmin * m_lo)[None, :]
            acc += s_hi * a_hi[None, :] - tl.sum(x_hi.to(tl.float32), 1)[:, None] * (a_hi + dmin * m_hi)[None, :]
    y = acc.to(tl.bfloat16).to(out.dtype.element_ty)
    tl.store(out + rm[:, None].to(tl.int64) * N + rn[None, :], y,
             mask=(rm < M)[:, None] & (rn < N)[None, :])


def kq_mm(x: torch.Tensor, blocks: torch.Tensor, qtype: int, out: torch.Tensor,
          config: Config | None = None) -> torch.Tensor:
    """`blocks.block_mm`'s product (checked there) for what `takes`: writes and returns out."""
    m, k = x.shape
    n = blocks.shape[0]
    lay = dict(zip(("OQ", "SQ", "OH", "SH", "OSC", "SSC", "OD", "SD", "OM", "SM"),
                   layout(qtype, k // 256, True)))
    bm, bn, warps, stages = config or default_config(m, n)
    _mm_q4k_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, blocks, blocks.view(torch.float16), out, m, n, K=k, RS=k // 256 * 144, OSC=lay["OSC"],
        OD=lay["OD"], OM=lay["OM"], BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
    )
    return out
