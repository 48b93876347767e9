"""K-quant block kernels (super-blocks of 256 values with packed sub-block scales).

Each takes uint8 blocks [n, type_size] and returns float32 [n, 256]. Byte
offsets follow ggml's block_q*_K structs; the sub-block scales are decoded
first, as ggml does, so the final multiply rounds exactly as the reference.
"""

from __future__ import annotations

import torch

from strata.gguf.blocks import f16_field, field, int8_field, spread

QK_K = 256
_ALL_BITS = tuple(range(8))


def q2_k(b: torch.Tensor) -> torch.Tensor:
    """scales[16] (4-bit scale | 4-bit min), qs[64] (2-bit), d, dmin."""
    n = b.shape[0]
    scales = field(b, 0, 16)
    d = f16_field(b, 80)
    dmin = f16_field(b, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = spread(field(b, 16, 80).reshape(n, 2, 32), (0, 2, 4, 6), 0x03)
    q = q.reshape(n, 16, 16).to(torch.float32)
    return q.mul_(dl).sub_(ml).reshape(n, QK_K)


def q3_k(b: torch.Tensor) -> torch.Tensor:
    """hmask[32] (high bit, inverted), qs[64] (low 2 bits), scales[12] (6-bit), d."""
    n = b.shape[0]
    packed = field(b, 96, 108)
    low = spread(packed[:, 0:8], (0, 4), 0x0F).reshape(n, 16)
    high = spread(packed[:, 8:12], (0, 2, 4, 6), 0x03).reshape(n, 16)
    scales = ((low | (high << 4)).view(torch.int8) - 32).to(torch.float32)
    dl = (f16_field(b, 108) * scales).reshape(n, 16, 1)
    ql = spread(field(b, 32, 96).reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 16, 16)
    qh = spread(field(b, 0, 32).reshape(n, 1, 32), _ALL_BITS, 0x01).reshape(n, 16, 16)
    # A set hmask bit means "no offset"; a clear one subtracts 4.
    q = (ql.view(torch.int8) - ((qh ^ 1) << 2).view(torch.int8)).to(torch.float32)
    return q.mul_(dl).reshape(n, QK_K)


def _scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eight 6-bit scales and mins from the 12 packed bytes of Q4_K/Q5_K."""
    n = packed.shape[0]
    rows = packed.reshape(n, 3, 4)
    sc_lo, mn_lo, both = rows[:, 0], rows[:, 1], rows[:, 2]
    scales = torch.cat((sc_lo & 0x3F, (both & 0x0F) | ((sc_lo >> 2) & 0x30)), dim=-1)
    mins = torch.cat((mn_lo & 0x3F, (both >> 4) | ((mn_lo >> 2) & 0x30)), dim=-1)
    return scales, mins


def _k4_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sub-block scale and min, [n, 8, 1] each, rounded as ggml rounds them."""
    n = b.shape[0]
    scales, mins = _scale_min_k4(field(b, 4, 16))
    d = (f16_field(b, 0) * scales.to(torch.float32)).reshape(n, 8, 1)
    dm = (f16_field(b, 2) * mins.to(torch.float32)).reshape(n, 8, 1)
    return d, dm


def q4_k(b: torch.Tensor) -> torch.Tensor:
    """d, dmin, scales[12], qs[128] (4-bit, 32 low nibbles then 32 high per 32 bytes)."""
    n = b.shape[0]
    d, dm = _k4_scales(b)
    q = spread(field(b, 16, 144).reshape(n, 4, 32), (0, 4), 0x0F).reshape(n, 8, 32)
    return q.to(torch.float32).mul_(d).sub_(dm).reshape(n, QK_K)


def q5_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K plus qh[32]: bit i of byte j is the fifth bit of value 32*i + j."""
    n = b.shape[0]
    d, dm = _k4_scales(b)
    ql = spread(field(b, 48, 176).reshape(n, 4, 32), (0, 4), 0x0F).reshape(n, 8, 32)
    qh = spread(field(b, 16, 48).reshape(n, 1, 32), _ALL_BITS, 0x01).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return q.mul_(d).sub_(dm).reshape(n, QK_K)


def q6_k(b: torch.Tensor) -> torch.Tensor:
    """ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d."""
    n = b.shape[0]
    scales = int8_field(b, 192, 208).to(torch.float32)
    d = (f16_field(b, 208) * scales).reshape(n, 16, 1)
    ql = spread(field(b, 0, 128).reshape(n, 2, 64), (0, 4), 0x0F).reshape(n, 8, 32)
    qh = spread(field(b, 128, 192).reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).view(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    return q.mul_(d).reshape(n, QK_K)
