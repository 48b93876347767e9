"""Products whose rows do not depend on their company: y = x @ w.T (+ bias), any number of rows.

cuBLAS picks its kernel (tile shape, split-K or not) from the number of rows,
and the one-lane path runs matrix-vector kernels on the CUDA cores, so on the
GPU a lane's logits change in their low bits with the number of lanes in the
step, and its greedy tokens part after a few steps. Here every output element
is one sum over K taken the same way at every M:

- the reduction runs over K in ascending tiles of the one `BLOCK_K`, each tile
  a `tl.dot` accumulated in float32 (the tensor cores sum each 16-wide slice of
  K the same way whatever the tile's rows and columns: `tests/gpu/test_matmul.py`
  checks it for every launch shape of `config_for`, and the MoE kernels rely on it);
- no split-K and no atomics: a program owns whole output elements;
- the launch shape (rows and columns a program covers, warps, stages) is picked
  for speed from M, which changes where a row sits in a tile but not its sum.

Rows past M are masked loads (zeros) and never stored. Float32 inputs take IEEE
dots (no TF32), so float32 compute stays as exact as on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.triton.gemv import DTYPES, INTERPRET

__all__ = ["BLOCK_K", "DTYPES", "Config", "config_for", "matmul", "takes"]

BLOCK_K = 64  # the one reduction tile: a row's sum is the same sequence of dots at every M
MULTIPLE = 16  # K must be a multiple of this (tl.dot's smallest K); BLOCK_K tails are masked
Config = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
GROUP_M = 8  # row tiles that walk the column tiles together, so a weight tile is reused from L2


def config_for(m: int, n: int, dtype: torch.dtype) -> Config:
    """The launch shape for m rows and n columns: narrow column tiles for few rows, so every
    multiprocessor streams its share of the weights; large tiles for prompt reading."""
    if dtype == torch.float32:
        return (16, 32, 4, 3) if m <= 16 else (64, 64, 4, 3)
    if m <= 16:
        return 16, 64 if n >= 16384 else 32, 4, 6
    if m <= 64:
        return 64, 64, 4, 6
    if m <= 256:
        return 64, 128, 4, 4
    return 128, 128, 8, 4


@triton.jit
def _matmul_kernel(x, w, bias, y, M, N, K, sx, sw, sy,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP * tiles_n
    first_m = (pid // in_group) * GROUP
    group = tl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % in_group) % group
    pid_n = (pid % in_group) // group
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    xp = x + rm.to(tl.int64)[:, None] * sx + rk[None, :]
    wp = w + rn.to(tl.int64)[None, :] * sw + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kmask = (k + rk) < K
        a = tl.load(xp, mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(wp, mask=nmask[None, :] & kmask[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        xp += BLOCK_K
        wp += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    yp = y + rm.to(tl.int64)[:, None] * sy + rn[None, :]
    tl.store(yp, acc.to(y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `matmul` takes x [M, K] against w [N, K]: CUDA (or the CPU under the
    interpreter), one dtype of DTYPES, unit stride along K, K a multiple of MULTIPLE."""
    if not (x.is_cuda or (INTERPRET and x.device.type == "cpu")):
        return False
    return (x.dim() == 2 and w.dim() == 2 and x.dtype in DTYPES and w.dtype == x.dtype
            and w.device == x.device and x.shape[1] == w.shape[1] and x.shape[1] % MULTIPLE == 0
            and x.stride(1) == 1 and w.stride(1) == 1)


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, config: Config | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) -> [M, N] in out_dtype (default x's dtype), summed in
    float32 and rounded once. `config` overrides the launch shape (sweeps and tests)."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, warps, stages = config or config_for(m, n, x.dtype)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _matmul_kernel[grid](
        x, w, bias if bias is not None else w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, GROUP=GROUP_M, HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )
    return y
