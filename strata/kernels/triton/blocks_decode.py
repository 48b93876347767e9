"""GGUF block types as the block kernels (`blocks.py`) read them: byte layouts, `pack`, decoders.

A row of weights is the file's blocks of that row, back to back (`raw`), or
the same bytes regrouped by `pack` into planes (`packed`): for each field of
the block (quants, high bits, sub-scales, d, dmin / m), that field of every
block of the row, in block order, largest field first. Nothing is added or
converted, so a packed row has exactly the file's bytes, and packing is row
by row (rows can be sliced before or after). The planes start at multiples
of 16 bytes for rows of 256 values or more (the raw Q8_0, Q4_0 and Q6_K
blocks leave the quants 2-byte aligned), so the quants load as wide vectors.

Either way a field's byte j of block b in a row sits at `start + b * stride + j`,
(field offset, block size) raw and (plane offset, field size) packed, which
is all a kernel needs to know (`Layout`).

Every decoder returns ggml's float32 value of each weight: fp16 d and dmin
converted exactly, sub-scales formed as ggml forms them (`d * sc`, `dmin * m`),
then one multiply and at most one add. Each product of a scale and a quant
is exact in float32 (at most 11 + 7 + 5 significant bits), so a fused
multiply-add rounds exactly as ggml's multiply then add.

A tile is seen as scale groups of E values and two parts, lo and hi (the low
and high nibbles of the same bytes; Q8_0 has one): element e of group g of a
part reads byte `g * E + e` of the row's quants, its scale from group g, and
stands for column `column(g, e, hi)` of the row. The kernels lay rows, groups
and elements over the dimensions of their tiles as they like; the decoders
only broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

# field roles in kernel argument order: quants, high bits, sub-scales, d, dmin (or m)
ROLES = ("q", "h", "sc", "d", "m")


@dataclass(frozen=True)
class BlockType:
    """One GGUF block type as the kernels see it."""

    block: int  # values per block
    size: int  # bytes per block
    group: int  # E: values of one part that share a scale
    groups: int  # scale groups of one part per block
    parts: int  # 2 where a byte holds two values (lo and hi nibble), else 1
    fields: dict[str, tuple[int, int]]  # role -> [start, stop) bytes in the block


TYPES: dict[int, BlockType] = {
    T.Q4_K: BlockType(256, 144, 32, 4, 2, {"d": (0, 2), "m": (2, 4), "sc": (4, 16), "q": (16, 144)}),
    T.Q6_K: BlockType(256, 210, 16, 8, 2, {"q": (0, 128), "h": (128, 192), "sc": (192, 208),
                                           "d": (208, 210)}),
    T.Q8_0: BlockType(32, 34, 32, 1, 1, {"d": (0, 2), "q": (2, 34)}),
    T.Q5_K: BlockType(256, 176, 32, 4, 2, {"d": (0, 2), "m": (2, 4), "sc": (4, 16), "h": (16, 48),
                                           "q": (48, 176)}),
    T.Q4_0: BlockType(32, 18, 16, 1, 2, {"d": (0, 2), "q": (2, 18)}),
    T.Q4_1: BlockType(32, 20, 16, 1, 2, {"d": (0, 2), "m": (2, 4), "q": (4, 20)}),
    T.Q5_0: BlockType(32, 22, 16, 1, 2, {"d": (0, 2), "h": (2, 6), "q": (6, 22)}),
    T.Q5_1: BlockType(32, 24, 16, 1, 2, {"d": (0, 2), "m": (2, 4), "h": (4, 8), "q": (8, 24)}),
}
SUPPORTED: tuple[int, ...] = tuple(int(t) for t in TYPES)


def takes(qtype: int) -> bool:
    """Whether the block kernels read this gguf.GGMLQuantizationType value."""
    return qtype in TYPES


def _plane_order(bt: BlockType) -> list[str]:
    """Fields largest first (ties in block order), so the big planes start aligned."""
    return sorted(bt.fields, key=lambda r: (-(bt.fields[r][1] - bt.fields[r][0]), bt.fields[r][0]))


def layout(qtype: int, blocks_per_row: int, packed: bool) -> tuple[int, ...]:
    """(start, stride) per role of ROLES, flattened: byte j of block b of a field sits at
    `start + b * stride + j` of the row (0, 0 for fields the type lacks)."""
    bt = TYPES[qtype]
    out = {r: (0, 0) for r in ROLES}
    if packed:
        at = 0
        for r in _plane_order(bt):
            a, b = bt.fields[r]
            out[r] = (at, b - a)
            at += (b - a) * blocks_per_row
    else:
        out.update({r: (a, bt.size) for r, (a, _) in bt.fields.items()})
    return tuple(v for r in ROLES for v in out[r])


def pack(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """The rows of `blocks` (uint8 [N, blocks_per_row * size], the file's bytes) with each
    field gathered into a plane (module docstring): the same bytes, another order."""
    bt = TYPES[qtype]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % bt.size:
        raise ValueError(f"pack takes uint8 rows of whole {T(qtype).name} blocks of {bt.size} "
                         f"bytes: got {tuple(blocks.shape)} {blocks.dtype}")
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, bt.size)
    planes = [b[:, :, slice(*bt.fields[r])].reshape(n, -1) for r in _plane_order(bt)]
    return torch.cat(planes, dim=1)



def unpack(packed: torch.Tensor, qtype: int) -> torch.Tensor:
    """The file's block layout back from `pack`'s planes (the inverse, byte for byte)."""
    bt = TYPES[qtype]
    n = packed.shape[0]
    nb = packed.shape[1] // bt.size
    out = torch.empty((n, nb, bt.size), dtype=torch.uint8, device=packed.device)
    at = 0
    for r in _plane_order(bt):
        a, b = bt.fields[r]
        out[:, :, a:b] = packed[:, at : at + nb * (b - a)].reshape(n, nb, b - a)
        at += nb * (b - a)
    return out.reshape(n, -1)

@triton.jit
def _f32(u, bias: tl.constexpr):
    """u - bias in float32 for ints 0 <= u < 2**23, exact: 2**23 + u has u in its low bits."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)


@triton.jit
def _byte(b, at, ok):
    return tl.load(b + at, mask=ok, other=0).to(tl.int32)


@triton.jit
def _half(h, at, ok):
    """The fp16 at (even) byte offset `at`, as float32 (exact)."""
    return tl.load(h + at // 2, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _k4_scale(b, at, j, ok):
    """Sub-block j's 6-bit scale and min from the 12 packed bytes at `at` (ggml's get_scale_min_k4)."""
    lo = j < 4
    sj = _byte(b, at + j, ok)
    s4 = _byte(b, at + j + 4, ok)
    sm = _byte(b, at + (j % 4), ok)  # the byte below for j >= 4
    sc = tl.where(lo, sj & 63, (s4 & 15) | ((sm >> 6) << 4))
    mn = tl.where(lo, s4 & 63, (s4 >> 4) | ((sj >> 6) << 4))
    return sc, mn


@triton.jit
def column(g, e, HI: tl.constexpr, QT: tl.constexpr, BLOCK: tl.constexpr, GPB: tl.constexpr):
    """The row column of element e of scale group g of part HI (module docstring)."""
    blk = g // GPB
    gb = g % GPB
    if QT == 8:  # Q8_0
        c = blk * 32 + e
    elif QT == 12 or QT == 13:  # Q4_K, Q5_K: 32 bytes hold values 64p + l (lo) and + 32 (hi)
        c = blk * 256 + gb * 64 + HI * 32 + e
    elif QT == 14:  # Q6_K: two halves of 64 bytes hold 128h + r (lo) and + 64 (hi)
        c = blk * 256 + (gb // 4) * 128 + (gb % 4) * 16 + HI * 64 + e
    else:  # Q4_0, Q4_1, Q5_0, Q5_1: byte j holds values j (lo) and j + 16 (hi)
        c = blk * BLOCK + HI * 16 + e
    return c


@triton.jit
def _part(q, qh, b, h, rb, blk, gb, e, ok, HI: tl.constexpr, QT: tl.constexpr,
          OSC: tl.constexpr, SSC: tl.constexpr, OD: tl.constexpr, SD: tl.constexpr,
          OM: tl.constexpr, SM: tl.constexpr):
    """One part's float32 weights from its 4-bit quants q (and the high-bit bytes qh).

    The quants are converted before any scale is read: the compiler then keeps the whole
    tile in the layout of its load and brings the (few) scales to it, not the reverse."""
    if QT == 12 or QT == 13:  # Q4_K, Q5_K
        if QT == 13:  # fifth bit: bit 2p (lo) or 2p + 1 (hi) of qh byte l
            q |= ((qh >> (2 * gb + HI)) & 1) << 4
        qf = _f32(q, 0)
        sc, mn = _k4_scale(b, rb + OSC + blk * SSC, 2 * gb + HI, ok)
        w = qf * (_half(h, rb + OD + blk * SD, ok) * _f32(sc, 0))
        w = w - _half(h, rb + OM + blk * SM, ok) * _f32(mn, 0)
    elif QT == 14:  # Q6_K: 2 high bits from qh, 16 int8 sub-scales
        q |= ((qh >> (2 * ((gb % 4) // 2) + 4 * HI)) & 3) << 4
        qf = _f32(q, 32)
        sc = _byte(b, rb + OSC + blk * SSC + (gb // 4) * 8 + gb % 4 + 4 * HI, ok)
        w = qf * (_half(h, rb + OD + blk * SD, ok) * _f32(sc ^ 0x80, 128))
    else:  # Q4_0, Q4_1, Q5_0, Q5_1
        if QT == 6 or QT == 7:  # fifth bit: bit j (lo) or j + 16 (hi) of the 32-bit qh
            q |= ((qh >> (e % 8)) & 1) << 4
        if QT == 3 or QT == 7:  # Q4_1, Q5_1: d * q + m
            qf = _f32(q, 0)
            w = qf * _half(h, rb + OD + blk * SD, ok) + _half(h, rb + OM + blk * SM, ok)
        else:
            qf = _f32(q, 8 if QT == 2 else 16)
            w = qf * _half(h, rb + OD + blk * SD, ok)
    return w


@triton.jit
def decode(b, h, rb, g, e, ok, QT: tl.constexpr, GPB: tl.constexpr, E: tl.constexpr,
           OQ: tl.constexpr, SQ: tl.constexpr, OH: tl.constexpr, SH: tl.constexpr,
           OSC: tl.constexpr, SSC: tl.constexpr, OD: tl.constexpr, SD: tl.constexpr,
           OM: tl.constexpr, SM: tl.constexpr):
    """float32 weights of both parts (Q8_0: its one part twice) for rows at byte offsets rb,
    scale groups g of the row and elements e < E (broadcast against each other); groups
    where ok is false read as 0. Each quant byte is read once for both of its values."""
    blk = g // GPB
    gb = g % GPB
    q = _byte(b, rb + OQ + blk * SQ + gb * E + e, ok)
    if QT == 8:  # Q8_0: int8 quants
        w0 = _f32(q ^ 0x80, 128) * _half(h, rb + OD + blk * SD, ok)
        w1 = w0
    else:
        qh0 = q
        qh1 = q
        if QT == 13:  # Q5_K: byte l of qh holds the fifth bits of value l of all 8 sub-blocks
            qh0 = _byte(b, rb + OH + blk * SH + e, ok)
            qh1 = qh0
        elif QT == 14:  # Q6_K: byte (32 h + l) holds the high bits of 4 values
            qh0 = _byte(b, rb + OH + blk * SH + (gb // 4) * 32 + (gb % 2) * 16 + e, ok)
            qh1 = qh0
        elif QT == 6 or QT == 7:  # Q5_0, Q5_1: bytes 0-1 of qh for lo, 2-3 for hi
            qh0 = _byte(b, rb + OH + blk * SH + e // 8, ok)
            qh1 = _byte(b, rb + OH + blk * SH + 2 + e // 8, ok)
        w0 = _part(q & 15, qh0, b, h, rb, blk, gb, e, ok, 0, QT, OSC, SSC, OD, SD, OM, SM)
        w1 = _part(q >> 4, qh1, b, h, rb, blk, gb, e, ok, 1, QT, OSC, SSC, OD, SD, OM, SM)
    return w0, w1
