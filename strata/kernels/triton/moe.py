"""Fused mixture-of-experts layers on the GPU: each token's k experts, read once per block.

A MoE layer sends each token to k of E experts (SwiGLU MLPs). Looping over
experts in torch costs a launch per expert and reads every weight even for
one token; here the (token, slot) pairs are grouped by expert on the device
(`align`, no host synchronisation, fixed sizes: CUDA-graph safe) into blocks
of BLOCK_M pairs of one expert, and one program per (block, tile of output
columns) reads that expert's weight tile once for all its pairs:

- `expert_gate_up`: act = silu(x @ gate[e].T) * (x @ up[e].T), gate and up
  read by the same program;
- `expert_down`: y = act @ down[e].T, one row per pair;
- `combine`: out[t] = sum of y[t, j] * w[t, j] over the slots in ascending
  expert order (Hugging Face's `index_add_` over experts);
- `moe`: the four.

Rounding is that of the dense path (gemv.py): each product is summed in
float32 and rounded to the dtype, silu(g) = g / (1 + exp(-g)) rounded before
the multiply with u, which is rounded; combine rounds each weighted term and
each partial sum. Exactness: every output row is a sum over K in ascending
tiles of the one BLOCK_K, each tile a `tl.dot` of one fixed shape per launch
config, accumulated in float32 (no split-K, no atomics). A row's value thus
depends on its own inputs and the config only: not on the other tokens of
the launch, their number, or where in its block the row lands. The launch
rule picks other tile shapes (BLOCK_M, BLOCK_N) for more tokens, which keeps
the order over K; that the tensor cores then give the same bits is what
tests/gpu/test_moe_kernels.py's batch-invariance test checks on the device.

The GGUF-block variant (`moe_blocks.py`) runs these same kernels with the
weight tile decoded from the blocks in column order (QT > 0), so with the
same config it equals this path on the weights dequantized to x's dtype.

Launch shapes come from `CONFIGS` (empty until measured) or `default_config`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from strata.kernels.triton.blocks_decode import decode
from strata.kernels.triton.gemv import DTYPES, INTERPRET
from strata.kernels.triton.numerics import exp

__all__ = ["CONFIGS", "Aligned", "HostCopies", "Mapped", "align", "combine", "distance", "expert_down",
           "expert_gate_up", "moe", "takes"]

BLOCK_K = 128  # the one reduction tile: whole Q6_K halves, Q4_K / Q5_K group pairs, 4 Q8_0 blocks
MULTIPLE = 16  # H and I must be multiples of this
Config = tuple[int, int, int, int, int]  # (BLOCK_M, BLOCK_N gate/up, BLOCK_N down, warps, stages)
# (T bucket, E, H, I) -> Config, measured on an H200 (benchmarks/moe_kernel_bench.py); buckets
# from `t_bucket`. Shapes not here take `default_config`'s rule.
CONFIGS: dict[tuple[int, int, int, int], Config] = {}
# the type constants of the block kernels for plain weights (QT 0)
DENSE_TYPE = dict(QT=0, BLOCK=1, GPB=1, E=1, PARTS=1, NG=1, RS=0, OQ=0, SQ=0, OH=0, SH=0,
                  OSC=0, SSC=0, OD=0, SD=0, OM=0, SM=0)


class Aligned(NamedTuple):
    """The (token, slot) pairs grouped by expert in blocks of block_m (`align`)."""

    rows: torch.Tensor  # int32 [P]: flat pair index t * k + j, T * k for padding
    block_expert: torch.Tensor  # int32 [P // block_m]: each block's expert, -1 past `used`
    used: torch.Tensor  # int32 [1]: the padded length in use
    block_m: int


class Mapped(NamedTuple):
    """Experts read from device slots, or, for an expert without a slot, straight from its
    copy in pinned host memory (mapped into the device's address space: read over the bus,
    no copy, no host decision in the step, so it can be captured in a CUDA graph)."""

    table: torch.Tensor  # int [E] on the device: expert -> slot, -1 where it is read from the host
    w: int  # the host copy of the weights minus the slots, in elements (bytes for blocks)
    u: int  # the same for the up weights (gate/up), else 0


class HostCopies(NamedTuple):
    """Every expert's weights in pinned host memory, laid out as the weights `moe` / `moe_blocks`
    are given (there: device slots), and the table of which expert which slot holds."""

    table: torch.Tensor  # int [E] on the device: expert -> slot, -1 where it is read from the host
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def mapped(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> tuple[Mapped, Mapped]:
        """The gate/up and the down launches' `Mapped` for these slots."""
        return (Mapped(self.table, distance(self.gate, gate), distance(self.up, up)),
                Mapped(self.table, distance(self.down, down), 0))


