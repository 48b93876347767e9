"""The Triton row-wise kernels (`strata/kernels/triton/fused.py`) against the torch branch of `models/ops.py`.

RoPE (with q, k, v split out) and the residual sum must be bit-identical to
torch. RMSNorm and SiLU * up may differ from torch in the last float32 bits
(statistics summed in another order, another exp), so a rounded
intermediate (the normalised row, silu(gate)) may differ by one unit in the
last place of the dtype, which the product with the weight or with up
carries to at most three units of the output; and they must give torch's
bits almost everywhere. Every row is computed alone: a row by itself and the
same row in a batch give the same bits.
"""

from __future__ import annotations

from unittest import mock

import pytest

from tests.gpu.kernel_device import kernel_device  # before any kernel is defined

DEV = kernel_device()

import torch

from strata.kernels.triton import fused
from strata.models import ops
from strata.models.rope import rope_tables

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}  # significand bits
# (hidden size, intermediate size, q heads, kv heads, head_dim): the 8B shape, the default
# model's, and odd sizes (masked tails; rows longer than one norm tile)
SHAPES = {
    "8b": (4096, 14336, 32, 8, 128),
    "small": (576, 1536, 9, 3, 64),
    "odd": (fused.NORM_BLOCK + 300, 1000, 3, 1, 80),
}
EPS = 1e-5


def torch_branch(name: str, *args):
    """ops.<name> through its torch expressions (no C++ kernel, no Triton) on any device."""
    with mock.patch.object(ops, "cpu_kernels", lambda x: None), \
            mock.patch.object(ops, "fused_kernels", lambda x: None):
        return getattr(ops, name)(*args)


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


