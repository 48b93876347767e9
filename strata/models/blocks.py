"""Weights held as the GGUF file's own blocks and multiplied in place (`--weights gguf`).

A 4-bit file dequantized to bf16 spends 3.3x its size on weights, memory
that no conversation's K/V then gets. `BlockLinear` keeps each output row's
blocks exactly as the file stores them (uint8 [rows, row_bytes]: ggml keeps
a row's blocks together) and multiplies through the device's block kernels:
`block_matmul` of the C++ CPU kernels, `block_gemv` / `block_mm` of
`kernels/triton/blocks.py` on CUDA. Every weight value is the one
`gguf.quants` decodes (fp16 scales and mins, K-quant sub-scales as ggml
packs them), where the int4 mode re-quantized with bf16 scales.

A fused projection (q/k/v, gate/up) is made of the file's tensors side by
side; a Q4_K_M file stores v in Q6_K on some layers, so a projection is a
list of segments, each a run of rows of one block type. The embedding
(`BlockEmbedding`) decodes only the rows a step looks up; a tied output head
shares its blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from strata.gguf.dequant import dequantize
from strata.kernels.cpu.loader import BLOCK_TYPES, cpu_kernel
from strata.models import ops

try:  # the CPU machines and CI have no Triton
    from strata.kernels.triton import blocks as triton_blocks
except ImportError:
    triton_blocks = None  # type: ignore[assignment]

FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


def kernel_takes(device: torch.device, qtype: GGMLQuantizationType) -> bool:
    """Whether `device`'s block kernels compute with `qtype` blocks in place."""
    if qtype in FLOAT_TYPES:
        return False
    if device.type == "cpu":
        return int(qtype) in BLOCK_TYPES and cpu_kernel() is not None
    if device.type == "cuda":
        return triton_blocks is not None and triton_blocks.takes(int(qtype))
    return False


def row_bytes(qtype: GGMLQuantizationType, columns: int) -> int:
    """Bytes of one row of `columns` values in `qtype` blocks."""
    block, size = GGML_QUANT_SIZES[qtype]
    if columns % block:
        raise ValueError(f"{columns} columns are not whole {qtype.name} blocks of {block}")
    return columns // block * size


