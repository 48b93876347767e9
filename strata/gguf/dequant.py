"""Dequantization of ggml tensor bytes into torch tensors, on the bytes' device.

Every kernel decodes a whole chunk of blocks with tensor ops (reshape, shift,
mask, broadcast), so the same code runs on the CPU and on a GPU without a
Python loop over blocks. Each one repeats the float32 operations of the ggml
reference in the same order, which makes the float32 result bit-identical to
`gguf.quants.dequantize`; other dtypes are a single rounding of that result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from strata.errors import ModelLoadError
from strata.gguf import kquants
from strata.gguf.blocks import bits_le, f16_field, int8_field, nibbles

T = GGMLQuantizationType

# Values dequantized per step on the CPU. At 2**15 no op exceeds torch's
# parallel grain (32768 elements), so none opens an OpenMP region and the
# work stays on the calling thread. For the default model's 135M values on an
# idle host that costs 0.41 s against 0.17 s with 2 OpenMP threads and chunks
# of 2**20; but on a 2-core machine that other processes keep busy, each
# OpenMP barrier waits for a descheduled thread, and the OpenMP way took
# 10-45 s where this one stays near 1 s. (Small chunks spread over Python
# threads were slower than either: the GIL serialises the op dispatch.)
_CPU_CHUNK_VALUES = 1 << 15
# On a GPU: enough that each kernel fills the device.
_GPU_CHUNK_VALUES = 1 << 26


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


# Types only gguf.quants decodes (IQ1-IQ4, TQ, MXFP4, NVFP4, ...): read on the CPU through its
# numpy code, which is slow (seconds per tensor) but exact. The loader warns once per type.
FOREIGN_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    getattr(gguf_quants, "_type_traits", {})) - SUPPORTED_TYPES


def foreign_dequantize(raw: np.ndarray, ggml_type: GGMLQuantizationType,
                       shape: Sequence[int]) -> torch.Tensor:
    """float32 values of a tensor of a FOREIGN_TYPES type, decoded by gguf.quants on the CPU."""
    values = gguf_quants.dequantize(raw, GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(tuple(shape))


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
    numel = math.prod(shape)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if numel % block_size or raw.numel() != numel // block_size * type_size:
        raise ValueError(
            f"{name}: {raw.numel()} bytes do not hold "
            f"{ggml_type.name} values of shape {list(shape)}"
        )
    flat = raw.reshape(-1)
    if ggml_type in _FLOAT_VIEWS:
        values = flat.contiguous().view(_FLOAT_VIEWS[ggml_type])
        return values.to(dtype, copy=True).reshape(shape)
    blocks = flat.view(-1, type_size)
    out = torch.empty((blocks.shape[0], block_size), dtype=dtype, device=raw.device)
    _decode_blocks(_BLOCK_KERNELS[ggml_type], blocks, out)
    return out.reshape(shape)


def _decode_blocks(
    kernel: Callable[[torch.Tensor], torch.Tensor], blocks: torch.Tensor, out: torch.Tensor
) -> None:
    """Run `kernel` over `blocks` chunk by chunk, writing rounded values into `out`."""
    chunk = _CPU_CHUNK_VALUES if blocks.device.type == "cpu" else _GPU_CHUNK_VALUES
    step = max(1, chunk // out.shape[1])
    for start in range(0, blocks.shape[0], step):
        out[start : start + step].copy_(kernel(blocks[start : start + step]))