def distance(host: torch.Tensor, slots: torch.Tensor) -> int:
    """host's address minus slots', in slots' elements (`Mapped`): the kernels add it to a row's
    offset to read it from the host copy instead."""
    gap = host.data_ptr() - slots.data_ptr()
    if gap % slots.element_size() or host.dtype != slots.dtype:
        raise ValueError(f"distance: host {host.dtype} at {host.data_ptr():#x} and slots "
                         f"{slots.dtype} at {slots.data_ptr():#x} are not whole elements apart")
    return gap // slots.element_size()


def padded_length(pairs: int, num_experts: int, block_m: int) -> int:
    """P: room for every expert's pairs padded to block_m (at most min(E, pairs) experts occur)."""
    return triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m


@triton.jit
def _align_kernel(ids, rows, block_expert, used, n, P, NUM_E: tl.constexpr, EP: tl.constexpr,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, N_MAX: tl.constexpr,
                  P_MAX: tl.constexpr):
    """One program: count pairs per expert, place each pair after its expert's earlier ones
    (so in flat order), write the padding sentinels and each block's expert. Every position
    of rows is written exactly once, so no ordering between the writes is needed. The loops
    run to the bounds N_MAX >= n and P_MAX >= P (powers of two of n: few compilations)."""
    ex = tl.arange(0, EP)
    counts = tl.zeros([EP], tl.int32)
    for c0 in range(0, N_MAX, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        e = tl.load(ids + i, mask=i < n, other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == ex[None, :]).to(tl.int32), 0)
    end = tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    total = tl.max(end, 0)
    start = end - (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(used, total)
    seen = tl.zeros([EP], tl.int32)
    for c0 in range(0, N_MAX, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        e = tl.load(ids + i, mask=i < n, other=-1).to(tl.int32)
        hit = (e[:, None] == ex[None, :]).to(tl.int32)
        before = seen[None, :] + tl.cumsum(hit, 0) - hit
        dest = tl.sum(hit * (start[None, :] + before), 1)
        tl.store(rows + dest, i, mask=(i < n) & (tl.sum(hit, 1) > 0))
        seen += tl.sum(hit, 0)
    pad = (start + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(rows + pad, n, mask=pad < end[:, None])
    for p0 in range(0, P_MAX, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        tl.store(rows + p, n, mask=(p >= total) & (p < P))
    for b0 in range(0, P_MAX // BLOCK_M, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        e_of = tl.sum((end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(block_expert + b, tl.where(e_of < NUM_E, e_of, -1), mask=b < P // BLOCK_M)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Aligned:
    """Group the pairs of topk_ids ([T, k], int32 / int64 indices < num_experts) by expert in
    blocks of block_m, stable within an expert, in one launch with no host synchronisation.

    P = `padded_length(T * k, num_experts, block_m)`: the output sizes depend on the shapes
    only, so the call can be captured in a CUDA graph.
    """
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"align: topk_ids must be int32 / int64 [T, k], got "
                         f"{tuple(topk_ids.shape)} {topk_ids.dtype}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"align: block_m must be a power of two >= 16, got {block_m}")
    ids = topk_ids.contiguous()
    n = ids.numel()
    p = padded_length(n, num_experts, block_m)
    dev = ids.device
    rows = torch.empty(p, dtype=torch.int32, device=dev)
    block_expert = torch.empty(p // block_m, dtype=torch.int32, device=dev)
    used = torch.empty(1, dtype=torch.int32, device=dev)
    ep = triton.next_power_of_2(max(num_experts, 2))
    n_max = triton.next_power_of_2(max(n, 16))
    _align_kernel[(1,)](ids, rows, block_expert, used, n, p, NUM_E=num_experts, EP=ep,
                        BLOCK_M=block_m, CHUNK=max(16, min(256, 8192 // ep)), N_MAX=n_max,
                        P_MAX=padded_length(n_max, num_experts, block_m), num_warps=4)
    return Aligned(rows, block_expert, used, block_m)


@triton.jit
def _block_tile(b, h, rb, k0, QT: tl.constexpr, GPB: tl.constexpr, E: tl.constexpr,
                OQ: tl.constexpr, SQ: tl.constexpr, OH: tl.constexpr, SH: tl.constexpr,
                OSC: tl.constexpr, SSC: tl.constexpr, OD: tl.constexpr, SD: tl.constexpr,
                OM: tl.constexpr, SM: tl.constexpr, NG: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 weights [BLOCK_N, BLOCK_K] of columns k0 .. k0 + BLOCK_K of the rows at byte
    offsets rb, in column order: both parts decoded at once, then interleaved as `column`
    lays them out (Q8_0: 32 g + e; Q6_K: 128 half + 64 hi + 16 j + e; others 2E g + E hi + e)."""
    if QT == 8:
        g = k0 // 32 + tl.arange(0, BLOCK_K // 32)[None, :, None]
        e = tl.arange(0, 32)[None, None, :]
        w0, w1 = decode(b, h, rb[:, None, None], g, e, g < NG, QT, GPB, E, OQ, SQ, OH, SH,
                        OSC, SSC, OD, SD, OM, SM)
        w = tl.reshape(w0, (BLOCK_N, BLOCK_K))
    elif QT == 14:
        half = k0 // 128 + tl.arange(0, BLOCK_K // 128)
        g = half[None, :, None, None] * 4 + tl.arange(0, 4)[None, None, :, None]
        e = tl.arange(0, 16)[None, None, None, :]
        w0, w1 = decode(b, h, rb[:, None, None, None], g, e, g < NG, QT, GPB, E, OQ, SQ, OH,
                        SH, OSC, SSC, OD, SD, OM, SM)
        w = tl.reshape(tl.permute(tl.join(w0, w1), (0, 1, 4, 2, 3)), (BLOCK_N, BLOCK_K))
    else:
        g = k0 // (2 * E) + tl.arange(0, BLOCK_K // (2 * E))[None, :, None]
        e = tl.arange(0, E)[None, None, :]
        w0, w1 = decode(b, h, rb[:, None, None], g, e, g < NG, QT, GPB, E, OQ, SQ, OH, SH,
                        OSC, SSC, OD, SD, OM, SM)
        w = tl.reshape(tl.permute(tl.join(w0, w1), (0, 1, 3, 2)), (BLOCK_N, BLOCK_K))
    return w


@triton.jit
def _weights(w, h, row, off, k0, K: tl.constexpr, dt: tl.constexpr, QT: tl.constexpr,
             GPB: tl.constexpr, E: tl.constexpr, OQ: tl.constexpr, SQ: tl.constexpr,
             OH: tl.constexpr, SH: tl.constexpr, OSC: tl.constexpr, SSC: tl.constexpr,
             OD: tl.constexpr, SD: tl.constexpr, OM: tl.constexpr, SM: tl.constexpr,
             NG: tl.constexpr, RS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] of rows `row` in x's dtype: loaded (QT 0), or
    decoded and each value rounded once from float32, as blocks.block_mm feeds tl.dot. `off`:
    where the rows are read from, relative to w (elements; bytes for blocks): 0, or a mapped
    host copy's distance (`Mapped`)."""
    if QT == 0:
        kk = k0 + tl.arange(0, BLOCK_K)
        if K % BLOCK_K == 0:
            t = tl.load(w + off + row[:, None] * K + kk[None, :])
        else:
            t = tl.load(w + off + row[:, None] * K + kk[None, :], mask=(kk < K)[None, :], other=0.0)
    else:
        t = _block_tile(w, h, row * RS + off, k0, QT, GPB, E, OQ, SQ, OH, SH, OSC, SSC, OD, SD, OM, SM,
                        NG, BLOCK_N, BLOCK_K).to(dt)
    return t


@triton.jit
def _expert_kernel(
    x, w, wh, u, uh, out, rows, block_expert, pairs, table, w_host, u_host, N: tl.constexpr,
    K: tl.constexpr, TOP_K: tl.constexpr, GATHER: tl.constexpr, SILU: tl.constexpr, MAPPED: tl.constexpr,
    QT: tl.constexpr, BLOCK: tl.constexpr, GPB: tl.constexpr, E: tl.constexpr, PARTS: tl.constexpr,
    NG: tl.constexpr, RS: tl.constexpr, OQ: tl.constexpr, SQ: tl.constexpr, OH: tl.constexpr,
    SH: tl.constexpr, OSC: tl.constexpr, SSC: tl.constexpr, OD: tl.constexpr, SD: tl.constexpr,
    OM: tl.constexpr, SM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """Rows of block program_id(0) (all of one expert) times N-tile program_id(1) of that
    expert's weights (rows expert * N + n). GATHER: input row of pair r is x[r // TOP_K]
    (gate/up), else x[r] (down). SILU: silu(x @ w.T) * (x @ u.T), else x @ w.T.
    MAPPED: w and u are device slots; table[expert] is the expert's slot, or -1 for one read
    where it lies in host memory, w_host / u_host (elements, bytes for blocks) past w / u."""
    ex = tl.load(block_expert + tl.program_id(0))
    if ex >= 0:
        at = ex.to(tl.int64)
        w_off = 0
        u_off = 0
        if MAPPED:
            slot = tl.load(table + ex)
            at = tl.where(slot >= 0, slot, ex).to(tl.int64)
            w_off = tl.where(slot >= 0, 0, w_host).to(tl.int64)
            u_off = tl.where(slot >= 0, 0, u_host).to(tl.int64)
        r = tl.load(rows + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
        r_ok = r < pairs
        src = tl.where(r_ok, r // TOP_K if GATHER else r, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        row = at * N + tl.where(n_ok, n, 0)
        dt = x.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if SILU:
            acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x + src[:, None] * K + kk[None, :], mask=r_ok[:, None] & (kk < K)[None, :],
                         other=0.0)
            wt = _weights(w, wh, row, w_off, k0, K, dt, QT, GPB, E, OQ, SQ, OH, SH, OSC, SSC, OD, SD,
                          OM, SM, NG, RS, BLOCK_N, BLOCK_K)
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PRECISION)
            if SILU:
                ut = _weights(u, uh, row, u_off, k0, K, dt, QT, GPB, E, OQ, SQ, OH, SH, OSC, SSC, OD,
                              SD, OM, SM, NG, RS, BLOCK_N, BLOCK_K)
                acc2 = tl.dot(xt, tl.trans(ut), acc2, input_precision=PRECISION)
        y = acc.to(dt).to(tl.float32)
        if SILU:
            y = tl.math.div_rn(y, 1.0 + exp(-y)).to(dt).to(tl.float32) * acc2.to(dt).to(tl.float32)
        tl.store(out + r.to(tl.int64)[:, None] * N + n[None, :], y.to(dt),
                 mask=r_ok[:, None] & n_ok[None, :])


def launch_experts(x: torch.Tensor, w: torch.Tensor, u: torch.Tensor | None, aligned: Aligned,
                   top_k: int, n: int, gather: bool, type_args: dict, block_n: int, warps: int,
                   stages: int, mapped: Mapped | None = None) -> torch.Tensor:
    """[pairs, n] in x's dtype from `_expert_kernel` (u: the up weights, with silu; mapped: w and
    u are slots, experts without one read from the host)."""
    pairs = x.shape[0] * top_k if gather else x.shape[0]
    out = torch.empty((pairs, n), dtype=x.dtype, device=x.device)
    half = (lambda t: t.view(torch.float16)) if type_args["QT"] else (lambda t: t)
    grid = (aligned.block_expert.numel(), triton.cdiv(n, block_n))
    _expert_kernel[grid](
        x, w, half(w), u if u is not None else w, half(u if u is not None else w), out,
        aligned.rows, aligned.block_expert, pairs, mapped.table if mapped else aligned.used,
        mapped.w if mapped else 0, mapped.u if mapped else 0, N=n, K=x.shape[1], TOP_K=top_k,
        GATHER=gather, SILU=u is not None, MAPPED=mapped is not None, **type_args, BLOCK_M=aligned.block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps,
        num_stages=stages,
    )
    return out


def t_bucket(tokens: int) -> int:
    """1 (one-lane decode), 16, 64 (batched decode), 512 (prompts)."""
    return 1 if tokens <= 1 else 16 if tokens <= 16 else 64 if tokens <= 64 else 512


def default_config(tokens: int, e: int, h: int, i: int, top_k: int, dtype: torch.dtype) -> Config:
    """CONFIGS[(bucket, E, H, I) + key] if measured, else: blocks of 16 pairs while experts see
    16 pairs or fewer on average (decode: weight traffic dominates, padding is cheap), else 64;
    narrow column tiles for few pairs so every SM streams weights; as many stages as fit."""
    from_table = CONFIGS.get((t_bucket(tokens), e, h, i))
    if from_table is not None:
        return from_table
    per_expert = tokens * top_k / max(1, e)
    block_m = 16 if per_expert <= 16 else 64
    bn = 32 if tokens <= 16 else 64
    stage_bytes = (block_m + 2 * bn) * BLOCK_K * dtype.itemsize
    return block_m, bn, 2 * bn, 4, max(1, min(3, (160 << 10) // stage_bytes))


def _weight_ok(x: torch.Tensor, w: torch.Tensor, k: int) -> bool:
    """A contiguous [E, N, k] weight of x's dtype and device, N a multiple of MULTIPLE."""
    return (w.dim() == 3 and w.dtype == x.dtype and w.device == x.device and w.is_contiguous()
            and w.shape[1] % MULTIPLE == 0 and w.shape[2] == k)


def takes(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the kernels take x [T, H] and these expert weights (gate, up [E, I, H], down
    [E, H, I], or a leading part of that list): on CUDA (or the CPU under the interpreter),
    of one dtype of DTYPES, contiguous, H and I multiples of MULTIPLE."""
    if not (x.is_cuda or (INTERPRET and x.device.type == "cpu")):
        return False
    if x.dtype not in DTYPES or x.dim() != 2 or not x.is_contiguous() or x.shape[1] % MULTIPLE:
        return False
    if not all(_weight_ok(x, w, x.shape[1]) for w in weights[:2]):
        return False
    if len(weights) > 1 and weights[1].shape != weights[0].shape:
        return False
    if len(weights) > 2:
        e, i, h = weights[0].shape
        d = weights[2]
        return d.shape == (e, h, i) and _weight_ok(x, d, i)
    return True


def _check(x: torch.Tensor, name: str, *weights: torch.Tensor) -> None:
    if not takes(x, *weights):
        raise ValueError(f"{name}: the kernels do not take x {tuple(x.shape)} {x.dtype} on "
                         f"{x.device} with weights " + ", ".join(
                             f"{tuple(w.shape)} {w.dtype}" for w in weights))


def expert_gate_up(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, aligned: Aligned,
                   top_k: int, *, block_n: int = 32, warps: int = 4, stages: int = 2,
                   mapped: Mapped | None = None) -> torch.Tensor:
    """act [T * k, I]: row t * k + j = silu(x[t] @ gate[e].T) * (x[t] @ up[e].T), e the pair's
    expert (topk_ids[t, j]); x [T, H], gate and up [E, I, H], all of one dtype (mapped: gate and
    up are [slots, I, H], experts without a slot read from their host copies)."""
    _check(x, "expert_gate_up", gate, up)
    return launch_experts(x, gate, up, aligned, top_k, gate.shape[1], True, DENSE_TYPE,
                          block_n, warps, stages, mapped)


def expert_down(act: torch.Tensor, down: torch.Tensor, aligned: Aligned, top_k: int, *,
                block_n: int = 64, warps: int = 4, stages: int = 2,
                mapped: Mapped | None = None) -> torch.Tensor:
    """y [T * k, H]: row r = act[r] @ down[e].T for the pair's expert e; down [E, H, I]."""
    if not (takes(act) and _weight_ok(act, down, act.shape[1])):
        raise ValueError(f"expert_down: down {tuple(down.shape)} {down.dtype} for act "
                         f"{tuple(act.shape)} {act.dtype} on {act.device}")
    return launch_experts(act, down, None, aligned, top_k, down.shape[1], False, DENSE_TYPE,
                          block_n, warps, stages, mapped)


@triton.jit
def _mul_rn(a, b):
    return libdevice.mul_rn(a, b)  # never fused into the add that follows


@triton.jit
def _mul_numpy(a, b):
    return a * b


_mul = _mul_numpy if INTERPRET else _mul_rn


@triton.jit
def _combine_kernel(y, ids, wts, out, H: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    """Token program_id(0), columns of tile program_id(1): the slots in ascending id order."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, KP)
    e = tl.load(ids + t * TOP_K + j, mask=j < TOP_K, other=2**30)
    rank = tl.sum((e[None, :] < e[:, None]).to(tl.int32), 1)  # slots with a smaller id
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dt = y.dtype.element_ty
    acc = tl.zeros([BLOCK_H], tl.float32)
    for r in tl.static_range(TOP_K):
        s = tl.sum(tl.where(rank == r, j, 0), 0)
        wt = tl.load(wts + t * TOP_K + s).to(tl.float32)
        v = tl.load(y + (t * TOP_K + s) * H + c, mask=c < H, other=0.0).to(tl.float32)
        term = _mul(v, wt).to(dt).to(tl.float32)
        acc = term if r == 0 else (acc + term).to(dt).to(tl.float32)
    tl.store(out + t * H + c, acc.to(dt), mask=c < H)


def combine(y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """out [T, H]: out[t] = sum of round(y[t * k + j] * w[t, j]) over the slots in ascending
    id order, rounded after each addition (ids distinct per token); y [T * k, H] or [T, k, H],
    w [T, k] in y's dtype."""
    t, k = topk_ids.shape
    if y.dim() == 3 and y.shape[:2] == (t, k):
        y = y.reshape(t * k, y.shape[2])
    if y.dim() != 2 or y.shape[0] != t * k or not y.is_contiguous() \
            or topk_weights.shape != (t, k) or topk_weights.dtype != y.dtype:
        raise ValueError(f"combine: y {tuple(y.shape)} {y.dtype}, ids {tuple(topk_ids.shape)}, "
                         f"weights {tuple(topk_weights.shape)} {topk_weights.dtype}")
    h = y.shape[1]
    out = torch.empty((t, h), dtype=y.dtype, device=y.device)
    bh = min(1024, triton.next_power_of_2(h))
    _combine_kernel[(t, triton.cdiv(h, bh))](
        y, topk_ids.contiguous(), topk_weights.contiguous(), out, H=h, TOP_K=k,
        KP=triton.next_power_of_2(max(k, 2)), BLOCK_H=bh, num_warps=4)
    return out


def moe(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
        topk_ids: torch.Tensor, topk_weights: torch.Tensor, block_m: int | None = None, *,
        config: Config | None = None, host: HostCopies | None = None) -> torch.Tensor:
    """out [T, H] of the experts topk_ids [T, k] chose, weighted by topk_weights (x's dtype):
    align, expert_gate_up, expert_down, combine. block_m or config override the launch rule.
    host: gate, up and down are device slots, and every expert is read from its slot or from
    its host copy (`--expert-misses mapped`)."""
    _check(x, "moe", gate, up, down)
    _, i, h = gate.shape
    e = int((host.gate if host is not None else gate).shape[0])
    k = topk_ids.shape[1]
    bm, bn_gu, bn_d, warps, stages = config or default_config(x.shape[0], e, h, i, k, x.dtype)
    aligned = align(topk_ids, e, block_m or bm)
    m_gu, m_d = host.mapped(gate, up, down) if host is not None else (None, None)
    act = launch_experts(x, gate, up, aligned, k, i, True, DENSE_TYPE, bn_gu, warps, stages, m_gu)
    y = launch_experts(act, down, None, aligned, k, h, False, DENSE_TYPE, bn_d, warps, stages, m_d)
    return combine(y, topk_ids, topk_weights)