class BlockLinear(nn.Module):
    """y = x W^T (+ bias) with W held as GGUF blocks, in segments of rows of one type.

    `segments`: (block type, uint8 [rows, row_bytes]) in output order, on the
    device that computes. Results are in x's dtype, float32-accumulated.
    `packed`: hold each segment in `kernels/triton/blocks_decode.py: pack`'s planes (the same
    bytes grouped by field, so the CUDA kernels load them as aligned vectors).
    """

    def __init__(self, segments: Sequence[tuple[GGMLQuantizationType, torch.Tensor]], in_features: int,
                 bias: torch.Tensor | None = None, packed: bool = False) -> None:
        super().__init__()
        merged: list[tuple[GGMLQuantizationType, list[torch.Tensor]]] = []
        for qtype, blocks in segments:
            if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(qtype, in_features):
                raise ValueError(f"{qtype.name} blocks of shape {tuple(blocks.shape)} for rows of {in_features}")
            if merged and merged[-1][0] == qtype:  # neighbours of one type: one launch
                merged[-1][1].append(blocks)
            else:
                merged.append((qtype, [blocks]))
        self.qtypes = tuple(q for q, _ in merged)
        self.rows = tuple(sum(int(b.shape[0]) for b in parts) for _, parts in merged)
        if packed and triton_blocks is None:
            raise ValueError("packed blocks are read by the Triton kernels, and Triton is not installed")
        self.packed = packed
        for i, (qtype, parts) in enumerate(merged):
            data = parts[0] if len(parts) == 1 else torch.cat(parts)
            if packed:
                assert triton_blocks is not None
                data = triton_blocks.pack(data, int(qtype))
            self.register_buffer(f"blocks{i}", data.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features = in_features
        self.out_features = sum(self.rows)
        self.invariant = False  # `set_invariant`

    def set_invariant(self, on: bool) -> None:
        """On CUDA, compute a lone row as a row of the many-row kernel (`block_mm`), whose sums do
        not depend on the number of rows, instead of the one-row kernel (`--batch-invariant`)."""
        self.invariant = on

    def segments(self) -> list[tuple[GGMLQuantizationType, torch.Tensor]]:
        return [(q, getattr(self, f"blocks{i}")) for i, q in enumerate(self.qtypes)]

    @property
    def device(self) -> torch.device:
        return self.blocks0.device

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] decoded (tests and comparisons; never kept)."""
        out = []
        for q, b in self.segments():
            if self.packed:
                assert triton_blocks is not None
                b = triton_blocks.unpack(b, int(q))
            out.append(dequantize(b.reshape(-1), q, (b.shape[0], self.in_features), dtype))
        return torch.cat(out)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """out_dtype: the products stored in another dtype (float32 logits), without a rounding
        to x's dtype first where the kernel allows (the CPU kernel gives float32 out of any x)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        if out_dtype not in (None, torch.float32) and x2.device.type == "cpu":
            x2 = x2.to(out_dtype)
        parts = [block_product(x2, q, b, self.packed, out_dtype, self.invariant) for q, b in self.segments()]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 products, never rounded to bf16: bf16 logits tie (at 25, one bf16 step is
        0.125) where float32 ones are apart."""
        if self.takes_row(x):
            return self.row(x, out_dtype=torch.float32)
        return self.forward(x, out_dtype=torch.float32)

    def takes_row(self, x: torch.Tensor) -> bool:
        """Whether one CUDA row can take the folded one-row kernels (`row`): not where the row must
        be summed as in a batch (`invariant`)."""
        return (x.is_cuda and x.shape[0] == 1 and triton_blocks is not None and self.bias is None
                and not self.invariant)

    def row(self, x: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            silu: bool = False, residual: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """One CUDA row [1, K] with the folds of `kernels/triton/gemv.py` (RMSNorm of the input,
        silu(gate) * up over gate rows then up rows, a residual add, float32 out)."""
        g = triton_blocks
        assert g is not None
        segs = self.segments()
        if len(segs) == 1:
            q, b = segs[0]
            return g.block_gemv(x, b, int(q), norm_weight=norm_weight, eps=eps, silu=silu, residual=residual,
                                out_dtype=out_dtype, packed=self.packed)
        # several types: the row normalised once (the folds round as ops.rms_norm does), then
        # each segment; SwiGLU and the residual after
        if norm_weight is not None:
            x = ops.rms_norm(x, norm_weight, eps)
        parts = [g.block_gemv(x, b, int(q), out_dtype=out_dtype, packed=self.packed) for q, b in segs]
        y = torch.cat(parts, dim=-1)
        if silu:
            y = ops.silu_mul(y)
        return y if residual is None else residual + y


def block_product(x: torch.Tensor, qtype: GGMLQuantizationType, blocks: torch.Tensor, packed: bool,
                  out_dtype: torch.dtype | None, invariant: bool = False) -> torch.Tensor:
    """x [M, K] times one segment's rows, on the blocks' device. `invariant`: a lone CUDA row is
    the first of two rows of `block_mm` (whose reduction order is the same at every M)."""
    if blocks.device.type == "cpu":
        k = cpu_kernel()
        assert k is not None, "block weights on the CPU need the C++ kernels"
        return k.block_matmul(x, blocks, int(qtype), float_out=out_dtype == torch.float32)
    g: ModuleType | None = triton_blocks
    assert g is not None, "block weights on CUDA need Triton"
    if x.shape[0] == 1 and invariant:
        return g.block_mm(x.expand(2, -1).contiguous(), blocks, int(qtype), out_dtype=out_dtype,
                          packed=packed)[:1]
    if x.shape[0] == 1:
        return g.block_gemv(x, blocks, int(qtype), out_dtype=out_dtype, packed=packed)
    return g.block_mm(x, blocks, int(qtype), out_dtype=out_dtype, packed=packed)


class BlockEmbedding(nn.Module):
    """Token rows looked up in GGUF blocks and decoded on the fly (exactly, as gguf.quants)."""

    def __init__(self, qtype: GGMLQuantizationType, blocks: torch.Tensor, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(qtype, dim):
            raise ValueError(f"{qtype.name} blocks of shape {tuple(blocks.shape)} for rows of {dim}")
        self.qtype = qtype
        self.register_buffer("blocks", blocks.contiguous())
        self.embedding_dim = dim
        self.num_embeddings = int(blocks.shape[0])
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, ids.reshape(-1))
        out = dequantize(rows.reshape(-1), self.qtype, (rows.shape[0], self.embedding_dim), self.dtype)
        return out.reshape(*ids.shape, self.embedding_dim)

    def head(self) -> BlockLinear:
        """The tied output head over the same blocks (no copy)."""
        return BlockLinear([(self.qtype, self.blocks)], self.embedding_dim)


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of weights (parameters and persistent buffers, each storage once) per device."""
    seen: set[tuple[str, int]] = set()
    out: dict[str, int] = {}
    tensors: list[Any] = [p for p in model.parameters()]
    for mod in model.modules():
        skip = getattr(mod, "_non_persistent_buffers_set", set())
        tensors += [b for n, b in mod.named_buffers(recurse=False) if n not in skip]
    for t in tensors:
        if t.is_meta:
            continue
        key = (str(t.device), t.untyped_storage().data_ptr())
        if key in seen:
            continue
        seen.add(key)
        out[str(t.device)] = out.get(str(t.device), 0) + t.untyped_storage().nbytes()
    return out
