"""The row-wise layer kernels (C++ on the CPU) against their torch versions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.kernels.cpu.loader import cpu_kernel
from strata.models import ops

DTYPES = [torch.bfloat16, torch.float32, torch.float16]


@pytest.fixture(scope="module")
def kernel():
    k = cpu_kernel()
    assert k is not None, "the CPU kernels did not build (is a C++ compiler installed?)"
    return k


def _torch_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm, step by step."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [576, 40, 7])
def test_rms_norm_close_to_hugging_face(kernel, dtype, n) -> None:
    torch.manual_seed(n)
    x = (torch.randn(33, n) * 3).to(dtype)
    w = torch.rand(n).to(dtype)
    got = kernel.rms_norm(x, w, 1e-5)
    want = _torch_norm(x, w, 1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    if dtype != torch.float32:  # only the sum of squares differs: after rounding, mostly the same bits
        assert (got == want).float().mean() > 0.9
    # one row alone is the same bits as inside the batch
    assert torch.equal(kernel.rms_norm(x[5:6].contiguous(), w, 1e-5), got[5:6])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_sum_is_torch_add(kernel, dtype) -> None:
    torch.manual_seed(1)
    h, a = torch.randn(4, 64).to(dtype), torch.randn(4, 64).to(dtype)
    w = torch.rand(64).to(dtype)
    s, y = kernel.add_rms_norm(h, a, w, 1e-6)
    assert torch.equal(s, h + a)
    assert torch.equal(y, kernel.rms_norm(h + a, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qkv_is_the_torch_expression_bit_for_bit(kernel, dtype) -> None:
    torch.manual_seed(2)
    t, hq, hkv, d = 5, 6, 2, 32
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    ang = torch.rand(t, 1, d // 2) * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([-ang.sin(), ang.sin()], -1).to(dtype)
    got = kernel.rope_qkv(qkv, cos, sin, hq, hkv)
    x = qkv.view(t, -1, d)[:, : hq + hkv]
    rot = x * cos + torch.roll(x, d // 2, dims=-1) * sin
    assert torch.equal(got[0], rot[:, :hq])
    assert torch.equal(got[1], rot[:, hq:])
    assert torch.equal(got[2], qkv.view(t, -1, d)[:, hq + hkv :])
    for g, w in zip(got, ops.rope_qkv(qkv, cos, sin, hq, hkv, d)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_close_to_torch(kernel, dtype) -> None:
    torch.manual_seed(3)
    gu = (torch.randn(9, 2 * 100) * 4).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = kernel.silu_mul(gu)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(kernel.silu_mul(gu[3:4].contiguous()), got[3:4])


def test_silu_mul_at_the_ends_of_the_exponent_range(kernel) -> None:
    """The kernel's own exp (`exp_ieee`): large gates of either sign, the edges of its range,
    infinities and NaN give torch's silu (NaN where torch gives NaN)."""
    gate = torch.tensor([-1e4, -100.0, -88.5, -88.3, -87.4, -87.3, -30.0, -1e-3, 0.0, 1e-3, 30.0, 87.4, 88.5,
                         1e4, float("inf"), float("-inf"), float("nan")])
    gu = torch.cat([gate, torch.full_like(gate, 1.5)]).unsqueeze(0)
    want = F.silu(gate) * 1.5
    got = kernel.silu_mul(gu)[0]
    torch.testing.assert_close(got, want, atol=1e-30, rtol=1e-6, equal_nan=True)
    x = torch.linspace(-80, 80, 20001)
    dense = kernel.silu_mul(torch.cat([x, torch.ones_like(x)]).unsqueeze(0))[0]
    torch.testing.assert_close(dense, F.silu(x), atol=1e-30, rtol=4e-7)


def test_shape_errors_are_clear(kernel) -> None:
    with pytest.raises(RuntimeError, match="x and weight differ"):
        kernel.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        kernel.rope_qkv(torch.randn(2, 100), torch.randn(2, 1, 8), torch.randn(2, 1, 8), 4, 2)
