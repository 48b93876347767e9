"""The MoE kernels (`moe.py`) over expert weights kept as GGUF quantized blocks.

llama.cpp stores a MoE layer's experts as one 3-D tensor per projection
(`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`): uint8 rows [E * N, row
bytes], expert e's N rows at rows e * N .. e * N + N - 1, in the file's block
layout or `pack`ed (blocks_decode.py). Reading them as blocks keeps a 4-bit
Qwen3-30B-A3B at its file size on the GPU, and a decode step reads only the
chosen experts' bytes.

The same grouped kernels as the dense path run here, each weight tile decoded
in registers into column order and every value rounded once from ggml's
float32 value to x's dtype before `tl.dot` (as blocks.block_mm does): with
the same launch config the result equals `moe.moe` on the weights dequantized
to x's dtype, bit for bit, and keeps that path's batch invariance.

Launch shapes come from `BLOCK_CONFIGS` (empty until measured) or moe.py's rule.
"""

from __future__ import annotations

import torch

from strata.kernels.triton.blocks import _type_args
from strata.kernels.triton.blocks_decode import TYPES, takes
from strata.kernels.triton.moe import (
    Aligned,
    Config,
    HostCopies,
    Mapped,
    align,
    combine,
    default_config,
    launch_experts,
    t_bucket,
)
from strata.kernels.triton.moe import takes as takes_dense

__all__ = ["BLOCK_CONFIGS", "expert_down_blocks", "expert_gate_up_blocks", "moe_blocks",
           "takes_blocks"]

# (T bucket, E, H, I, gate/up qtype, down qtype) -> moe.Config, measured on an H200
BLOCK_CONFIGS: dict[tuple[int, int, int, int, int, int], Config] = {}


def _blocks_per_row(x: torch.Tensor, blocks: torch.Tensor, qtype: int, n_rows: int,
                    name: str) -> int:
    """Blocks per weight row for x's rows, or ValueError naming what does not fit."""
    if not takes(qtype):
        raise ValueError(f"{name}: no block kernel for qtype {qtype}")
    bt = TYPES[qtype]
    k = x.shape[1] if x.dim() == 2 else -1
    if not takes_dense(x) or k % bt.block:
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype} on {x.device} is not rows of "
                         f"whole {bt.block}-value blocks the kernels take")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous() \
            or blocks.shape[1] != k // bt.block * bt.size or n_rows < 1 \
            or blocks.shape[0] % n_rows or blocks.device != x.device:
        raise ValueError(f"{name}: blocks must be contiguous uint8 [E * {n_rows}, "
                         f"{k // bt.block * bt.size}] on {x.device}, got {tuple(blocks.shape)} "
                         f"{blocks.dtype} on {blocks.device}")
    return k // bt.block


def expert_gate_up_blocks(x: torch.Tensor, gate_blocks: torch.Tensor, up_blocks: torch.Tensor,
                          qtype: int, n_rows_per_expert: int, aligned: Aligned, top_k: int,
                          packed: bool, *, block_n: int = 32, warps: int = 4, stages: int = 2,
                          mapped: Mapped | None = None) -> torch.Tensor:
    """moe.expert_gate_up with gate and up in blocks of one qtype, [E * I, row bytes] each
    (I = n_rows_per_expert), raw or (packed=True) `pack`ed; mapped as there (distances in bytes)."""
    nb = _blocks_per_row(x, gate_blocks, qtype, n_rows_per_expert, "expert_gate_up_blocks")
    if up_blocks.shape != gate_blocks.shape or up_blocks.dtype != torch.uint8 \
            or not up_blocks.is_contiguous() or up_blocks.device != gate_blocks.device:
        raise ValueError(f"expert_gate_up_blocks: up {tuple(up_blocks.shape)} does not match "
                         f"gate {tuple(gate_blocks.shape)}")
    return launch_experts(x, gate_blocks, up_blocks, aligned, top_k, n_rows_per_expert, True,
                          _type_args(qtype, nb, packed), block_n, warps, stages, mapped)


def expert_down_blocks(act: torch.Tensor, down_blocks: torch.Tensor, qtype: int,
                       n_rows_per_expert: int, aligned: Aligned, top_k: int, packed: bool, *,
                       block_n: int = 64, warps: int = 4, stages: int = 2,
                       mapped: Mapped | None = None) -> torch.Tensor:
    """moe.expert_down with down in blocks, [E * H, row bytes] (H = n_rows_per_expert)."""
    nb = _blocks_per_row(act, down_blocks, qtype, n_rows_per_expert, "expert_down_blocks")
    return launch_experts(act, down_blocks, None, aligned, top_k, n_rows_per_expert, False,
                          _type_args(qtype, nb, packed), block_n, warps, stages, mapped)


def takes_blocks(x: torch.Tensor, gate_qtype: int, down_qtype: int, i: int) -> bool:
    """Whether moe_blocks takes x [T, H] with intermediate size i and these qtypes."""
    if not (takes(gate_qtype) and takes(down_qtype) and takes_dense(x)):
        return False
    return x.shape[1] % TYPES[gate_qtype].block == 0 and i % TYPES[down_qtype].block == 0 \
        and i % 16 == 0


def moe_blocks(x: torch.Tensor, gate_blocks: torch.Tensor, up_blocks: torch.Tensor,
               down_blocks: torch.Tensor, gate_qtype: int, down_qtype: int,
               topk_ids: torch.Tensor, topk_weights: torch.Tensor, packed: bool,
               block_m: int | None = None, *, config: Config | None = None,
               host: HostCopies | None = None) -> torch.Tensor:
    """moe.moe with the experts in blocks: gate and up [E * I, ...] of gate_qtype, down
    [E * H, ...] of down_qtype (E, I from the shapes; with host, the blocks are slots and E is
    the host copies')."""
    h = x.shape[1]
    bt = TYPES.get(down_qtype)
    row = down_blocks.shape[1] if down_blocks.dim() == 2 else 0
    i = row // bt.size * bt.block if bt is not None and row % bt.size == 0 else 0
    if i == 0 or not takes_blocks(x, gate_qtype, down_qtype, i) or gate_blocks.shape[0] % i \
            or down_blocks.shape[0] != gate_blocks.shape[0] // i * h:
        raise ValueError(f"moe_blocks: x {tuple(x.shape)} {x.dtype}, gate/up "
                         f"{tuple(gate_blocks.shape)} of {gate_qtype}, down "
                         f"{tuple(down_blocks.shape)} of {down_qtype}")
    e = (host.gate if host is not None else gate_blocks).shape[0] // i
    k = topk_ids.shape[1]
    t = x.shape[0]
    bm, bn_gu, bn_d, warps, stages = config or BLOCK_CONFIGS.get(
        (t_bucket(t), e, h, i, int(gate_qtype), int(down_qtype))) or default_config(
        t, e, h, i, k, x.dtype)
    aligned = align(topk_ids, e, block_m or bm)
    m_gu, m_d = host.mapped(gate_blocks, up_blocks, down_blocks) if host is not None else (None, None)
    act = expert_gate_up_blocks(x, gate_blocks, up_blocks, gate_qtype, i, aligned, k, packed,
                                block_n=bn_gu, warps=warps, stages=stages, mapped=m_gu)
    y = expert_down_blocks(act, down_blocks, down_qtype, h, aligned, k, packed, block_n=bn_d,
                           warps=warps, stages=stages, mapped=m_d)
    return combine(y, topk_ids, topk_weights)
