"""Weight-only int8 for CPU decoding: half the bytes of bf16 per token, same results per row.

Decoding one token reads every weight once, so on the CPU its speed is set
by weight bytes. `Int8Linear` keeps each output row as int8 codes with one
scale (symmetric, amax / 127) and multiplies through torch's own
`_weight_int8pack_mm`, which gives each row the same bits whatever the
number of rows (measured: batch company and prompt chunking do not change a
lane's output). The dense weights are dropped after quantization.
"""

from __future__ import annotations

import torch
from torch import nn

WEIGHT_MODES = ("auto", "dense", "int8")


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


def resolve_weight_mode(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` is int8 on the CPU in bfloat16 (decode is bound by weight bytes), else dense."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHT_MODES)}, not {mode!r}")
    if mode == "auto":
        return "int8" if device.type == "cpu" and dtype == torch.bfloat16 else "dense"
    return mode


def quantize_int8(model: nn.Module) -> None:
    """Replace every projection (and the output head) of a DecoderModel by Int8Linear, in place."""
    dtype = model.embed_tokens.weight.dtype
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for owner, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
            lin = getattr(owner, name)
            setattr(owner, name, Int8Linear(lin.weight, lin.bias, dtype))
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.lm_head = Int8Linear(head, None, dtype)
