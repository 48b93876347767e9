"""Products of 2-64 bf16 rows with packed Q4_K and Q6_K blocks by group sums, on the tensor cores.

`blocks.block_mm` decodes each weight to its float32 value, rounds it to bf16
and feeds `tl.dot`: at 16 rows the decode, not the memory, bounds it (the
8B gate/up matrix at 0.47 TB/s). Here a weight is one quant turned into the
bf16 `1 + q / 16` (exact: an or and a shift on 16 bits), each scale group of
32 values is one `tl.dot` of its own, and the group's scale and min are
applied to the [rows, columns] sums after it, as in `kquant_rows`:

    sum(w * x) = 16 a * sum((1 + q / 16) * x) - (16 a + b) * sum(x)

for ggml's w = a * q - b (Q6_K: `1 + q / 64` over groups of 16, `_mm_q6k_kernel`). The products are exact (bf16 times bf16 in
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
    """16 or 64 rows a tile, 64 columns (64 rows: 8 warps, which 4 would spill); narrow column
    tiles so that every multiprocessor streams weights."""
    return (16, 64, 4, 2) if m <= 16 else (64, 64, 8, 2)


def takes(x: torch.Tensor, qtype: int, packed: bool, invariant: bool) -> bool:
    """Whether this kernel computes x [M, K] (2 <= M <= 64) times packed `qtype` blocks."""
    return (qtype in (T.Q4_K, T.Q6_K) and packed and not invariant and x.dtype == torch.bfloat16
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
    return ((q.to(tl.int32) << 3) | 0x3F80).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _tile(M, N, K: tl.constexpr, RS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The program's rows of x and of the weights, and where they start (rows past the end read
    row 0). Axis 0 walks the row tiles of x, so the programs that share a weight tile run
    together."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    xr = (tl.where(rm < M, rm, 0).to(tl.int64) * K)[:, None]
    rb = tl.where(rn < N, rn, 0).to(tl.int64) * RS
    return rm, rn, xr, rb


@triton.jit
def _store(acc, out, rm, rn, M, N):
    """The float32 sums rounded to bf16 (x's dtype), stored in out's."""
    y = acc.to(tl.bfloat16).to(out.dtype.element_ty)
    tl.store(out + rm[:, None].to(tl.int64) * N + rn[None, :], y,
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _mm_q4k_kernel(x, b, h, out, M, N, K: tl.constexpr, RS: tl.constexpr, OSC: tl.constexpr,
                   OD: tl.constexpr, OM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Q4_K: per 32 quant bytes, groups 2p (low nibbles) and 2p + 1 (high), one dot each."""
    rm, rn, xr, rb = _tile(M, N, K, RS, BLOCK_M, BLOCK_N)
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
    _store(acc, out, rm, rn, M, N)


@triton.jit
def _mm_q6k_kernel(x, b, h, out, M, N, K: tl.constexpr, RS: tl.constexpr, OH: tl.constexpr,
                   OSC: tl.constexpr, OD: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Q6_K: w = d * sc * (q - 32) over groups of 16, q's low nibble in ql and its two high
    bits in qh; with f = 1 + q / 64 (exact in bf16) a group adds 64 d sc * sum(f * x) -
    96 d sc * sum(x)."""
    rm, rn, xr, rb = _tile(M, N, K, RS, BLOCK_M, BLOCK_N)
    t = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for blk in range(K // 256):
        d = tl.load(h + (rb + OD + blk * 2) // 2).to(tl.float32)
        for g in tl.static_range(16):  # values 16 g .. 16 g + 15 of the block
            hh = g // 8  # the half of the block
            v = (g % 8) * 16  # the group's first value within the half
            at = v % 64  # its ql byte: high nibbles hold values 64 .. 127 of a half
            ql = tl.load(b + rb[:, None] + blk * 128 + hh * 64 + at + t[None, :]).to(tl.int16)
            qh = tl.load(b + rb[:, None] + OH + blk * 64 + hh * 32 + at % 32 + t[None, :]).to(tl.int16)
            q = ((ql >> (4 * (v // 64))) & 15) | (((qh >> (2 * (v // 32))) & 3) << 4)
            f = ((q.to(tl.int32) << 1) | 0x3F80).to(tl.int16).to(tl.bfloat16, bitcast=True)
            xg = tl.load(x + xr + blk * 256 + hh * 128 + v + t[None, :])
            s = tl.dot(xg, tl.trans(f))
            sc = tl.load(b.to(tl.pointer_type(tl.int8), bitcast=True) + rb + OSC + blk * 16 + g).to(tl.float32)
            a = d * sc
            acc += s * (64.0 * a)[None, :] - tl.sum(xg.to(tl.float32), 1)[:, None] * (96.0 * a)[None, :]
    _store(acc, out, rm, rn, M, N)


def kq_mm(x: torch.Tensor, blocks: torch.Tensor, qtype: int, out: torch.Tensor,
          config: Config | None = None) -> torch.Tensor:
    """`blocks.block_mm`'s product (checked there) for what `takes`: writes and returns out."""
    m, k = x.shape
    n = blocks.shape[0]
    lay = dict(zip(("OQ", "SQ", "OH", "SH", "OSC", "SSC", "OD", "SD", "OM", "SM"),
                   layout(qtype, k // 256, True)))
    bm, bn, warps, stages = config or default_config(m, n)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    common = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    if qtype == T.Q4_K:
        _mm_q4k_kernel[grid](x, blocks, blocks.view(torch.float16), out, m, n, K=k, RS=k // 256 * 144,
                             OSC=lay["OSC"], OD=lay["OD"], OM=lay["OM"], **common)
    else:
        _mm_q6k_kernel[grid](x, blocks, blocks.view(torch.float16), out, m, n, K=k, RS=k // 256 * 210,
                             OH=lay["OH"], OSC=lay["OSC"], OD=lay["OD"], **common)
    return out
