"""The code-to-float tricks of the attention kernels' tiles (`kernels/triton/cells.py`) are exact.

int8 codes and Q4_0 nibbles become floats by or-ing them into the mantissa of 2**23 instead of
an integer-to-float conversion; every code must come out as the float it is.
"""

from __future__ import annotations

import torch

from tests.gpu.kernel_device import kernel_device

DEV = kernel_device()

import triton
import triton.language as tl

from strata.kernels.triton.cells import int8_floats, q4_floats


@triton.jit
def _int8_kernel(codes, out, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out + offs, int8_floats(tl.load(codes + offs)))


def test_every_int8_code_is_its_float() -> None:
    codes = torch.arange(-128, 128, dtype=torch.int8, device=DEV)
    out = torch.empty(256, dtype=torch.float32, device=DEV)
    _int8_kernel[(1,)](codes, out, N=256)
    assert torch.equal(out.cpu(), codes.cpu().float())


@triton.jit
def _q4_kernel(codes, out, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out + offs, q4_floats(tl.load(codes + offs)))


def test_every_q4_0_nibble_is_its_value() -> None:
    codes = torch.arange(16, dtype=torch.int32, device=DEV)
    out = torch.empty(16, dtype=torch.float32, device=DEV)
    _q4_kernel[(1,)](codes, out, N=16)
    assert torch.equal(out.cpu(), codes.cpu().float() - 8)
