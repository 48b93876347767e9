"""Copying a layer's missed blocks host -> device cache in one launch (zero-copy reads of pinned memory).

A streamed step copies every missed block of a layer from the pinned host
store into the device block cache (attention/triton_stream.py). One `copy_` per run of
blocks costs several microseconds of host time each and a step issues
thousands; this kernel does a layer's copies in ONE launch: it reads the
pinned host store directly, through unified virtual addressing (a pinned
allocation's address is valid on the device; Triton's launcher accepts it,
since `cuPointerGetAttribute(DEVICE_POINTER)` succeeds on it and returns the
same address), and writes the cache rows.

What to copy is a small device array of (source block, destination block)
pairs, uploaded with the step's metadata. Each run of the format (k, v, or
codes and scales) is passed as a host view and a cache view of whole blocks
in words (`block_words`): int32 words where a block's bytes allow, else
bytes, so the copy is a byte copy, exact for every dtype. Up to `MAX_RUNS`
runs go into one launch; a program copies one tile of one run of one pair
per iteration, and a fixed number of programs (`programs`) loop over all
tiles, so the copy leaves most of the multiprocessors to the compute stream
(it is bound by PCIe latency and bandwidth, not by the SMs).

Under Triton's interpreter the "host" and "device" tensors are both CPU
tensors: the same index arithmetic, checked by tests/attention/test_triton_stream.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.knobs import knob

MAX_RUNS = 4  # runs of a format copied by one launch (the int8 format has 4: codes and scales of K, V)
TILE = 2048  # words a program copies per iteration (8 KiB of int32)


@triton.jit
def _tile(src, dst, w, s_blk, d_blk, j, TILE: tl.constexpr):
    offs = j.to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offs < w
    x = tl.load(src + s_blk * w + offs, mask=mask)
    tl.store(dst + d_blk * w + offs, x, mask=mask)


@triton.jit
def _gather_kernel(
    pairs, n_items, s0, d0, s1, d1, s2, d2, s3, d3, w0, w1, w2, w3, t1, t2, t3, tiles,
    NR: tl.constexpr, TILE: tl.constexpr,
):
    """Item it = pair * tiles + j: tile j of that pair's block, over the runs' tiles in order
    (run r has tiles [t_r, t_{r+1}), t_0 = 0)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    for it in range(pid, n_items, step):
        i = it // tiles
        j = it % tiles
        s_blk = tl.load(pairs + 2 * i).to(tl.int64)
        d_blk = tl.load(pairs + 2 * i + 1).to(tl.int64)
        if j < t1:
            _tile(s0, d0, w0, s_blk, d_blk, j, TILE)
        if NR > 1:  # noqa: SIM102 - a constexpr test, then a runtime one
            if (j >= t1) & (j < t2):
                _tile(s1, d1, w1, s_blk, d_blk, j - t1, TILE)
        if NR > 2:  # noqa: SIM102
            if (j >= t2) & (j < t3):
                _tile(s2, d2, w2, s_blk, d_blk, j - t2, TILE)
        if NR > 3:  # noqa: SIM102
            if j >= t3:
                _tile(s3, d3, w3, s_blk, d_blk, j - t3, TILE)


def block_words(t: torch.Tensor, block: int) -> torch.Tensor | None:
    """[rows // block, words] view of a contiguous [rows, ...] tensor: whole blocks in int32 words
    where a block's bytes and the address allow, else bytes; None if `t` is not contiguous."""
    if not t.is_contiguous():
        return None
    n = t.shape[0] // block
    b = t[: n * block].reshape(-1).view(torch.uint8)
    per = b.numel() // max(n, 1)
    if per % 4 == 0 and b.data_ptr() % 4 == 0:
        b = b.view(torch.int32)
        per //= 4
    return b.view(n, per)


def default_programs(device: torch.device) -> int:
    """Programs of a launch: STRATA_GATHER_PROGRAMS, else one per multiprocessor (4 off CUDA)."""
    forced = knob("STRATA_GATHER_PROGRAMS")
    if forced:
        return int(forced)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def gather_blocks(pairs: torch.Tensor, srcs: list[torch.Tensor], dsts: list[torch.Tensor],
                  programs: int, tile: int = TILE) -> None:
    """dsts[r][d] = srcs[r][s] for every row (s, d) of `pairs` [n, 2] (int64 or int32) and run r.

    srcs[r] and dsts[r] are `block_words` views of the same word type and width
    (a run's host store and device cache); one launch on the current stream. `tile`
    (a power of two) is for tests: smaller tiles split a block into several.
    """
    n = pairs.shape[0]
    nr = len(srcs)
    assert 1 <= nr <= MAX_RUNS and len(dsts) == nr
    if n == 0:
        return
    widths = [s.shape[1] for s in srcs]
    for s, d in zip(srcs, dsts):
        assert s.dtype == d.dtype and s.shape[1] == d.shape[1], (s.shape, d.shape)
    starts = [0]
    for w in widths:
        starts.append(starts[-1] + -(-w // tile))
    tiles = starts[-1]
    starts += [tiles] * (MAX_RUNS + 1 - len(starts))
    ptr = [x for r in range(MAX_RUNS) for x in ((srcs[r], dsts[r]) if r < nr else (srcs[0], dsts[0]))]
    ws = widths + [widths[0]] * (MAX_RUNS - nr)
    items = n * tiles
    _gather_kernel[(min(items, programs),)](
        pairs, items, *ptr, *ws, starts[1], starts[2], starts[3], tiles,
        NR=nr, TILE=tile, num_warps=4,
    )
