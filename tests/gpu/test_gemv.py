"""The one-row matrix-vector kernels (`strata/kernels/triton/gemv.py`) against float64 products.

The reference rounds where the unfused ops round: the normalised row (the
torch branch of `ops.rms_norm`), the product (computed in float64, rounded
once), silu(gate), the residual sum. The kernel accumulates in float32, so a
product may land one unit in the last place away when it sits near a
rounding boundary; everything downstream of such a product may carry it.
"""

from __future__ import annotations

import pytest

from tests.gpu.kernel_device import INTERPRET, kernel_device  # before any kernel is defined

DEV = kernel_device()

import torch
import torch.nn.functional as F

from strata.kernels.triton import gemv
from tests.gpu.test_fused_ops import BITS, randn, torch_branch

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = 1e-5
# (N, K): the default model's q/k/v and down_proj, a tail of rows, the narrowest tile;
# on the device also the 8B shapes
SHAPES = [(960, 576), (576, 1536), (1001, 576), (37, 80)]
if not INTERPRET:
    SHAPES += [(6144, 4096), (4096, 14336)]


def reference(x, w, bias=None, norm_weight=None, silu=False, residual=None):
    """The unfused ops' rounding with exact (float64) products; also sum |x| |w| per output."""
    dt = x.dtype
    if norm_weight is not None:
        x = torch_branch("rms_norm", x, norm_weight, EPS)
    y = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    if bias is not None:
        y = y + bias.double()
    y = y.to(dt)
    if silu:
        g, u = y.chunk(2, dim=-1)
        y = (F.silu(g.float()).to(dt).float() * u.float()).to(dt)
        mag = torch.maximum(*mag.chunk(2, dim=-1)) * (1 + g.double().abs())
    if residual is not None:
        y = (residual.float() + y.float()).to(dt)
    return y, mag


def assert_close(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor) -> None:
    """Within 3 units in the last place of the result plus float32 accumulation error, and
    (bf16, fp16) the reference's bits in at least 97% of the outputs."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    exponent = torch.frexp(ref.float()).exponent
    ulp = torch.ldexp(torch.ones_like(ref, dtype=torch.float32), exponent - BITS[ref.dtype])
    err = (out.double() - ref.double()).abs()
    bound = 3 * ulp.double() + 8 * 2.0**-24 * mag
    assert bool((err <= bound).all()), float((err / bound).max())
    if out.dtype != torch.float32:
        same = (out == ref).float().mean().item()
        assert same >= 0.97, f"only {same:.4f} of the outputs have the reference's bits"


def inputs(n: int, k: int, dt: torch.dtype, seed: int):
    x = randn(1, k, dtype=dt, seed=seed, scale=2.0)
    w = randn(n, k, dtype=dt, seed=seed + 1, scale=k**-0.5)
    return x, w


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_plain_product(shape: tuple[int, int], dtype: torch.dtype) -> None:
    x, w = inputs(*shape, dtype, seed=1)
    assert_close(gemv.gemv(x, w), *reference(x, w))


@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_norm_prologue_and_bias(shape: tuple[int, int], dtype: torch.dtype) -> None:
    n, k = shape
    x, w = inputs(n, k, dtype, seed=2)
    nw = randn(k, dtype=dtype, seed=4) * 0.2 + 1.0
    bias = randn(n, dtype=dtype, seed=5, scale=0.5)
    out = gemv.gemv(x, w, bias, norm_weight=nw, eps=EPS)
    assert_close(out, *reference(x, w, bias, norm_weight=nw))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_norm_and_silu(dtype: torch.dtype) -> None:
    x, w = inputs(2 * 1536, 576, dtype, seed=3)  # gate rows, then up rows
    nw = randn(576, dtype=dtype, seed=6) * 0.2 + 1.0
    out = gemv.gemv(x, w, norm_weight=nw, eps=EPS, silu=True)
    assert out.shape == (1, 1536)
    assert_close(out, *reference(x, w, norm_weight=nw, silu=True))


def _ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at each value of t (float64)."""
    exponent = torch.frexp(t.to(dtype).float()).exponent
    return torch.ldexp(torch.ones_like(t, dtype=torch.float64), exponent - BITS[dtype])


