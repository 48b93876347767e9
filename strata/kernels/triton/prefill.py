"""Prompt-reading attention: a chunk of new queries over the cached prefix plus themselves, causal.

Queries are cut into blocks of BLOCK_M rows of one sequence; a program takes
one block and one query head and streams the keys [0, last query of the
block] through the sequence's chunk table. The new tokens' K/V were written
to the pool before the launch, so cached and new keys are read one way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from strata.kernels.triton.cells import (
    accumulate,
    accumulate_halves,
    cells_of,
    hadamard_halves,
    half_dims,
    key_scores,
    load_queries,
    load_tile,
    q4_halves,
)
from strata.kernels.triton.decode import LOG2E
from strata.kernels.triton.half import Q4_0, Half

BLOCK_M = 64
BLOCK_N = 64


@triton.jit
def _prefill_kernel(
    q, out, blk_seq, blk_m0, seq_session, seq_start, seq_n, seq_row, tables, t_stride,
    k_data, k_aux, k_sc, k_sh, k_ac, k_ah,
    v_data, v_aux, v_sc, v_sh, v_ac, v_ah,
    qk_scale, sq_t, sq_h, so_t, so_h,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, K_KIND: tl.constexpr, V_KIND: tl.constexpr,
    IEEE: tl.constexpr, FOLD_V: tl.constexpr, ROTATE: tl.constexpr, ROT_SCALE: tl.constexpr,
):
    # Q4_0 K and V (q4_0; k8v4's V) come as low and high half tiles (`q4_halves`, scaled):
    # each byte and each block's d loaded once. K's scores are two dots, from q's matching
    # halves; V's output is two halves in `half_dims` order (k8v4 folds that order into its
    # rotation's rows).
    K_HALF: tl.constexpr = K_KIND == 2
    V_HALF: tl.constexpr = V_KIND == 2
    blk = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // G
    s = tl.load(blk_seq + blk)
    m0 = tl.load(blk_m0 + blk).to(tl.int32)
    session = tl.load(seq_session + s).to(tl.int64)
    start = tl.load(seq_start + s).to(tl.int32)
    n = tl.load(seq_n + s).to(tl.int32)
    row0 = tl.load(seq_row + s).to(tl.int64)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mmask = offs_m < n
    qpos = start + offs_m
    rows = row0 + offs_m
    q_a, q_b = load_queries(q + rows[:, None] * sq_t + head * sq_h, mmask, HEAD_DIM, BLOCK_D, K_HALF)
    cdt = q.dtype.element_ty
    table_row = tables + session * t_stride
    hi = tl.minimum(start + m0 + BLOCK_M, start + n)  # keys past the block's last query: none
    hi = tl.where(m0 < n, hi, 0)  # a block of padding rows (a captured prompt step's): no keys

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if V_HALF:
        acc = tl.zeros([BLOCK_M, BLOCK_D // 2], tl.float32)
        acc_hi = tl.zeros([BLOCK_M, BLOCK_D // 2], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for kstart in range(0, hi, BLOCK_N):
        kpos = kstart + offs_n
        nmask = kpos < hi
        cells = cells_of(table_row, kpos, nmask, CHUNK)
        sc = key_scores(q_a, q_b, k_data, k_aux, cells, kvh, nmask, k_sc, k_sh, k_ac, k_ah,
                        K_KIND, HEAD_DIM, BLOCK_D, cdt, qk_scale, IEEE)
        sc = tl.where(nmask[None, :] & (kpos[None, :] <= qpos[:, None]), sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))  # key 0 is in every row's first block: finite
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_HALF:
            v_lo, v_hi = q4_halves(v_data, v_aux, cells, kvh, nmask, v_sc, v_sh, v_ac, v_ah,
                                   HEAD_DIM, BLOCK_D, cdt, True, False, False)
            acc, acc_hi = accumulate_halves(acc, acc_hi, alpha, p.to(cdt), v_lo, v_hi, IEEE)
        else:
            v, v_scale = load_tile(v_data, v_aux, cells, kvh, nmask, v_sc, v_sh, v_ac, v_ah,
                                   V_KIND, HEAD_DIM, BLOCK_D, cdt, not FOLD_V)
            acc = accumulate(acc, alpha, p, v, v_scale, V_KIND, FOLD_V, IEEE)
        m_i = m_new

    o_rows = out + rows[:, None] * so_t + head * so_h
    dt = out.dtype.element_ty
    if V_HALF:
        offs_h = tl.arange(0, BLOCK_D // 2)
        dims_lo = half_dims(offs_h, 0)
        dims_hi = half_dims(offs_h, 1)
        o_lo = acc / l_i[:, None]
        o_hi = acc_hi / l_i[:, None]
        if ROTATE:  # k8v4: V was stored rotated
            o = hadamard_halves(o_lo, o_hi, dims_lo, dims_hi, BLOCK_D, ROT_SCALE, IEEE)
            tl.store(o_rows + offs_d[None, :], o.to(dt), mask=mmask[:, None] & (offs_d < HEAD_DIM)[None, :])
        else:
            tl.store(o_rows + dims_lo[None, :], o_lo.to(dt), mask=mmask[:, None] & (dims_lo < HEAD_DIM)[None, :])
            tl.store(o_rows + dims_hi[None, :], o_hi.to(dt), mask=mmask[:, None] & (dims_hi < HEAD_DIM)[None, :])
    else:
        o = acc / l_i[:, None]
        tl.store(o_rows + offs_d[None, :], o.to(dt), mask=mmask[:, None] & (offs_d < HEAD_DIM)[None, :])


@dataclass(frozen=True)
class PrefillBatch:
    """Device metadata (int32) of the step's prompt-reading sequences and their query blocks."""

    blk_seq: torch.Tensor  # [NB] sequence of each query block
    blk_m0: torch.Tensor  # [NB] first query (offset in its sequence) of each block
    session: torch.Tensor  # [S]
    start: torch.Tensor  # [S] position of the first new token
    n: torch.Tensor  # [S] new tokens
    row: torch.Tensor  # [S] row of the first new token in the step's flattened tokens


