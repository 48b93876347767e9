"""Dequantization of ggml tensor bytes into torch tensors, on the bytes' device.

Every kernel works on all blocks of a tensor at once (reshape, shift, mask,
broadcast), so the same code runs on the CPU and on a GPU without a Python
loop over blocks. Each one repeats the float32 operations of the ggml
reference in the same order, which makes the float32 result bit-identical to
`gguf.quants.dequantize`; other dtypes are a single rounding of that result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata.errors import ModelLoadError
from strata.gguf import kquants
from strata.gguf.blocks import bits_le, f16_field, int8_field, nibbles

T = GGMLQuantizationType

# Values dequantized per step: enough that Python overhead is negligible,
# few enough that the float32 temporaries stay in cache.
_CHUNK_VALUES = 1 << 20


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = f16_field(b, 0)
    q = nibbles(b[:, 2:]).view(torch.int8) - 8
    return q.to(torch.float32).mul_(d)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d = f16_field(b, 0)
    m = f16_field(b, 2)
    q = nibbles(b[:, 4:]).to(torch.float32)
    return q.mul_(d).add_(m)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = f16_field(b, 0)
    qh = bits_le(b[:, 2:6])
    q = (nibbles(b[:, 6:]) | (qh << 4)).view(torch.int8) - 16
    return q.to(torch.float32).mul_(d)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d = f16_field(b, 0)
    m = f16_field(b, 2)
    qh = bits_le(b[:, 4:8])
    q = (nibbles(b[:, 8:]) | (qh << 4)).to(torch.float32)
    return q.mul_(d).add_(m)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = f16_field(b, 0)
    return int8_field(b, 2, 34).to(torch.float32).mul_(d)


# Block kernels: uint8 blocks [n, type_size] -> float32 values [n, block_size].
_BLOCK_KERNELS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: kquants.q2_k,
    T.Q3_K: kquants.q3_k,
    T.Q4_K: kquants.q4_k,
    T.Q5_K: kquants.q5_k,
    T.Q6_K: kquants.q6_k,
}

# Plain element types: the bytes reinterpreted, then converted.
_FLOAT_VIEWS: dict[GGMLQuantizationType, torch.dtype] = {
    T.F32: torch.float32,
    T.F16: torch.float16,
    T.BF16: torch.bfloat16,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_BLOCK_KERNELS) | frozenset(
    _FLOAT_VIEWS
)


def dequantize(
    raw: torch.Tensor,
    ggml_type: GGMLQuantizationType,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    *,
    name: str = "tensor",
) -> torch.Tensor:
    """Decode `raw` (uint8, ggml layout) into a new tensor of `shape` (torch order).

    The work runs on `raw.device`. `name` only labels errors: an unsupported
    type raises ModelLoadError naming it, since the caller may not know which
    types a file holds before it asks.
    """
    ggml_type = GGMLQuantizationType(ggml_type)
    if ggml_type not in SUPPORTED_TYPES:
        raise ModelLoadError(name, f"unsupported tensor type {ggml_type.name}")
    if raw.dtype != torch.uint8:
        raise TypeError(f"{name}: raw bytes must be a uint8 tensor, got {raw.dtype}")
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        numel *= s
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if numel % block_size or raw.numel() != numel // block_size * type_size:
        raise ValueError(
            f"{name}: {raw.numel()} bytes do not hold {ggml_type.name} values of shape {list(shape)}"
        )
    flat = raw.reshape(-1)
    if ggml_type in _FLOAT_VIEWS:
        values = flat.contiguous().view(_FLOAT_VIEWS[ggml_type])
        return values.to(dtype, copy=True).reshape(shape)
    blocks = flat.view(-1, type_size)
    out = torch.empty((blocks.shape[0], block_size), dtype=dtype, device=raw.device)
    kernel = _BLOCK_KERNELS[ggml_type]
    step = max(1, _CHUNK_VALUES // block_size)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step].copy_(kernel(blocks[start : start + step]))
    return out.reshape(shape)
