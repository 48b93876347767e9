"""Bit-unpacking helpers shared by the block kernels.

Blocks arrive as uint8 [n, type_size]. Each helper first copies the bytes it
needs into a contiguous tensor and then works on it whole: element-wise ops
on rows of only 16 or 32 strided bytes are many times slower in torch than
the same ops on one flat run, and on a GPU the extra copy is negligible.
"""

from __future__ import annotations

import torch


def field(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes [start, stop) of every block as a contiguous uint8 [n, stop - start]."""
    return blocks[:, start:stop].contiguous()


def f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian fp16 at byte `offset` of each block, as float32 [n, 1]."""
    return field(blocks, offset, offset + 2).view(torch.float16).to(torch.float32)


def int8_field(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes [start, stop) of every block read as signed int8 values."""
    return field(blocks, start, stop).view(torch.int8)


def spread(x: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """`(x >> s) & mask` for each shift s: [..., k] -> [..., len(shifts), k].

    ggml stores the i-th value of a group in bits `shifts[i]` of each byte of
    the group, so stacking the shifted copies puts the values in element order.
    """
    x = x.contiguous()
    parts = []
    for s in shifts:
        part = x >> s if s else x
        if (0xFF >> s) & ~mask:
            part = part & mask
        parts.append(part)
    return torch.stack(parts, dim=-2)


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Low nibbles of all bytes, then high nibbles: [n, k] -> [n, 2k] (legacy layout)."""
    return spread(qs, (0, 4), 0x0F).reshape(qs.shape[0], -1)


def bits_le(x: torch.Tensor) -> torch.Tensor:
    """The bits of a little-endian bit field, lowest first: [n, k] -> [n, 8k]."""
    return spread(x, tuple(range(8)), 0x01).transpose(-1, -2).reshape(x.shape[0], -1)
