"""Decode attention: one query per lane over its cached cells, read through the chunk tables.

One program computes the G query heads that share one KV head (grouped-query
attention: each K/V tile is loaded once for the whole group and multiplied
as a [G, N] tile on the tensor cores) over one split of the lane's
positions, and a second pass combines the splits' partial results through
their log-sum-exp, in split order. A lane's splits depend on its own length
only (`lane_splits`: one per MIN_SPLIT positions, at most MAX_SPLITS), never
on how many lanes share the step or on the longest of them, so a lane's
output has the same bits alone, among 64 lanes, eagerly and from a CUDA graph
(docs/GPU.md, "Exactness on the GPU"). Where no lane of the launch has more
than one split, the first pass writes the output itself (the same bits: a
single split's combine is o * 1 / 1).

Q4_0 K and V are read as low and high half tiles (`cells.q4_halves`); in
bf16 and fp32 compute V's tiles are its codes alone, and each block's d
scales the probabilities instead: the G query rows are repeated once per
V block (EXPAND), and the epilogue keeps each row's own block. Kernels
that read Q4_0 compile under a 128-register cap (`Q4_0_MAXNREG`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from strata.kernels.triton.cells import (
    accumulate,
    accumulate_halves,
    block_scales,
    cells_of,
    hadamard_halves,
    half_dims,
    key_scores,
    load_queries,
    load_tile,
    q4_halves,
    select_blocks,
)
from strata.kernels.triton.half import INT8, Q4_0, Half

LOG2E = 1.4426950408889634
BLOCK_N = 64
MIN_SPLIT = 128  # positions a split covers at least: a shorter one costs more in the second pass
MAX_SPLITS = 64  # splits of one lane at most (one lane at 8,192 cells and more: 4 KV heads' worth a multiprocessor)
# registers a thread when K or V is Q4_0, the measured best (H200, 2026-11-30; docs/GPU.md):
# ptxas's own choice, about 160, leaves three programs per multiprocessor instead of four, and
# one lane at 32k took 60.6 us a layer instead of 48.9 (q4_0)
Q4_0_MAXNREG = 128


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the decode kernel for one pair of K/V encodings."""

    block_n: int = BLOCK_N  # positions per tile
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None  # registers a thread ptxas may use (None: its choice)


# (K kind, V kind) -> config; `benchmarks.gpu_bench --sweep-decode` times alternatives.
# int8: 128-position tiles, measured best of the sweep on the H200 (2026-11-30): 40.3 us for
# one lane at 32,768 cells (bf16: 40.8) and 208 us for 64 lanes at 4,096 (bf16: 262), against
# 47.8 and 384 us with 64-position tiles and three programs per multiprocessor.
CONFIGS: dict[tuple[int, int], DecodeConfig] = {
    (INT8, INT8): DecodeConfig(block_n=128, num_warps=4, num_stages=2),
}


@triton.jit
def _lane_splits(seqlen, MIN: tl.constexpr, MAX: tl.constexpr):
    """`lane_splits` in a kernel."""
    return tl.maximum(tl.minimum(tl.cdiv(seqlen, MIN), MAX), 1)