@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128)], ids=["small", "8b"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_rope_epilogue(heads: tuple[int, int, int], dtype: torch.dtype) -> None:
    """q/k/v with RoPE in the epilogue against RoPE of the exact (float64) product: within the
    rounding of the product (carried through cos and sin), of the two rotated terms and of
    the result, plus float32 accumulation; v heads are the plain product."""
    from strata.models.rope import rope_tables

    hq, hkv, d = heads
    if INTERPRET and d == 128:
        pytest.skip("the 8B shape is slow under the interpreter")
    k = 576 if d == 64 else 4096
    n = (hq + 2 * hkv) * d
    x, w = inputs(n, k, dtype, seed=13)
    nw = randn(k, dtype=dtype, seed=14) * 0.2 + 1.0
    bias = randn(n, dtype=dtype, seed=15, scale=0.5)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    cos_t, sin_t = rope_tables(inv, 600, dtype, torch.device(DEV))
    cos, sin = cos_t[517].contiguous(), sin_t[517].contiguous()
    roped = gemv.gemv(x, w, bias, norm_weight=nw, eps=EPS, rope=(cos, sin, hq + hkv, d))

    xn = torch_branch("rms_norm", x, nw, EPS).double()
    y = (xn @ w.double().T + bias.double()).view(-1, d)  # [heads, d], exact
    acc = (xn.abs() @ w.double().abs().T).view(-1, d) * 8 * 2.0**-24
    err_in = _ulp(y, dtype) + acc  # the product as the kernel rounds it
    partner = torch.roll(y, d // 2, dims=-1)
    err_partner = torch.roll(err_in, d // 2, dims=-1)
    c, sn = cos.double(), sin.double()
    rot = y * c + partner * sn
    t1, t2 = y * c, partner * sn
    tol_rot = 2 * (c.abs() * err_in + sn.abs() * err_partner) + _ulp(t1, dtype) + _ulp(t2, dtype) \
        + 2 * _ulp(rot, dtype)
    is_rot = (torch.arange(y.shape[0], device=y.device) < hq + hkv)[:, None]
    ref = torch.where(is_rot, rot, y)
    tol = torch.where(is_rot, tol_rot, err_in)
    err = (roped.double().view(-1, d) - ref).abs()
    assert bool((err <= tol).all()), float((err / tol).max())
    with pytest.raises(ValueError, match="rope needs"):
        gemv.gemv(x, w, rope=(cos[:10], sin, hq + hkv, d))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_residual_epilogue(dtype: torch.dtype) -> None:
    x, w = inputs(576, 1536, dtype, seed=7)
    h = randn(1, 576, dtype=dtype, seed=8, scale=4.0)
    out = gemv.gemv(x, w, residual=h)
    assert_close(out, *reference(x, w, residual=h))


def test_float32_logits_are_the_rounded_product() -> None:
    x, w = inputs(1001, 576, torch.bfloat16, seed=9)
    out = gemv.gemv(x, w, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, gemv.gemv(x, w).float())


def test_what_it_does_not_take() -> None:
    x, w = inputs(64, 576, torch.bfloat16, seed=11)
    assert gemv.takes(x, w)
    assert not gemv.takes(x.expand(2, -1).contiguous(), w)  # two rows: cuBLAS
    assert not gemv.takes(x, w.float())  # mixed dtypes
    assert not gemv.takes(x[:, :570], w[:, :570])  # not a multiple of 16 columns
    with pytest.raises(ValueError, match="odd number of rows"):
        gemv.gemv(x, w[:63], silu=True)
    with pytest.raises(ValueError, match="residual"):
        gemv.gemv(x, w, residual=x)
    with pytest.raises(ValueError, match="norm weight"):
        gemv.gemv(x, w, norm_weight=x[0, :100], eps=EPS)
    with pytest.raises(ValueError, match="one contiguous row"):
        gemv.gemv(x.expand(2, -1), w)



@pytest.mark.skipif(INTERPRET, reason="routing needs CUDA tensors (the interpreter runs on CPU ones)")
def test_one_row_model_step_takes_the_row_kernels() -> None:
    """A one-row CUDA forward runs four products a layer plus the head through gemv, and its
    logits stay close to the unfused path (cuBLAS, separate norm / SwiGLU / add kernels)."""
    from unittest import mock

    from strata.kv.step import SeqSpec
    from strata.kv.formats import make_format
    from strata.attention.triton_pool import GpuTableAttention
    from strata.kv.pool import KvPool
    from strata.models import ops
    from strata.models.base import ModelConfig
    from strata.models.layers import DecoderModel

    cfg = ModelConfig(arch="llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32,
                      max_position_embeddings=256)
    torch.manual_seed(0)
    model = DecoderModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.1)
    model = model.to(DEV, torch.bfloat16).eval()
    model.set_max_positions(256)

    def step(pool: KvPool) -> torch.Tensor:
        ctx = GpuTableAttention(pool, [SeqSpec(0, 0, 1)], 32**-0.5)
        with torch.inference_mode():
            hidden = model(torch.tensor([7], device=DEV), torch.tensor([0], device=DEV), ctx)
            return model.compute_logits(hidden)

    pools = [KvPool(make_format("bf16", 2, 32), 2, 1, 256, 64, None, DEV) for _ in range(2)]
    for p in pools:
        assert p.reserve(0, 8)
    calls = []
    real = gemv.gemv
    with mock.patch.object(gemv, "gemv", lambda *a, **k: calls.append(1) or real(*a, **k)):
        fused_logits = step(pools[0])
    assert len(calls) == 4 * cfg.num_layers + 1
    with mock.patch.object(ops, "gemv_kernels", lambda: None):
        ref = step(pools[1])
    assert fused_logits.dtype == torch.float32
    rel = float((fused_logits - ref).norm() / ref.norm())
    assert rel < 1e-2, rel


@pytest.mark.skipif(INTERPRET, reason="programmatic dependent launch needs a GPU")
def test_chained_products_with_pdl_equal_the_serial_launches() -> None:
    """Each product reads the one before (through x, the norm and the residual): launched with
    programmatic dependent launch, eagerly and from a CUDA graph, the bits equal plain launches,
    so no program reads its inputs before the kernel that writes them has finished."""
    from unittest import mock

    h0 = randn(1, 4096, dtype=torch.bfloat16, seed=20)
    ws = [randn(n, k, dtype=torch.bfloat16, seed=21 + i, scale=k**-0.5)
          for i, (n, k) in enumerate([(6144, 4096), (4096, 6144), (2 * 14336, 4096), (4096, 14336)])]
    nw = randn(4096, dtype=torch.bfloat16, seed=30) * 0.1 + 1.0

    def chain() -> torch.Tensor:
        h = h0
        for _ in range(4):
            qkv = gemv.gemv(h, ws[0], norm_weight=nw, eps=EPS)
            h = gemv.gemv(qkv, ws[1], residual=h)
            act = gemv.gemv(h, ws[2], norm_weight=nw, eps=EPS, silu=True)
            h = gemv.gemv(act, ws[3], residual=h)
        return h

    with mock.patch.object(gemv, "pdl_on", lambda index: False):
        serial = chain()
    with mock.patch.object(gemv, "pdl_on", lambda index: True):
        eager = chain()
        graph = torch.cuda.CUDAGraph()
        chain()  # compiled outside the capture
        with torch.cuda.graph(graph):
            captured = chain()
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(serial, eager)
    assert torch.equal(serial, captured)
