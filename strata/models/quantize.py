"""Weight-only int8 and int4 for CPU decoding: fewer weight bytes per token, same results per row.

Decoding one token reads every weight once, so on the CPU its speed is set
by weight bytes (measured: a 1 MB int8 matrix that is not in cache takes
84 us, its int4 form 45 us). `Int8Linear` keeps each output row as int8 codes
with one scale (symmetric, amax / 127); `Int4Linear` keeps groups of 32
values as 4-bit codes with a scale and an offset, the layout of a GGUF Q4_1
block, so a 4-bit GGUF tensor is held at its own precision. Both multiply
through torch's own weight-only kernels, which give each row the same bits
whatever the number of rows (measured: batch company and prompt chunking do
not change a lane's output). The dense weights are dropped.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.models.moe import dense_mlp

WEIGHT_MODES = ("auto", "dense", "gguf", "int8", "int4")
INT4_GROUP = 32


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scale.to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.out_features, self.in_features = codes.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.codes, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """Groups of 32 input values per output row as 4-bit codes, a scale and an offset."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        n, k = weight.shape
        g = weight.detach().float().reshape(n, k // INT4_GROUP, INT4_GROUP)
        low, high = g.amin(dim=-1), g.amax(dim=-1)
        scale = ((high - low) / 15.0).clamp(min=1e-12)
        codes = torch.round((g - low[..., None]) / scale[..., None]).clamp_(0, 15)
        codes = codes.to(torch.int32).reshape(n, k)
        # the kernel computes (code - 8) * scale + zero
        sz = torch.stack([scale, low + 8.0 * scale], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1))
        self.register_buffer("scales_zeros", sz.to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.out_features, self.in_features = n, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]), self.packed, INT4_GROUP,
                                              self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def resolve_weight_mode(mode: str, device: torch.device, dtype: torch.dtype,
                        four_bit_source: bool = False, block_source: bool = False) -> str:
    """`auto`: gguf (the file's blocks, `blocks.py`) for a GGUF file whose weights are blocks the
    device's kernels take; otherwise on the CPU in bfloat16 int4 for a file whose projections are
    4-bit, else int8. Never fewer bits than the file holds; elsewhere (GPU, float32) dense.
    """
    if mode not in WEIGHT_MODES:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHT_MODES)}, not {mode!r}")
    if mode == "auto":
        if block_source:
            return "gguf"
        if device.type != "cpu" or dtype != torch.bfloat16:
            return "dense"
        return "int4" if four_bit_source else "int8"
    return mode


def projections(layer: nn.Module) -> list[tuple[nn.Module, str]]:
    """(owner, attribute) of a layer's dense projections: attention's (or a gated DeltaNet's, in a
    Qwen3-Next linear-attention layer) and the dense MLP's; routed experts and routers stay in the
    compute dtype."""
    owners: list[tuple[nn.Module, str]] = []
    attn = layer.self_attn
    if attn is not None:
        owners += [(attn, "qkv_proj"), (attn, "o_proj")]
    delta = getattr(layer, "linear_attn", None)  # only Qwen3-Next's layers have one
    if delta is not None:
        owners += [(delta, "in_proj_qkvz"), (delta, "in_proj_ba"), (delta, "out_proj")]
    mlp = dense_mlp(layer.mlp)
    if mlp is not None:
        owners += [(mlp, "gate_up_proj"), (mlp, "down_proj")]
    return owners


def quantize_weights(model: nn.Module, mode: str, dtype: torch.dtype) -> None:
    """Replace the projections of a DecoderModel by Int8Linear or Int4Linear, in place.

    The output head is always int8: it is the tied embedding in small models,
    stored with 8 bits in their files, and its errors reach every logit.
    `dtype`: the compute dtype (passed in: a remote stage's worker holds no
    embedding to read it from).
    """
    for layer in model.layers:
        for owner, name in projections(layer):
            lin = getattr(owner, name)
            if lin.weight.is_meta:  # a layer another stage of a split holds
                continue
            n, k = lin.weight.shape  # torch's int4 packing takes rows in multiples of 16
            four = mode == "int4" and k % INT4_GROUP == 0 and n % 16 == 0
            cls = Int4Linear if four else Int8Linear
            setattr(owner, name, cls(lin.weight, lin.bias, dtype))
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if not head.is_meta:
        model.lm_head = Int8Linear(head, None, dtype)
