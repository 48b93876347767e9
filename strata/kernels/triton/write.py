"""Storing a step's new K/V at its cells in one launch, in every format the kernels read.

torch's `index_copy_` needs one launch per run (and a cast before each when
the compute and storage dtypes differ), and its quantizers a dozen small
kernels more (k8v4's Hadamard rotation another twenty): inside a decode graph
that is a hundred launches a layer. These kernels cast or quantize and store
K and V of every token together.

The quantizers give the bits of `strata.kv.quant` and `strata.kv.hadamard`
exactly (tests compare with `torch.equal`): the same float32 operations in
the same order, IEEE division (`div_rn`; Triton's `/` is approximate),
round-half-even as torch.round does, and no fused multiply-adds
(`enable_fp_fusion=False`), since torch rounds every product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.triton.half import INT8, Q4_0, Half


@triton.jit
def _write_kernel(
    k, v, cells, k_dst, v_dst, sk_t, sk_h, sv_t, sv_h, dk_c, dk_h, dv_c, dv_h,
    HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cell = tl.load(cells + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < HKV)[:, None] & (offs_d < HEAD_DIM)[None, :]
    kt = tl.load(k + t * sk_t + offs_h[:, None] * sk_h + offs_d[None, :], mask=mask)
    vt = tl.load(v + t * sv_t + offs_h[:, None] * sv_h + offs_d[None, :], mask=mask)
    tl.store(k_dst + cell * dk_c + offs_h[:, None] * dk_h + offs_d[None, :],
             kt.to(k_dst.dtype.element_ty), mask=mask)
    tl.store(v_dst + cell * dv_c + offs_h[:, None] * dv_h + offs_d[None, :],
             vt.to(v_dst.dtype.element_ty), mask=mask)


def write_plain(k_dst: torch.Tensor, v_dst: torch.Tensor, cells: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor) -> None:
    """k_dst[cells] = k and v_dst[cells] = v, cast to the storage dtype (k, v: [T, Hkv, D])."""
    t, hkv, d = k.shape
    if t == 0:
        return
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    _write_kernel[(t,)](
        k, v, cells, k_dst, v_dst, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_dst.stride(0), k_dst.stride(1), v_dst.stride(0), v_dst.stride(1),
        HKV=hkv, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(hkv),
        BLOCK_D=triton.next_power_of_2(d), num_warps=4,
    )


@triton.jit
def _round_half_even(y):
    """torch.round of float32 |y| < 2**22: past 1.5 * 2**23 no fraction bits are left,
    so the addition rounds to an integer with the FPU's ties-to-even."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _store_int8(x, hmask, mask, cell, data, aux, s_cell, s_head, a_cell, a_head,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """`quantize_int8` of x [BLOCK_H, BLOCK_D] float32 (masked entries 0), stored at `cell`."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    amax = tl.max(tl.abs(x), 1)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    safe = tl.where(scale == 0, 1.0, scale)
    codes = _round_half_even(tl.math.div_rn(x, tl.broadcast_to(safe[:, None], x.shape)))
    codes = tl.minimum(tl.maximum(codes, -127.0), 127.0)
    tl.store(data + cell * s_cell + offs_h[:, None] * s_head + offs_d[None, :],
             codes.to(tl.int8), mask=mask)
    tl.store(aux + cell * a_cell + offs_h * a_head, scale, mask=hmask)


@triton.jit
def _store_q4_0(x, rmask, cell, data, aux, s_cell, s_head, a_cell, a_head,
                ROWS: tl.constexpr, BLOCK_NB: tl.constexpr):
    """`quantize_q4_0` of blocks x [ROWS, 32] float32, row r = (head r // BLOCK_NB, block r % BLOCK_NB)."""
    offs_r = tl.arange(0, ROWS)
    idx = tl.arange(0, 32)[None, :]
    a = tl.abs(x)
    m = tl.max(a, 1)
    at = tl.min(tl.where(a == m[:, None], idx, 32), 1)  # the first value of largest magnitude
    val = tl.max(tl.where(idx == at[:, None], x, float("-inf")), 1)  # ... with its sign (and -0)
    d = val * -0.125  # / -8, exactly
    inv = tl.where(d == 0, 0.0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d))
    y = x * inv[:, None] + 8.5  # two roundings: the launch turns fused multiply-adds off
    codes = tl.minimum(tl.maximum(y, 0.0), 15.0).to(tl.int32)  # trunc after the clamp: the same
    lo, hi = tl.split(tl.permute(tl.reshape(codes, [ROWS, 2, 16]), [0, 2, 1]))
    packed = (lo | (hi << 4)).to(tl.uint8)
    head = offs_r // BLOCK_NB
    blk = offs_r % BLOCK_NB
    tl.store(data + cell * s_cell + (head * s_head + blk * 18 + 2)[:, None] + tl.arange(0, 16)[None, :],
             packed, mask=rmask[:, None])
    tl.store(aux + cell * a_cell + head * a_head + blk * 9, d.to(tl.float16), mask=rmask)


