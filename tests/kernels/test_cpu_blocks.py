"""block_matmul: x @ W.T with W in GGUF blocks, against gguf's own dequantization.

The weights it uses are gguf.quants.dequantize's float32 values to the bit
(an identity x reads them out); float32 x gives float32 sums of them (float64
reference within a float32 bound), bf16/fp16 x the fixed-point arithmetic of
blocks_fixed.cpp (an operation-by-operation reference, to the bit); a row's
result has the same bits whatever the batch around it and the thread count.
"""

from __future__ import annotations

from fractions import Fraction

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata.kernels.cpu.loader import BLOCK_TYPES, cpu_kernel

T = GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
# the fp16 fields of each type: scales (random bytes there could be NaN or inf), and mins
SCALES = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
          T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
MINS = {T.Q4_1: 2, T.Q5_1: 2, T.Q2_K: 82, T.Q4_K: 2, T.Q5_K: 2}
QUANTIZABLE = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}  # gguf-py 0.19 quantizes these, not the K-quants
GROUP = {T.Q6_K: 16, T.Q2_K: 16, T.Q3_K: 16}  # values per scale; 32 for the others


@pytest.fixture(scope="module")
def kernel():
    k = cpu_kernel()
    assert k is not None, "the CPU kernels did not build (is a C++ compiler installed?)"
    return k


