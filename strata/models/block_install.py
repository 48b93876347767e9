"""Which parts of a meta-built model take a GGUF file's blocks as they are (`--weights gguf`).

Before the loader reads anything dense, every projection (q/k/v, o, gate/up,
down, a shared expert's, the output head), the embedding and a sparse layer's
routed experts whose stored tensors are all of block types the device's
kernels take are replaced by a `BlockLinear` / `BlockEmbedding` /
`BlockExperts` holding the file's bytes; the loader then fills what is
left (norms, biases, and tensors of other types) as before. A tensor of a
type without a kernel on that device (IQ2_XS on CUDA, say) is dequantized
on load like in the dense mode, and one warning line per type says so and
what it costs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from strata.models.block_experts import BlockExperts
from strata.models.blocks import FLOAT_TYPES, BlockEmbedding, BlockLinear, kernel_takes
from strata.models.moe import SparseMLP, dense_mlp
from strata.models.naming import Part

log = logging.getLogger(__name__)


class BlockSource(Protocol):
    def block_type(self, name: str) -> GGMLQuantizationType: ...

    def blocks(self, name: str, device: torch.device) -> torch.Tensor: ...

    def names(self) -> set[str]: ...


class Placed(Protocol):
    def device_of(self, param_name: str) -> torch.device | None: ...


def ffn_types(source: BlockSource) -> list[GGMLQuantizationType]:
    """The stored types of a GGUF file's feed-forward weights (what `auto` decides by)."""
    return [source.block_type(n) for n in source.names() if ".ffn_" in n and n.endswith(".weight")]


def blocks_fit(source: BlockSource, device: torch.device) -> bool:
    """Whether most of a file's feed-forward weights are blocks that `device`'s kernels take
    (what `--weights auto` keeps as blocks)."""
    kinds = ffn_types(source)
    return bool(kinds) and sum(kernel_takes(device, k) for k in kinds) * 2 > len(kinds)


def install_blocks(model: nn.Module, source: BlockSource, parts_of: Callable[[str, int], list[Part]],
                   placement: Placed, dtype: torch.dtype) -> None:
    """Swap the block-held projections and embedding of `model` (on meta) for block modules."""
    dense: dict[str, int] = {}  # types left to the dense path: how many tensors

    def segments(pname: str, rows: int, device: torch.device) -> list[tuple[GGMLQuantizationType, torch.Tensor]] | None:
        parts = parts_of(pname, rows)
        types = [source.block_type(p.name) for p in parts]
        joins = [p.join for p in parts if p.join is not None]
        if joins and len(set(types)) > 1:  # rows of several types interleaved across the parts: dense
            return None
        if any(not kernel_takes(device, t) for t in types):
            for t in types:
                if t not in FLOAT_TYPES and not kernel_takes(device, t):
                    dense[t.name] = dense.get(t.name, 0) + 1
            return None
        out = []
        for part, t in zip(parts, types, strict=True):
            b = source.blocks(part.name, device)
            out.append((t, part.fix(b).contiguous() if part.fix is not None else b))
        if joins:  # a row order across the parts (`Part.join`): a block row is a whole weight row
            return [(types[0], joins[0](torch.cat([b for _, b in out])).contiguous())]
        return out

    for i, layer in enumerate(model.layers):
        device = placement.device_of(f"layers.{i}.input_layernorm.weight")
        if device is None:
            continue
        mlp = dense_mlp(layer.mlp)
        owners = ([("self_attn", layer.self_attn, name) for name in ("qkv_proj", "o_proj")]
                  if layer.self_attn is not None else [])
        delta = getattr(layer, "linear_attn", None)  # a recurrent layer (Qwen3-Next's gated DeltaNet)
        if delta is not None:
            owners += [("linear_attn", delta, name) for name in ("in_proj_qkvz", "in_proj_ba", "out_proj")]
        if mlp is not None:
            prefix = "mlp" if mlp is layer.mlp else "mlp.shared"
            owners += [(prefix, mlp, name) for name in ("gate_up_proj", "down_proj")]
        for prefix, owner, name in owners:
            lin = getattr(owner, name)
            segs = segments(f"layers.{i}.{prefix}.{name}.weight", lin.weight.shape[0], device)
            if segs is not None:  # CUDA kernels read packed planes (`kernels/triton/blocks_decode.py`)
                setattr(owner, name, BlockLinear(segs, lin.in_features, lin.bias, packed=device.type == "cuda"))
        if isinstance(layer.mlp, SparseMLP):  # read where the experts live, computed on `device`
            held = layer.mlp.experts
            names = [f"layers.{i}.mlp.experts.{n}" for n in ("gate", "up", "down")]
            parts = [parts_of(n, held.num_experts)[0] for n in names]
            types = [source.block_type(p.name) for p in parts]
            if all(kernel_takes(device, t) for t in types):
                read_to = placement.device_of(names[0]) or device
                hidden, ffn = int(held.gate.shape[2]), int(held.gate.shape[1])
                layer.mlp.hold_experts(BlockExperts([(t, source.blocks(p.name, read_to)) for p, t in zip(parts, types, strict=True)],
                                                    hidden, ffn, packed=device.type == "cuda"))
            else:
                for t in types:
                    if t not in FLOAT_TYPES and not kernel_takes(device, t):
                        dense[t.name] = dense.get(t.name, 0) + 1
    device = placement.device_of("embed_tokens.weight")
    if device is not None:
        emb = model.embed_tokens
        segs = segments("embed_tokens.weight", emb.num_embeddings, device)
        if segs is not None:
            (qtype, blocks), = segs
            model.embed_tokens = BlockEmbedding(qtype, blocks, emb.embedding_dim, dtype)
        if model.lm_head is None and isinstance(model.embed_tokens, BlockEmbedding):
            model.lm_head = model.embed_tokens.head()  # tied: the same blocks
        elif model.lm_head is not None:
            segs = segments("lm_head.weight", model.lm_head.weight.shape[0], device)
            if segs is not None:
                model.lm_head = BlockLinear(segs, model.lm_head.in_features, packed=device.type == "cuda")
    for name, count in sorted(dense.items()):
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        grow = torch.finfo(dtype).bits / 8 * block / size
        log.warning("%d %s tensors have no block kernel here: dequantized to %s on load "
                    "(%.1fx their file bytes)", count, name, str(dtype).removeprefix("torch."), grow)