@triton.jit
def _hadamard_rows(x, ROWS: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr,
                   SCALE: tl.constexpr):
    """`hadamard_rotate` of x [ROWS, D] float32: the same butterflies, then the same scale."""
    for s in tl.static_range(LOG_D):  # h = 2 ** s
        g = tl.permute(tl.reshape(x, [ROWS, D // (2 << s), 2, 1 << s]), [0, 1, 3, 2])
        a, b = tl.split(g)  # pairs (i, i + h) inside each group of 2h
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [ROWS, D])
    return x * SCALE


@triton.jit
def _write_half(x, sx_h, cell, data, aux, s_cell, s_head, a_cell, a_head,
                KIND: tl.constexpr, ROTATE: tl.constexpr, ROT_SCALE: tl.constexpr,
                HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_NB: tl.constexpr, LOG_D: tl.constexpr):
    """Quantize one token's K or V [HKV, HEAD_DIM] (at `x`, head stride `sx_h`) into `cell`."""
    if KIND == 1:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        hmask = offs_h < HKV
        mask = hmask[:, None] & (offs_d < HEAD_DIM)[None, :]
        xv = tl.load(x + offs_h[:, None] * sx_h + offs_d[None, :], mask=mask, other=0.0)
        _store_int8(xv.to(tl.float32), hmask, mask, cell, data, aux, s_cell, s_head, a_cell,
                    a_head, BLOCK_H, BLOCK_D)
    else:
        rows: tl.constexpr = BLOCK_H * BLOCK_NB
        offs_r = tl.arange(0, rows)
        head = offs_r // BLOCK_NB
        blk = offs_r % BLOCK_NB
        rmask = (head < HKV) & (blk < HEAD_DIM // 32)
        if ROTATE:  # HEAD_DIM is a power of two: BLOCK_D == HEAD_DIM, BLOCK_NB == HEAD_DIM // 32
            offs_h = tl.arange(0, BLOCK_H)
            offs_d = tl.arange(0, BLOCK_D)
            xv = tl.load(x + offs_h[:, None] * sx_h + offs_d[None, :],
                         mask=(offs_h < HKV)[:, None], other=0.0)
            xv = _hadamard_rows(xv.to(tl.float32), BLOCK_H, BLOCK_D, LOG_D, ROT_SCALE)
            xb = tl.reshape(xv, [rows, 32])
        else:
            xb = tl.load(x + (head * sx_h + blk * 32)[:, None] + tl.arange(0, 32)[None, :],
                         mask=rmask[:, None], other=0.0).to(tl.float32)
        _store_q4_0(xb, rmask, cell, data, aux, s_cell, s_head, a_cell, a_head, rows, BLOCK_NB)


@triton.jit
def _write_quant_kernel(
    k, v, cells, sk_t, sk_h, sv_t, sv_h,
    k_data, k_aux, k_sc, k_sh, k_ac, k_ah,
    v_data, v_aux, v_sc, v_sh, v_ac, v_ah,
    HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_NB: tl.constexpr, LOG_D: tl.constexpr, K_KIND: tl.constexpr, V_KIND: tl.constexpr,
    ROTATE_V: tl.constexpr, ROT_SCALE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cell = tl.load(cells + t).to(tl.int64)
    _write_half(k + t * sk_t, sk_h, cell, k_data, k_aux, k_sc, k_sh, k_ac, k_ah, K_KIND, False,
                ROT_SCALE, HKV, HEAD_DIM, BLOCK_H, BLOCK_D, BLOCK_NB, LOG_D)
    _write_half(v + t * sv_t, sv_h, cell, v_data, v_aux, v_sc, v_sh, v_ac, v_ah, V_KIND, ROTATE_V,
                ROT_SCALE, HKV, HEAD_DIM, BLOCK_H, BLOCK_D, BLOCK_NB, LOG_D)


def write_quantized(kh: Half, vh: Half, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    rotate_v: bool) -> None:
    """`fmt.write` of an int8, Q4_0 or k8v4 layer in one launch (k, v: [T, Hkv, D]).

    `rotate_v`: V is Hadamard-rotated before it is quantized (k8v4); it then
    must be Q4_0 with a power-of-two head dimension.
    """
    t, hkv, d = k.shape
    if t == 0:
        return
    if rotate_v and (vh.kind != Q4_0 or d & (d - 1)):
        raise ValueError("the rotation needs Q4_0 V and a power-of-two head_dim")
    if {kh.kind, vh.kind} - {INT8, Q4_0}:
        raise ValueError("write_quantized takes int8 or Q4_0 halves")
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    _write_quant_kernel[(t,)](
        k, v, cells, k.stride(0), k.stride(1), v.stride(0), v.stride(1), *kh.args(), *vh.args(),
        HKV=hkv, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(hkv),
        BLOCK_D=triton.next_power_of_2(d), BLOCK_NB=triton.next_power_of_2(max(d // 32, 1)),
        LOG_D=max(d.bit_length() - 1, 0), K_KIND=kh.kind, V_KIND=vh.kind, ROTATE_V=rotate_v,
        ROT_SCALE=d**-0.5, num_warps=4, enable_fp_fusion=False,
    )
