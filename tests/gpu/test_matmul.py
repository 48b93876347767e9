"""The batch-invariant product (`strata/kernels/triton/matmul.py`): exact sums, and a row's bits
the same at any number of rows and under every launch shape the rule picks."""

from __future__ import annotations

import pytest

from tests.gpu.kernel_device import INTERPRET, kernel_device  # before any kernel is defined

DEV = kernel_device()

import torch

from strata.kernels.triton import matmul

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# the rule's launch shapes for bf16 at 1, 16, 64, 256 and 1024 rows, and the float32 ones
SHAPES = sorted({matmul.config_for(m, n, dt) for m in (1, 16, 17, 64, 65, 256, 257)
                 for n in (64, 20000) for dt in DTYPES})
ROWS = [1, 2, 3, 7, 16, 17, 33, 64] if INTERPRET else [1, 2, 3, 7, 16, 17, 33, 64, 65, 130, 300]


def _data(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV)
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_products_are_exact_sums(dtype: torch.dtype) -> None:
    """Against float64 products: within float32 accumulation of the dtype's inputs, rounded once
    to the output dtype; a K that is not a multiple of BLOCK_K, N not of the column tile."""
    x, w, b = _data(37, 100, 208, dtype)
    ref = x.double() @ w.double().T + b.double()
    for out in (dtype, torch.float32):
        y = matmul.matmul(x, w, b, out_dtype=out)
        assert y.dtype == out and y.shape == (37, 100)
        tol = (1e-5 if out == torch.float32 else {torch.bfloat16: 8e-3, torch.float16: 1e-3,
                                                   torch.float32: 1e-5}[dtype]) * ref.abs().max()
        assert float((y.double() - ref).abs().max()) <= float(tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_rows_do_not_depend_on_their_company(dtype: torch.dtype) -> None:
    """Each row of a launch of M rows has the bits of the same row launched alone, for every M
    and every launch shape of the rule (a row's tile, its place in it, warps and stages vary)."""
    k = 320 if INTERPRET else 4096
    xs, w, b = _data(max(ROWS), 96, k, dtype, seed=1)
    alone = torch.cat([matmul.matmul(xs[i : i + 1], w, b, config=SHAPES[0]) for i in range(max(ROWS))])
    for shape in SHAPES:
        for m in ROWS:
            assert torch.equal(matmul.matmul(xs[:m], w, b, config=shape), alone[:m]), (shape, m)
    assert torch.equal(matmul.matmul(xs, w, b), alone)  # the rule's own pick


def test_negative_control() -> None:
    """The comparison sees a different order of the same sum: the columns of x and w permuted
    (the same products, summed in another order) change some row's bits."""
    xs, w, _ = _data(64, 96, 320 if INTERPRET else 4096, torch.bfloat16, seed=2)
    perm = torch.randperm(xs.shape[1], generator=torch.Generator().manual_seed(3)).to(DEV)
    a = matmul.matmul(xs, w, out_dtype=torch.float32)
    p = matmul.matmul(xs[:, perm].contiguous(), w[:, perm].contiguous(), out_dtype=torch.float32)
    assert not torch.equal(a, p)
    assert float((a - p).abs().max()) < 1e-3 * float(a.abs().max())  # but only just


def test_what_it_does_not_take() -> None:
    x, w, _ = _data(4, 32, 64, torch.bfloat16)
    assert matmul.takes(x, w)
    assert not matmul.takes(x[:, :40], w[:, :40])  # K not a multiple of 16
    assert not matmul.takes(x, w.float())  # mixed dtypes
    assert not matmul.takes(x.t(), w)  # not unit stride along K