@triton.jit(do_not_specialize=["num_splits"])  # it changes as contexts grow
def _decode_kernel(
    q, out, mid_o, mid_lse, q_rows, sessions, seqlens, tables, t_stride,
    k_data, k_aux, k_sc, k_sh, k_ac, k_ah,
    v_data, v_aux, v_sc, v_sh, v_ac, v_ah,
    qk_scale, sq_t, sq_h, so_t, so_h, num_heads, num_splits,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, K_KIND: tl.constexpr, V_KIND: tl.constexpr,
    DIRECT: tl.constexpr, IEEE: tl.constexpr, FOLD_V: tl.constexpr, ROTATE: tl.constexpr,
    ROT_SCALE: tl.constexpr, EXPAND: tl.constexpr, BLOCK_R: tl.constexpr,
    V_BIAS: tl.constexpr, MIN_SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr,
):
    # Long: one loop's state (the running max, sums and accumulators per format) in one body.
    # Q4_0 K / V come as low and high half tiles (`q4_halves`).
    # EXPAND: rows are (V block b, query head g), b * BLOCK_G + g, so that V's tiles are plain
    # codes and p is scaled per row by block b's d; the epilogue keeps each row's own block.
    # V_BIAS: those codes come as code + 128 (bf16, no conversion); 136 * sum(p) comes off.
    # ROTATE (k8v4) comes with a Q4_0 V: the half tiles' order folds into H's rows.
    K_HALF: tl.constexpr = K_KIND == 2
    V_HALF: tl.constexpr = V_KIND == 2
    # a tile never straddles a chunk: one table entry per tile, fetched a tile ahead (and the
    # tile's rows past `hi` are cells of that chunk, safe to read)
    UNIFORM: tl.constexpr = (K_HALF or V_HALF) and CHUNK % BLOCK_N == 0
    lane = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seqlen = tl.load(seqlens + lane).to(tl.int32)
    session = tl.load(sessions + lane).to(tl.int64)
    row = tl.load(q_rows + lane).to(tl.int64)
    # the lane's own splits, in whole tiles; programs past them have nothing to read (lo >= hi),
    # and the combine pass reads the lane's own splits only
    own = _lane_splits(seqlen, MIN_SPLIT, MAX_SPLITS)
    split_len = tl.cdiv(seqlen, own * BLOCK_N) * BLOCK_N
    lo = tl.minimum(split * split_len, seqlen)
    hi = tl.minimum(lo + split_len, seqlen)

    offs_r = tl.arange(0, BLOCK_R)  # == offs_g unless EXPAND
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_D // 2)
    offs_n = tl.arange(0, BLOCK_N)
    rheads = kvh * G + offs_r % BLOCK_G
    rmask = offs_r % BLOCK_G < G
    dims_lo = half_dims(offs_h, 0)
    dims_hi = half_dims(offs_h, 1)
    q_base = q + row * sq_t + rheads[:, None] * sq_h
    q_a, q_b = load_queries(q_base, rmask, HEAD_DIM, BLOCK_D, K_HALF)
    table_row = tables + session * t_stride
    cdt = q.dtype.element_ty

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    if V_HALF:
        acc = tl.zeros([BLOCK_R, BLOCK_D // 2], tl.float32)
        acc_hi = tl.zeros([BLOCK_R, BLOCK_D // 2], tl.float32)
    else:
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    if UNIFORM:
        chunk = tl.load(table_row + lo // CHUNK, mask=lo < hi, other=0).to(tl.int64)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        nmask = pos < hi
        if UNIFORM:
            cells = chunk * CHUNK + (pos % CHUNK).to(tl.int64)
            nxt = start + BLOCK_N
            chunk = tl.load(table_row + nxt // CHUNK, mask=nxt < hi, other=0).to(tl.int64)
        else:
            cells = cells_of(table_row, pos, nmask, CHUNK)
        if V_HALF:  # V's loads go out with K's
            v_lo, v_hi = q4_halves(v_data, v_aux, cells, kvh, nmask, v_sc, v_sh, v_ac, v_ah,
                                   HEAD_DIM, BLOCK_D, cdt, not EXPAND, V_BIAS != 0, UNIFORM)
            if EXPAND:
                v_d = block_scales(v_aux, cells, kvh, nmask, v_ac, v_ah, BLOCK_G, BLOCK_R,
                                   HEAD_DIM)
        s = key_scores(q_a, q_b, k_data, k_aux, cells, kvh, nmask, k_sc, k_sh, k_ac, k_ah,
                       K_KIND, HEAD_DIM, BLOCK_D, cdt, qk_scale, IEEE)
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_HALF:
            if EXPAND:
                p = p * v_d
            pv = p.to(v_lo.dtype)
            acc, acc_hi = accumulate_halves(acc, acc_hi, alpha, pv, v_lo, v_hi, IEEE)
            if V_BIAS != 0:
                bias = tl.sum(pv.to(tl.float32), 1)[:, None] * V_BIAS
                acc = acc - bias
                acc_hi = acc_hi - bias
        else:
            v, v_scale = load_tile(v_data, v_aux, cells, kvh, nmask, v_sc, v_sh, v_ac, v_ah,
                                   V_KIND, HEAD_DIM, BLOCK_D, cdt, not FOLD_V)
            acc = accumulate(acc, alpha, p, v, v_scale, V_KIND, FOLD_V, IEEE)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split gives zeros, not NaN
    offs_g = tl.arange(0, BLOCK_G)
    heads = kvh * G + offs_g
    gmask = offs_g < G
    if DIRECT:
        o_base = out + row * so_t + heads[:, None] * so_h
    else:
        slot = (lane * num_heads + heads) * num_splits + split
        o_base = mid_o + slot[:, None] * HEAD_DIM
    if V_HALF:
        o_lo = acc / l_safe
        o_hi = acc_hi / l_safe
        if EXPAND:
            o_lo = select_blocks(o_lo, BLOCK_G, BLOCK_R // BLOCK_G)
            o_hi = select_blocks(o_hi, BLOCK_G, BLOCK_R // BLOCK_G)
        if ROTATE:
            o = hadamard_halves(o_lo, o_hi, dims_lo, dims_hi, BLOCK_D, ROT_SCALE, IEEE)
            tl.store(o_base + offs_d[None, :], o.to(o_base.dtype.element_ty),
                     mask=gmask[:, None] & (offs_d < HEAD_DIM)[None, :])
        else:
            tl.store(o_base + dims_lo[None, :], o_lo.to(o_base.dtype.element_ty),
                     mask=gmask[:, None] & (dims_lo < HEAD_DIM)[None, :])
            tl.store(o_base + dims_hi[None, :], o_hi.to(o_base.dtype.element_ty),
                     mask=gmask[:, None] & (dims_hi < HEAD_DIM)[None, :])
    else:
        o = acc / l_safe
        tl.store(o_base + offs_d[None, :], o.to(o_base.dtype.element_ty),
                 mask=gmask[:, None] & (offs_d < HEAD_DIM)[None, :])
    if not DIRECT:  # rows b > 0 of an EXPAND tile repeat row b = 0's statistics
        rslot = (lane * num_heads + rheads) * num_splits + split
        tl.store(mid_lse + rslot, m_i + tl.log2(l_i), mask=rmask & (offs_r < BLOCK_G))


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    mid_o, mid_lse, out, q_rows, seqlens, so_t, so_h, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MIN_SPLIT: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    # the lane's own splits, summed one after another: the order depends on its length alone
    lane = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(q_rows + lane).to(tl.int64)
    own = _lane_splits(tl.load(seqlens + lane).to(tl.int32), MIN_SPLIT, MAX_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    base = (lane * num_heads + head) * num_splits
    top = tl.load(mid_lse + base)
    for s in range(1, own):
        top = tl.maximum(top, tl.load(mid_lse + base + s))
    num = tl.zeros([BLOCK_D], tl.float32)
    den = 0.0
    for s in range(0, own):
        w = tl.exp2(tl.load(mid_lse + base + s) - top)  # an empty split has lse -inf: weight 0
        num += w * tl.load(mid_o + (base + s) * HEAD_DIM + offs_d, mask=dmask, other=0.0)
        den += w
    tl.store(out + row * so_t + head * so_h + offs_d, (num / den).to(out.dtype.element_ty), mask=dmask)


@dataclass(frozen=True)
class DecodeBatch:
    """Device metadata of the decoding lanes of one step (int32 [B] each)."""

    q_rows: torch.Tensor  # row of the step's flattened tokens holding the lane's query
    sessions: torch.Tensor  # pool session (chunk table row)
    seqlens: torch.Tensor  # cells to attend: start + 1
    max_len: int  # host copy of max(seqlens), to size the splits


def lane_splits(length: int) -> int:
    """Splits of a lane attending over `length` cells: one per MIN_SPLIT positions, at most
    MAX_SPLITS. A function of the lane's own length, so its sums never depend on its company;
    one lane at 8,192 cells and more runs 64 programs a KV head, enough to stream K/V at full
    bandwidth (one program reads its split one tile at a time)."""
    return max(1, min(MAX_SPLITS, -(-length // MIN_SPLIT)))


def decode_attention(
    q: torch.Tensor, out: torch.Tensor, batch: DecodeBatch, k: Half, v: Half,
    tables: torch.Tensor, chunk: int, scale: float, rotate_v: bool = False,
) -> None:
    """Write attention for the lanes' query rows of `q` [T, Hq, D] into the same rows of `out`.

    `rotate_v`: V is stored Hadamard-rotated (k8v4, a Q4_0 V); the output is rotated back
    (the combine pass is linear, so the first pass rotates).
    """
    lanes = batch.q_rows.shape[0]
    if lanes == 0:
        return
    if rotate_v and v.kind != Q4_0:
        raise ValueError("decode attention rotates the output of a Q4_0 V only (k8v4)")
    hq, d = q.shape[1], q.shape[2]
    hkv = k.data.shape[1]
    g = hq // hkv
    cfg = CONFIGS.get((k.kind, v.kind), DecodeConfig())
    maxnreg = cfg.maxnreg
    if maxnreg is None and Q4_0 in (k.kind, v.kind):
        maxnreg = Q4_0_MAXNREG
    splits = lane_splits(batch.max_len)  # launched: the longest lane's; each lane runs its own
    direct = splits == 1
    if direct:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty((lanes, hq, splits, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((lanes, hq, splits), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(d)
    fold_v = q.dtype != torch.float16
    expand = v.kind == Q4_0 and fold_v
    block_g = max(16, triton.next_power_of_2(g))
    block_r = block_g
    if expand:
        nb = block_d // 32
        block_g = max(triton.next_power_of_2(g), -(-16 // nb))
        block_r = block_g * nb
    _decode_kernel[(lanes, hkv, splits)](
        q, out, mid_o, mid_lse, batch.q_rows, batch.sessions, batch.seqlens, tables,
        tables.stride(0), *k.args(), *v.args(),
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), hq,
        splits, MIN_SPLIT=MIN_SPLIT, MAX_SPLITS=MAX_SPLITS,
        G=g, HEAD_DIM=d, BLOCK_G=block_g, BLOCK_N=cfg.block_n,
        BLOCK_D=block_d, CHUNK=chunk, K_KIND=k.kind, V_KIND=v.kind, DIRECT=direct,
        IEEE=q.dtype == torch.float32, FOLD_V=fold_v, ROTATE=rotate_v,
        ROT_SCALE=d**-0.5, EXPAND=expand, BLOCK_R=block_r,
        V_BIAS=136 if expand and q.dtype == torch.bfloat16 else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=maxnreg,
    )
    if not direct:
        _combine_kernel[(lanes, hq)](
            mid_o, mid_lse, out, batch.q_rows, batch.seqlens, out.stride(0), out.stride(1), hq,
            splits, HEAD_DIM=d, BLOCK_D=block_d, MIN_SPLIT=MIN_SPLIT, MAX_SPLITS=MAX_SPLITS,
            num_warps=4,
        )
