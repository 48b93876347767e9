"""Weight-only int8: close to the dense weights, and a row's result independent of the batch."""

from __future__ import annotations

import torch

from strata.models.quantize import Int8Linear, resolve_weight_mode


def test_int8_linear_is_close_to_dense_and_batch_invariant() -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    lin = Int8Linear(w, torch.randn(96), torch.bfloat16)
    x = torch.randn(40, 64).bfloat16()
    full = lin(x)
    dense = torch.nn.functional.linear(x.float(), w) + lin.bias.float()
    assert (full.float() - dense).abs().max() < 0.1 * dense.abs().max()
    for m in (1, 2, 3, 7, 16):
        assert torch.equal(lin(x[:m]), full[:m]), f"rows differ with {m} rows"
    assert lin.codes.dtype == torch.int8 and lin.codes.abs().max() <= 127


def test_weight_mode_auto_is_int8_only_for_bf16_on_cpu() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_weight_mode("auto", cpu, torch.bfloat16) == "int8"
    assert resolve_weight_mode("auto", cpu, torch.float32) == "dense"
    assert resolve_weight_mode("auto", cuda, torch.bfloat16) == "dense"
    assert resolve_weight_mode("dense", cpu, torch.bfloat16) == "dense"
