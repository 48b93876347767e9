"""Quantizers of the KV cell formats, vectorized torch along the last dimension.

Every function computes in float32 with elementwise IEEE operations and
max (the only reduction, and an exact one), so the same input gives the same
bits on every call, for any batch size, on CPU and CUDA.

- int8: symmetric, one float32 scale per row (a cell's KV head):
  s = amax / 127, code = round_half_even(x / s), value = code * s.
  Rounding half to even is what GPU float-to-int conversion does natively.
- Q4_0: ggml's block_q4_0, byte for byte: blocks of 32 values stored as
  18 bytes, a float16 d (little endian) then 16 bytes of codes, the low nibble
  of byte j holding element j and the high nibble element j + 16.
  d = (the value of largest magnitude, sign kept) / -8,
  code = min(15, trunc(x * (1/d) + 8.5)), value = (code - 8) * float16(d).
"""

from __future__ import annotations

import torch

Q4_0_BLOCK = 32  # values per Q4_0 block
Q4_0_BLOCK_BYTES = 18  # 2 bytes of float16 d + 16 bytes of 4-bit codes


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [..., D], scales float32 [...]) of x [..., D]."""
    x = x.to(torch.float32)
    amax = x.abs().amax(dim=-1)
    # A divisor on the tensor's device: CUDA turns division by a Python or CPU
    # scalar into multiplication by its reciprocal, which differs in the last bit.
    scale = amax / amax.new_full((), 127.0)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(x / safe.unsqueeze(-1)).clamp_(-127, 127)
    return codes.to(torch.int8), scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D] * scale [...], computed in float32 and returned in `dtype`."""
    return (codes.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


def check_q4_0_dim(head_dim: int) -> None:
    if head_dim % Q4_0_BLOCK:
        raise ValueError(f"Q4_0 needs head_dim a multiple of {Q4_0_BLOCK}, got head_dim={head_dim}")


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks uint8 [..., D / 32, 18] of x [..., D]."""
    check_q4_0_dim(x.shape[-1])
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], -1, Q4_0_BLOCK)
    # The first value of largest magnitude keeps its sign, as ggml does.
    at = blocks.abs().argmax(dim=-1, keepdim=True)
    d = blocks.gather(-1, at) / -8.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    codes = torch.trunc(blocks * inv + 8.5).clamp_(0, 15).to(torch.uint8)
    half = Q4_0_BLOCK // 2
    packed = codes[..., :half] | (codes[..., half:] << 4)
    d_bytes = d.to(torch.float16).view(torch.uint8)  # [..., nb, 2], little endian
    return torch.cat((d_bytes, packed), dim=-1)


def dequantize_q4_0(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values [..., nb * 32] in `dtype` of Q4_0 blocks uint8 [..., nb, 18]."""
    d = blocks[..., :2].contiguous().view(torch.float16).to(torch.float32)  # [..., nb, 1]
    packed = blocks[..., 2:]
    codes = torch.cat((packed & 0x0F, packed >> 4), dim=-1).to(torch.float32) - 8.0
    values = codes * d
    return values.reshape(*blocks.shape[:-2], -1).to(dtype)
