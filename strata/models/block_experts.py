"""Routed experts kept as the GGUF file's blocks (`--weights gguf` on a MoE file).

llama.cpp stores a layer's experts as three 3-D tensors (`ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`), each expert's rows back to back, so expert e
of a [E, N, row_bytes] block tensor is its own [N, row_bytes] matrix: the
holder keeps them so (packed into planes for the CUDA kernels, as
`blocks.BlockLinear` does) and never makes a dense copy. Products go to the
fused block kernels (`kernels/triton/moe_blocks.py`) where they take the
tensors, else through the one-matrix block kernels expert by expert (the C++
`block_matmul` on the CPU), with the same routing and combine as `moe.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from strata.models import ops
from strata.models.blocks import block_product, row_bytes
from strata.models.moe import combine_loop, combine_pairs

try:  # the CPU machines and CI have no Triton
    from strata.kernels.triton import blocks as triton_blocks
    from strata.kernels.triton import moe as triton_moe
    from strata.kernels.triton import moe_blocks as triton_moe_blocks
except ImportError:
    triton_blocks = triton_moe = triton_moe_blocks = None  # type: ignore[assignment]


class BlockMath:
    """The products of experts held as [E, N, row_bytes] blocks of three GGUF types."""

    def __init__(self, qtypes: tuple[GGMLQuantizationType, GGMLQuantizationType, GGMLQuantizationType],
                 packed: bool) -> None:
        self.qtypes = qtypes
        self.packed = packed

    def fused(self, x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether the fused block kernels take x and these [E, N, row_bytes] experts."""
        if triton_moe_blocks is None or not x.is_cuda or self.qtypes[0] != self.qtypes[1]:
            return False
        ffn = int(tensors[0].shape[1])
        return triton_moe_blocks.takes_blocks(x, int(self.qtypes[0]), int(self.qtypes[2]), ffn)

    def config(self, tensors: Sequence[torch.Tensor], tokens: int, k: int, dtype: torch.dtype) -> object:
        """The launch shape of a step (an expert cache passes the full layer's; see DenseMath)."""
        if triton_moe_blocks is None:
            return None
        e, i = int(tensors[0].shape[0]), int(tensors[0].shape[1])
        h = int(tensors[2].shape[1])
        key = (triton_moe.t_bucket(tokens), e, h, i, int(self.qtypes[0]), int(self.qtypes[2]))
        return triton_moe_blocks.BLOCK_CONFIGS.get(key) or triton_moe.default_config(tokens, e, h, i, k, dtype)

    def _swiglu(self, s: int, rows: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        gate, up, down = (t[s] for t in tensors)
        qg, qu, qd = self.qtypes
        g = block_product(rows, qg, gate, self.packed, None)
        u = block_product(rows, qu, up, self.packed, None)
        return block_product((F.silu(g) * u).contiguous(), qd, down, self.packed, None)

    def pairs(self, rows: torch.Tensor, tensors: Sequence[torch.Tensor], slots: torch.Tensor,
              config: object) -> torch.Tensor:
        """rows [P, H], each with its own expert (slots [P]) -> [P, H]."""
        if config is not None and self.fused(rows, tensors):
            assert triton_moe_blocks is not None and triton_moe is not None
            bm, bn_gu, bn_d, warps, stages = config  # type: ignore[misc]
            gate, up, down = (t.view(-1, t.shape[2]) for t in tensors)
            i, h = int(tensors[0].shape[1]), int(tensors[2].shape[1])
            a = triton_moe.align(slots.view(-1, 1), int(tensors[0].shape[0]), bm)
            act = triton_moe_blocks.expert_gate_up_blocks(rows, gate, up, int(self.qtypes[0]), i, a, 1,
                                                          self.packed, block_n=bn_gu, warps=warps, stages=stages)
            return triton_moe_blocks.expert_down_blocks(act, down, int(self.qtypes[2]), h, a, 1, self.packed,
                                                        block_n=bn_d, warps=warps, stages=stages)
        ones = torch.ones(slots.numel(), 1, dtype=rows.dtype, device=rows.device)
        return self.all(rows, tensors, slots.view(-1, 1), ones)

    def all(self, x: torch.Tensor, tensors: Sequence[torch.Tensor], ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        if self.fused(x, tensors):
            assert triton_moe_blocks is not None
            gate, up, down = (t.view(-1, t.shape[2]) for t in tensors)
            return triton_moe_blocks.moe_blocks(x, gate, up, down, int(self.qtypes[0]), int(self.qtypes[2]),
                                                ids, weights, self.packed)
        k = ops.cpu_kernels(x)
        if k is not None and all(t.device.type == "cpu" for t in tensors):  # the loop below, in C++
            qg, qu, qd = (int(q) for q in self.qtypes)
            return k.experts_blocks(x.contiguous(), ids, weights, *tensors, qg, qu, qd)
        return combine_loop(x, ids, weights, lambda e, r: self._swiglu(e, r, tensors))

    def combine(self, y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return combine_pairs(y, ids, weights)

    def maps(self, x: torch.Tensor, slots: Sequence[torch.Tensor]) -> bool:
        """Whether `mapped` takes rows like x over these device slots."""
        return self.fused(x, slots)

    def mapped(self, x: torch.Tensor, slots: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor],
               table: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, config: object) -> torch.Tensor:
        """`all` with each expert read from its slot or its host copy (moe.DenseMath.mapped)."""
        assert triton_moe_blocks is not None and triton_moe is not None
        rows = [t.view(-1, t.shape[2]) for t in (*slots, *hosts)]
        return triton_moe_blocks.moe_blocks(x, *rows[:3], int(self.qtypes[0]), int(self.qtypes[2]), ids, weights,
                                            self.packed, config=config,  # type: ignore[arg-type]
                                            host=triton_moe.HostCopies(table, *rows[3:]))


class BlockExperts(nn.Module):
    """A layer's routed experts as GGUF blocks: gate, up uint8 [E, I, .], down [E, H, .]."""

    def __init__(self, parts: Sequence[tuple[GGMLQuantizationType, torch.Tensor]], hidden: int, ffn: int,
                 packed: bool) -> None:
        super().__init__()
        names = ("gate", "up", "down")
        qtypes = []
        for name, (qtype, blocks), columns in zip(names, parts, (hidden, hidden, ffn), strict=True):
            e = blocks.shape[0]
            flat = blocks.reshape(-1, row_bytes(qtype, columns))
            if packed:
                assert triton_blocks is not None, "packed blocks are read by the Triton kernels"
                flat = triton_blocks.pack(flat, int(qtype))
            self.register_buffer(name, flat.reshape(e, -1, flat.shape[1]).contiguous())
            qtypes.append(qtype)
        self.math = BlockMath((qtypes[0], qtypes[1], qtypes[2]), packed)
        self.num_experts = int(parts[0][1].shape[0])
        self.hidden = hidden

    @property
    def graph_safe(self) -> bool:
        return self.gate.is_cuda and self.math.fused(
            torch.empty(1, self.hidden, dtype=torch.bfloat16, device=self.gate.device), self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [self.gate, self.up, self.down]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.math.all(x, self.tensors(), ids, weights)
