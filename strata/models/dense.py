"""The dense pieces every layer is made of: a batch-invariant linear and the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.models import ops


def stable_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  invariant: bool = False) -> torch.Tensor:
    """F.linear whose rows do not depend on how many rows there are.

    On the CPU a single bf16 row takes a matrix-vector path whose low bits
    differ from the same row inside a larger matmul (measured: down_proj of
    the default model, 2.4e-4). Two rows always take the matrix path, so a
    lone row is computed as the first of two. On CUDA cuBLAS picks its kernel
    by the number of rows; `invariant` takes the Triton product that sums every
    row the same way at any count (`ops.invariant_product`).
    """
    if invariant:
        y = ops.invariant_product(x, weight, bias)
        if y is not None:
            return y
    if x.shape[0] == 1 and x.dim() == 2 and x.device.type == "cpu":
        return F.linear(x.expand(2, -1), weight, bias)[:1]
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear computed by `stable_linear`; `invariant` (`set_invariant`): on CUDA, the product
    whose rows do not depend on the batch (`--batch-invariant`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.invariant = False

    def set_invariant(self, on: bool) -> None:
        """Take the batch-invariant product on CUDA (on) or cuBLAS and the one-row kernels (off)."""
        self.invariant = on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stable_linear(x, self.weight, self.bias, self.invariant)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * ffn, bias=False)
        self.down_proj = Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(ops.silu_mul(self.gate_up_proj.forward(x)))
