"""Weight-only int8: close to the dense weights, and a row's result independent of the batch."""

from __future__ import annotations

import torch

from strata.models.quantize import Int4Linear, Int8Linear, resolve_weight_mode


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


def test_int4_linear_holds_a_q4_1_grid_and_is_batch_invariant() -> None:
    torch.manual_seed(1)
    # weights on a Q4_1-style grid: per group of 32, offset + scale * code with codes 0..15
    codes = torch.randint(0, 16, (64, 96)).float()
    codes[:, ::32] = 0
    codes[:, 1::32] = 15  # every group spans the full code range
    scale = torch.rand(64, 3).repeat_interleave(32, dim=1) * 0.1 + 0.01
    low = torch.randn(64, 3).repeat_interleave(32, dim=1) * 0.1
    w = low + scale * codes
    lin = Int4Linear(w, None, torch.float32)
    x = torch.randn(20, 96)
    assert torch.allclose(lin(x), x @ w.t(), rtol=1e-4, atol=1e-4)  # the grid is held exactly
    xb = x.bfloat16()
    lin_b = Int4Linear(w, None, torch.bfloat16)
    full = lin_b(xb)
    for m in (1, 2, 3, 7, 16):
        assert torch.equal(lin_b(xb[:m]), full[:m]), f"rows differ with {m} rows"


def test_weight_mode_auto_follows_the_file_on_the_cpu_in_bf16() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_weight_mode("auto", cpu, torch.bfloat16) == "int8"
    assert resolve_weight_mode("auto", cpu, torch.bfloat16, four_bit_source=True) == "int4"
    assert resolve_weight_mode("auto", cuda, torch.bfloat16, four_bit_source=True) == "dense"
    assert resolve_weight_mode("auto", cpu, torch.float32) == "dense"
    assert resolve_weight_mode("auto", cuda, torch.bfloat16) == "dense"
    assert resolve_weight_mode("dense", cpu, torch.bfloat16) == "dense"