def assert_rounding_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """At most 3 units in the last place of the dtype from torch (fp32: 16, about 1e-6), and
    (bf16, fp16) at least 99% of the elements with torch's bits."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    exponent = torch.frexp(ref.float()).exponent
    ulp = torch.ldexp(torch.ones_like(ref, dtype=torch.float32), exponent - BITS[ref.dtype])
    err = (out.float() - ref.float()).abs() / ulp
    assert err.max().item() <= (3 if out.dtype != torch.float32 else 16), err.max().item()
    if out.dtype != torch.float32:
        same = (out == ref).float().mean().item()
        assert same >= 0.99, f"only {same:.4f} of the elements have torch's bits"


def rope_inputs(shape: str, dtype: torch.dtype, rows: slice, seed: int):
    _, _, hq, hkv, d = SHAPES[shape]
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
    cos_t, sin_t = rope_tables(inv, 9000, dtype, torch.device(DEV))
    pos = torch.tensor([0, 1, 4097, 8191, 37, 512, 8999][rows], device=DEV)
    qkv = randn(7, (hq + 2 * hkv) * d, dtype=dtype, seed=seed, scale=3.0)[rows]
    return qkv, cos_t[pos].unsqueeze(1), sin_t[pos].unsqueeze(1), hq, hkv, d


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("zero", [False, True], ids=["plain", "zero_centred"])
def test_rms_norm(shape: str, dtype: torch.dtype, zero: bool) -> None:
    """Llama's order (weight times the rounded normalised row) and Qwen3-Next's zero-centred one
    ((1 + weight) times it, all in float32, rounded once)."""
    n = SHAPES[shape][0]
    x = randn(5, n, dtype=dtype, seed=1, scale=2.0)
    w = randn(n, dtype=dtype, seed=2, scale=0.3) + (0.0 if zero else 1.0)
    ref = torch_branch("zero_rms_norm" if zero else "rms_norm", x, w, EPS)
    assert_rounding_close(fused.rms_norm(x, w, EPS, zero_centred=zero), ref)
    if zero:  # negative control: the plain norm's order is not the zero-centred one
        assert not torch.equal(fused.rms_norm(x, w, EPS), ref)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("zero", [False, True], ids=["plain", "zero_centred"])
def test_add_rms_norm(shape: str, dtype: torch.dtype, zero: bool) -> None:
    n = SHAPES[shape][0]
    h = randn(5, n, dtype=dtype, seed=3, scale=4.0)
    a = randn(5, n, dtype=dtype, seed=4)
    w = randn(n, dtype=dtype, seed=5, scale=0.3) + (0.0 if zero else 1.0)
    s, x = fused.add_rms_norm(h, a, w, EPS, zero_centred=zero)
    s_ref, x_ref = torch_branch("add_zero_rms_norm" if zero else "add_rms_norm", h, a, w, EPS)
    assert torch.equal(s, s_ref)
    assert_rounding_close(x, x_ref)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_rope_qkv_bit_identical(shape: str, dtype: torch.dtype) -> None:
    args = rope_inputs(shape, dtype, slice(0, 7), seed=6)
    out = fused.rope_qkv(*args)
    ref = torch_branch("rope_qkv", *args)
    for o, r in zip(out, ref):
        assert o.is_contiguous() and o.shape == r.shape and o.dtype == r.dtype
        assert torch.equal(o, r)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_silu_mul(shape: str, dtype: torch.dtype) -> None:
    i = SHAPES[shape][1]
    gate_up = randn(3, 2 * i, dtype=dtype, seed=7, scale=3.0)
    assert_rounding_close(fused.silu_mul(gate_up), torch_branch("silu_mul", gate_up))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("dv", [128, 80])
def test_gated_rms_norm(dtype: torch.dtype, dv: int) -> None:
    """The DeltaNet's output norm [T, Hv, Dv] times silu(z)."""
    x = randn(6, 4, dv, dtype=dtype, seed=34, scale=2.0)
    z = randn(6, 4, dv, dtype=dtype, seed=35, scale=3.0)
    w = randn(dv, dtype=dtype, seed=36) + 1.0
    assert_rounding_close(fused.gated_rms_norm(x, z, w, EPS), torch_branch("gated_rms_norm", x, z, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_deltanet_gates(dtype: torch.dtype) -> None:
    """beta = sigmoid(b) and g = -exp(A_log) * softplus(a + dt_bias), past softplus' threshold too."""
    b = randn(9, 32, dtype=dtype, seed=37, scale=3.0)
    a = randn(9, 32, dtype=dtype, seed=38, scale=8.0)
    a[0, :4] = torch.tensor([25.0, -30.0, 19.5, 20.5], dtype=dtype)
    a_log = randn(32, dtype=dtype, seed=39)
    dt_bias = randn(32, dtype=dtype, seed=40)
    beta, g = fused.deltanet_gates(b, a, a_log, dt_bias)
    beta_ref, g_ref = torch_branch("deltanet_gates", b, a, a_log, dt_bias)
    assert g.dtype == g_ref.dtype == torch.float32
    assert_rounding_close(beta, beta_ref)
    assert torch.allclose(g, g_ref, rtol=4e-6, atol=0)
    assert not torch.allclose(g, torch_branch("deltanet_gates", b, a, a_log, dt_bias.flip(0))[1], rtol=4e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_deltanet_gates_of_minus_infinity_are_exact_no_ops(dtype: torch.dtype) -> None:
    """A captured prompt step masks its padding rows' b and a to -inf (`GatedDeltaNet.mix_padded`):
    beta must be exactly 0 and the decay exp(g) exactly 1, so the row leaves the state alone."""
    b = randn(3, 32, dtype=dtype, seed=41, scale=3.0)
    a = randn(3, 32, dtype=dtype, seed=42, scale=3.0)
    b[1], a[1] = float("-inf"), float("-inf")
    beta, g = fused.deltanet_gates(b, a, randn(32, dtype=dtype, seed=43), randn(32, dtype=dtype, seed=44))
    assert torch.equal(beta[1], torch.zeros_like(beta[1])) and torch.equal(g[1].exp(), torch.ones_like(g[1]))
    assert (beta[[0, 2]] != 0).all() and (g[[0, 2]] < 0).all()  # the other rows are gates as ever


def _batch(shape: str, dtype: torch.dtype, rows: slice) -> tuple:
    """Inputs of every kernel: `rows` of fixed tensors of 7 rows."""
    n, i, *_ = SHAPES[shape]
    h = randn(7, n, dtype=dtype, seed=8, scale=4.0)[rows]
    a = randn(7, n, dtype=dtype, seed=9)[rows]
    w = randn(n, dtype=dtype, seed=10) + 1.0
    gate_up = randn(7, 2 * i, dtype=dtype, seed=11, scale=3.0)[rows]
    return h, a, w, gate_up, rope_inputs(shape, dtype, rows, seed=12)


def _each_op(h, a, w, gate_up, rope) -> list[torch.Tensor]:
    """Every kernel's outputs."""
    return [fused.rms_norm(h, w, EPS), *fused.add_rms_norm(h, a, w, EPS), *fused.rope_qkv(*rope),
            fused.silu_mul(gate_up), fused.rms_norm(h, w, EPS, zero_centred=True),
            fused.gated_rms_norm(h.view(h.shape[0], -1, 4), a.view(a.shape[0], -1, 4), w[:4], EPS)]


@pytest.mark.parametrize("shape", ["8b", "odd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rows_do_not_depend_on_the_batch(shape: str, dtype: torch.dtype) -> None:
    batch = _each_op(*_batch(shape, dtype, slice(0, 7)))
    h, a, w, gate_up, rope = _batch(shape, dtype, slice(3, 4))  # row 3 by itself, in new memory
    rope = tuple(r.clone() if isinstance(r, torch.Tensor) else r for r in rope)
    alone = _each_op(h.clone(), a.clone(), w, gate_up.clone(), rope)
    for b, one in zip(batch, alone):
        assert torch.equal(b[3:4], one)


def test_ops_route_cuda_tensors_to_the_kernels() -> None:
    if DEV != "cuda":
        pytest.skip("the interpreter runs the kernels on CPU tensors, which ops gives to C++")
    assert ops.fused_kernels(torch.zeros(1, device="cuda")) is fused
    assert ops.fused_kernels(torch.zeros(1)) is None
    n, i, *_ = SHAPES["8b"]
    x = randn(2, n, dtype=torch.bfloat16, seed=13)
    w = randn(n, dtype=torch.bfloat16, seed=14)
    gate_up = randn(2, 2 * i, dtype=torch.bfloat16, seed=15)
    rope = rope_inputs("8b", torch.bfloat16, slice(0, 2), seed=16)
    pairs = [(ops.rms_norm(x, w, EPS), fused.rms_norm(x, w, EPS)),
             (ops.silu_mul(gate_up), fused.silu_mul(gate_up)),
             (ops.add_rms_norm(x, x, w, EPS)[1], fused.add_rms_norm(x, x, w, EPS)[1]),
             (ops.rope_qkv(*rope)[0], fused.rope_qkv(*rope)[0])]
    for got, want in pairs:
        assert torch.equal(got, want)
    # what the kernels do not take (mixed dtypes, strided rows) goes to torch
    assert ops.rms_norm(x, w.float(), EPS).dtype == torch.float32
    strided = gate_up[:, ::2]
    assert torch.equal(ops.silu_mul(strided), torch_branch("silu_mul", strided))


def test_kernels_replay_in_a_cuda_graph() -> None:
    if DEV != "cuda":
        pytest.skip("CUDA graphs need the device")
    inputs = _batch("8b", torch.bfloat16, slice(0, 4))
    eager = _each_op(*inputs)  # compiles every kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _each_op(*inputs)
    for c in captured:
        c.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for e, c in zip(eager, captured):
        assert torch.equal(e, c)
