"""Storing a step's new K/V at its cells, for the plain formats in one launch.

torch's `index_copy_` needs one launch per run (and a cast before each when
the compute and storage dtypes differ); this kernel casts and stores K and V
of every token together. Quantized formats keep their torch quantizers
(`KvFormat.write`), whose bits the reference also reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