def make_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, row bytes]: gguf's quantization of random weights where gguf has one, else
    random bytes (every code pattern) with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in QUANTIZABLE:
        w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 1.0, (n, 1))).astype(np.float32)
        return np.asarray(gguf.quants.quantize(w, qtype)).reshape(n, -1)
    raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for off in SCALES[qtype]:
        f = (rng.standard_normal(raw.shape[0]) * 0.02).astype(np.float16)
        raw[:, off:off + 2] = f.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def dequant(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    n = raw.shape[0]
    return np.asarray(gguf.quants.dequantize(raw.reshape(-1, GGML_QUANT_SIZES[qtype][1]), qtype),
                      dtype=np.float32).reshape(n, -1)


def bound(raw: np.ndarray, qtype: GGMLQuantizationType, x: np.ndarray) -> np.ndarray:
    """A float32 summation bound for the factored sums s * sum(q x) + m * sum(x):
    (terms in a chain) * 2**-24 * sum((|s q| + |m|) |x|)."""
    w = dequant(raw, qtype).astype(np.float64)
    mag = np.abs(w)
    if qtype in MINS:  # the min fields zeroed: s q alone, and m = w - s q
        size = GGML_QUANT_SIZES[qtype][1]
        no_min = raw.reshape(-1, size).copy()
        no_min[:, MINS[qtype]:MINS[qtype] + 2] = 0
        sq = dequant(no_min.reshape(raw.shape), qtype).astype(np.float64)
        mag = np.abs(sq) + np.abs(w - sq)
    k = x.shape[1]
    chain = k / 8 + 2 * k / GROUP.get(qtype, 32) + 8
    return chain * 2.0**-24 * (np.abs(x.astype(np.float64)) @ mag.T)


SHAPES = [(1, "one"), (7, "many"), (13, "one"), (50, "many")]  # N, K: one block or many


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,ks", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_matches_float64_product_of_gguf_weights(kernel, qtype, n, ks, m) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    k = block if ks == "one" else block * (6 if block == 256 else 18)
    raw = make_blocks(qtype, n, k, seed=n * 100 + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = kernel.block_matmul(x, torch.from_numpy(raw), int(qtype))
    assert got.shape == (m, n) and got.dtype == torch.float32
    want = x.double().numpy() @ dequant(raw, qtype).astype(np.float64).T
    err = np.abs(got.double().numpy() - want)
    assert (err <= bound(raw, qtype, x.numpy())).all(), err.max()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_weights_are_gguf_dequantize_to_the_bit(kernel, qtype) -> None:
    """x = identity reads each weight out: fp32(s * q) + m, rounded as gguf rounds it."""
    block = GGML_QUANT_SIZES[qtype][0]
    k = 2 * block
    raw = make_blocks(qtype, 9, k, seed=3)
    for m_rows in (k, 5):  # the tile path, and the one-lane path row by row
        eye = torch.eye(k)[:m_rows].contiguous()
        got = kernel.block_matmul(eye, torch.from_numpy(raw), int(qtype))
        assert torch.equal(got.T, torch.from_numpy(dequant(raw, qtype))[:, :m_rows])
    for i in range(0, k, 37):
        one = kernel.block_matmul(torch.eye(k)[i:i + 1].contiguous(), torch.from_numpy(raw), int(qtype))
        assert torch.equal(one[0], torch.from_numpy(dequant(raw, qtype))[:, i])


def fixed_point(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """blocks_fixed.cpp's x: per 32 values the step d = 2**(e - 15), max|x| = f 2**e with f in
    [0.5, 1), and the codes rint(x / d) (ties to even) as int16; a zero block has d = 0."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    _, e = np.frexp(np.abs(blocks).max(axis=2))
    zero = np.abs(blocks).max(axis=2) == 0
    d = np.where(zero, 0.0, np.ldexp(1.0, e - 15)).astype(np.float32)
    q = np.clip(np.rint(np.ldexp(blocks.astype(np.float64), (15 - e)[..., None])), -32768, 32767)
    q = np.where(zero[..., None], 0, q).astype(np.int16)
    return q.reshape(x.shape), d


def _fma32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """float32 a * b + c rounded once, to nearest even (Python 3.11 has no math.fma)."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(exact))
    best = near
    for cand in (np.nextafter(near, np.float32(-np.inf)), np.nextafter(near, np.float32(np.inf))):
        gap, best_gap = abs(Fraction(float(cand)) - exact), abs(Fraction(float(best)) - exact)
        if gap < best_gap or (gap == best_gap and int(cand.view(np.int32)) % 2 == 0):
            best = cand
    return best


def _simple_codes(raw_row: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes c, scales s and mins m (float32, per 32 values) of a Q4_0 / Q4_1 / Q8_0 row."""
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = raw_row.reshape(-1, size)
    s = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    if qtype == T.Q8_0:
        return blocks[:, 2:].view(np.int8).astype(np.int32).reshape(-1), s, np.zeros_like(s)
    at = 4 if qtype == T.Q4_1 else 2
    qs = blocks[:, at:at + 16].astype(np.int32)
    c = np.concatenate([qs & 15, qs >> 4], axis=1) - (8 if qtype == T.Q4_0 else 0)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0] if qtype == T.Q4_1 else np.zeros_like(s)
    return c.reshape(-1), s, m


def fixed_reference(raw: np.ndarray, qtype: GGMLQuantizationType, x: np.ndarray, tree: str = "kernel") -> np.ndarray:
    """blocks_fixed.cpp's arithmetic, operation by operation, for Q4_0 / Q4_1 / Q8_0."""
    q, d = fixed_point(x)
    out = np.zeros((x.shape[0], raw.shape[0]), dtype=np.float32)
    for n in range(raw.shape[0]):
        c, s, m = _simple_codes(raw[n], qtype)
        for i in range(x.shape[0]):
            acc = [np.float32(0)] * 16
            mn = np.float32(0)
            for j in range(x.shape[1] // 32):
                for k in range(16):
                    a, b = 32 * j + 2 * k, 32 * j + 2 * k + 1
                    pair = np.float32(int(c[a]) * int(q[i, a]) + int(c[b]) * int(q[i, b]))
                    acc[k] = _fma32(np.float32(s[j] * d[i, j]), pair, acc[k])
                if qtype == T.Q4_1:  # the min's own chain over the blocks
                    mn = _fma32(m[j], np.float32(d[i, j] * np.float32(int(q[i, 32 * j:32 * j + 32].sum()))), mn)
            lanes = np.array(acc, dtype=np.float32)
            if tree == "kernel":  # k + 8, k + 4, then (0 + 2) + (1 + 3)
                t = lanes[:8] + lanes[8:]
                t = t[:4] + t[4:]
                total = (t[0] + t[2]) + (t[1] + t[3])
            else:  # in order: a tree the kernel does not use
                total = np.float32(0)
                for v in lanes:
                    total = np.float32(total + v)
            out[i, n] = total + mn if qtype == T.Q4_1 else total
    return out


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 12])  # one lane, a few lanes, the tiles
def test_half_inputs_follow_the_fixed_point_arithmetic_to_the_bit(kernel, qtype, m) -> None:
    raw = make_blocks(qtype, 5, 64, seed=21 + m)
    x = (torch.randn(m, 64, generator=torch.Generator().manual_seed(m)) * 3).bfloat16()
    x[0, 40:64] *= 1e-4  # values far below their block's max: rounded to its step
    got = kernel.block_matmul(x, torch.from_numpy(raw), int(qtype)).float()
    want = torch.from_numpy(fixed_reference(raw, qtype, x.float().numpy())).bfloat16().float()
    assert torch.equal(got, want)


def test_the_fixed_point_check_would_see_another_order(kernel) -> None:
    """Negative control: the same operations summed over the lanes in another order differ."""
    raw = make_blocks(T.Q4_1, 5, 64, seed=22)
    x16 = (torch.randn(12, 64, generator=torch.Generator().manual_seed(12)) * 3).half()
    x = x16.float().numpy()
    kernel_tree, in_order = fixed_reference(raw, T.Q4_1, x), fixed_reference(raw, T.Q4_1, x, tree="in-order")
    assert not np.array_equal(kernel_tree, in_order)
    got = kernel.block_matmul(x16, torch.from_numpy(raw), int(T.Q4_1))
    assert torch.equal(got, torch.from_numpy(kernel_tree).to(torch.float16))


def test_bf16_values_near_their_block_max_are_exact_in_fixed_point() -> None:
    x = torch.randn(4, 256).bfloat16().float().numpy()
    q, d = fixed_point(x)
    back = q.astype(np.float64).reshape(4, -1, 32) * d[..., None]
    mx = np.abs(x.reshape(4, -1, 32)).max(axis=2, keepdims=True)
    near = np.abs(x.reshape(4, -1, 32)) >= mx * 2.0**-7
    assert np.array_equal(back[near], x.reshape(4, -1, 32)[near].astype(np.float64))
    assert (np.abs(back - x.reshape(4, -1, 32)) <= mx * 2.0**-15).all()
    assert not np.array_equal(back, x.reshape(4, -1, 32))  # the smaller values are rounded


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 19])
def test_half_inputs_are_the_product_of_fixed_point_x(kernel, qtype, dtype, m) -> None:
    """Every type (K-quants with 16-value groups too): close to the float64 product of gguf's
    weights and the fixed-point x, far closer than to x itself where x has small values."""
    block = GGML_QUANT_SIZES[qtype][0]
    k = 4 * block if block == 32 else 2 * block
    raw = make_blocks(qtype, 11, k, seed=5 + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    got = kernel.block_matmul(x, torch.from_numpy(raw), int(qtype))
    assert got.dtype == dtype
    q, d = fixed_point(x.float().numpy())
    xq = (q.astype(np.float64).reshape(m, -1, 32) * d[..., None]).reshape(m, k)
    w = dequant(raw, qtype).astype(np.float64)
    want = xq @ w.T
    tol = bound(raw, qtype, xq.astype(np.float32)) * 4 + np.abs(want) * 2.0**-8  # the final rounding to dtype
    assert (np.abs(got.double().numpy() - want) <= tol).all()


def test_inf_and_zero_blocks_in_fixed_point(kernel) -> None:
    raw = torch.from_numpy(make_blocks(T.Q4_1, 3, 64, seed=23))
    x = torch.zeros(3, 64).bfloat16()
    x[1, 0] = float("inf")
    x[2, 33] = 1.0
    got = kernel.block_matmul(x, raw, int(T.Q4_1)).float()
    assert torch.equal(got[0], torch.zeros(3))
    assert torch.isnan(got[1]).all()
    w = torch.from_numpy(dequant(raw.numpy(), T.Q4_1))
    assert torch.equal(got[2], w[:, 33].bfloat16().float())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_row_has_the_same_bits_in_any_batch_and_thread_count(kernel, qtype) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    n, k = 67, 1536 if block == 256 else 576  # 67: a tail in every tiling
    raw = torch.from_numpy(make_blocks(qtype, n, k, seed=7))
    x = torch.randn(64, k).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = kernel.block_matmul(x, raw, int(qtype))
        for i in (0, 5, 63):
            assert torch.equal(kernel.block_matmul(x[i:i + 1].contiguous(), raw, int(qtype)), full[i:i + 1])
        for rows in (slice(0, 3), slice(10, 27), slice(1, 2), slice(4, 6), slice(7, 12), slice(20, 28),
                     slice(30, 39)):  # the few-rows path (2..8 rows) and the tiles past it
            assert torch.equal(kernel.block_matmul(x[rows].contiguous(), raw, int(qtype)), full[rows])
        other = x.clone()
        other[1:] = torch.randn(63, k).bfloat16() * 100  # whatever the company holds
        assert torch.equal(kernel.block_matmul(other, raw, int(qtype))[0], full[0])
        torch.set_num_threads(1)
        assert torch.equal(kernel.block_matmul(x, raw, int(qtype)), full)
        assert torch.equal(kernel.block_matmul(x[:1].contiguous(), raw, int(qtype)), full[:1])
    finally:
        torch.set_num_threads(threads)


def test_the_identity_checks_would_see_a_one_ulp_difference(kernel) -> None:
    """Negative control: x row 4 moved by one ulp changes that row's bits, no other row's."""
    raw = torch.from_numpy(make_blocks(T.Q4_1, 40, 576, seed=9))
    x = torch.randn(17, 576)
    base = kernel.block_matmul(x, raw, int(T.Q4_1))
    moved = x.clone()
    moved[4] = torch.nextafter(moved[4], torch.full((576,), float("inf")))
    out = kernel.block_matmul(moved, raw, int(T.Q4_1))
    assert not torch.equal(out[4], base[4])
    keep = torch.arange(17) != 4
    assert torch.equal(out[keep], base[keep])
    # and float32 sums of the same weights in another order differ somewhere
    w = torch.from_numpy(dequant(raw.numpy(), T.Q4_1))
    assert not torch.equal(x @ w.T, base)


def test_block_types_lists_what_the_kernel_takes(kernel) -> None:
    assert set(kernel.block_types()) == BLOCK_TYPES == {int(t) for t in TYPES}


def test_bad_input_is_a_clear_error(kernel) -> None:
    raw = torch.from_numpy(make_blocks(T.Q8_0, 4, 64, seed=1))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="68 bytes per row do not hold K = 96 values"):
        kernel.block_matmul(torch.randn(2, 96), raw, int(T.Q8_0))
    with pytest.raises(RuntimeError, match="not a multiple of the block size 32"):
        kernel.block_matmul(torch.randn(2, 48), raw, int(T.Q8_0))
    with pytest.raises(RuntimeError, match="x dtype Double is not float32, bfloat16 or float16"):
        kernel.block_matmul(x.double(), raw, int(T.Q8_0))
    with pytest.raises(RuntimeError, match="blocks must be uint8"):
        kernel.block_matmul(x, raw.view(torch.int8), int(T.Q8_0))
    with pytest.raises(RuntimeError, match="unsupported GGML quantization type 1"):
        kernel.block_matmul(x, raw, int(T.F16))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.block_matmul(torch.randn(64, 2).T, raw, int(T.Q8_0))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.block_matmul(x, torch.cat([raw, raw], 1)[:, :68], int(T.Q8_0))


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_a_large_matrix_split_over_threads_keeps_the_bits(kernel, qtype) -> None:
    """Large enough that one lane's product is split over the threads too (by rows, never K)."""
    k = 1536 if qtype == T.Q4_K else 576
    raw = torch.from_numpy(make_blocks(qtype, 1030, k, seed=11))  # > 256 KiB, 1030 = a tail
    x = torch.randn(5, k).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [kernel.block_matmul(x[i:i + 1].contiguous(), raw, int(qtype)) for i in range(5)]
        torch.set_num_threads(2)
        two = [kernel.block_matmul(x[i:i + 1].contiguous(), raw, int(qtype)) for i in range(5)]
        both = kernel.block_matmul(x, raw, int(qtype))
    finally:
        torch.set_num_threads(threads)
    for i in range(5):
        assert torch.equal(one[i], two[i]) and torch.equal(one[i][0], both[i])