def query_blocks(ns: list[int]) -> tuple[list[int], list[int]]:
    """(sequence index, first query) of every BLOCK_M-row block of sequences with `ns` queries."""
    seq, m0 = [], []
    for i, n in enumerate(ns):
        for m in range(0, n, BLOCK_M):
            seq.append(i)
            m0.append(m)
    return seq, m0


def prefill_attention(
    q: torch.Tensor, out: torch.Tensor, batch: PrefillBatch, k: Half, v: Half,
    tables: torch.Tensor, chunk: int, scale: float, rotate_v: bool = False,
) -> None:
    """Write causal attention for the sequences' query rows of `q` into the same rows of `out`.

    `rotate_v`: V is stored Hadamard-rotated (k8v4); the output is rotated back.
    """
    blocks = batch.blk_seq.shape[0]
    if blocks == 0:
        return
    if rotate_v and v.kind != Q4_0:
        raise ValueError("prompt attention rotates the output of a Q4_0 V only (k8v4)")
    hq, d = q.shape[1], q.shape[2]
    hkv = k.data.shape[1]
    _prefill_kernel[(blocks, hq)](
        q, out, batch.blk_seq, batch.blk_m0, batch.session, batch.start, batch.n, batch.row,
        tables, tables.stride(0), *k.args(), *v.args(),
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        G=hq // hkv, HEAD_DIM=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=triton.next_power_of_2(d), CHUNK=chunk, K_KIND=k.kind, V_KIND=v.kind,
        IEEE=q.dtype == torch.float32, FOLD_V=q.dtype != torch.float16, ROTATE=rotate_v,
        ROT_SCALE=d**-0.5, num_warps=4, num_stages=2,
    )
