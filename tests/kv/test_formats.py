"""Round trips of the `--kv` cell formats against plain references of the same arithmetic.

The references are numpy (int8), gguf's own Q4_0 quantizer and dequantizer,
and a recursive Hadamard transform, so a slip in the torch code cannot hide
behind the same slip in its oracle. Every comparison is bit for bit.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.quality import format_error
from strata.kv.formats import FORMAT_NAMES, KvFormat, Storage, kv_block_bytes, make_format
from strata.kv.hadamard import hadamard_matrix, hadamard_rotate

Q4_0 = gguf.GGMLQuantizationType.Q4_0
PLAIN = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
READ_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- references ---------------------------------------------------------------------------


def ref_int8(x: np.ndarray) -> np.ndarray:
    """Symmetric int8 per row, scale amax/127 in float32, round half to even."""
    x = x.astype(np.float32)
    out = np.empty_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        row = x[idx]
        s = np.float32(np.abs(row).max()) / np.float32(127)
        codes = np.zeros_like(row) if s == 0 else np.clip(np.rint(row / s), -127, 127)
        out[idx] = codes.astype(np.int8).astype(np.float32) * s  # stored codes have no -0
    return out


def ref_q4_0(x: np.ndarray) -> np.ndarray:
    """gguf's Q4_0 round trip along the last dimension."""
    x = x.astype(np.float32)
    flat = x.reshape(-1, x.shape[-1])
    return gguf.quants.dequantize(gguf.quants.quantize(flat, Q4_0), Q4_0).reshape(x.shape)


def ref_fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of the last dimension, by halves."""
    if x.shape[-1] == 1:
        return x
    half = x.shape[-1] // 2
    a, b = ref_fwht(x[..., :half]), ref_fwht(x[..., half:])
    return torch.cat((a + b, a - b), dim=-1)


def ref_rotate(x: torch.Tensor) -> torch.Tensor:
    return ref_fwht(x.to(torch.float32)) * (x.shape[-1] ** -0.5)


def ref_round_trip(
    name: str, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `read(..., float32)` must return after `write` (V of k8v4 still rotated)."""
    if name in PLAIN:
        return k.to(PLAIN[name]).float(), v.to(PLAIN[name]).float()
    kn, vn = k.float().numpy(), v.float().numpy()
    if name == "int8":
        return torch.from_numpy(ref_int8(kn)), torch.from_numpy(ref_int8(vn))
    if name == "q4_0":
        return torch.from_numpy(ref_q4_0(kn)), torch.from_numpy(ref_q4_0(vn))
    assert name == "k8v4"
    return torch.from_numpy(ref_int8(kn)), torch.from_numpy(ref_q4_0(ref_rotate(v).numpy()))


# ---- helpers ------------------------------------------------------------------------------


def head_dims(name: str) -> st.SearchStrategy[int]:
    if name == "k8v4":
        return st.sampled_from([32, 64, 128, 256])
    if name == "q4_0":
        return st.integers(1, 5).map(lambda n: 32 * n)
    return st.integers(1, 160)


def kv_data(gen: torch.Generator, t: int, h: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Gaussian K/V with per-row scales over several decades and a few outlier channels."""
    x = torch.randn((t, h, d), generator=gen) * torch.exp(torch.randn((t, h, 1), generator=gen) * 2)
    x[..., torch.randint(0, d, (2,), generator=gen)] *= 12.0
    return x.to(dtype)


def snapshot(storage: Storage) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in storage.items()}


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMAT_NAMES)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_write_then_read_matches_reference(name: str, data: st.DataObject) -> None:
    h = data.draw(st.integers(1, 4), label="n_kv_heads")
    d = data.draw(head_dims(name), label="head_dim")
    t = data.draw(st.integers(1, 6), label="tokens")
    n_cells = data.draw(st.integers(t, 12), label="cells")
    in_dtype = data.draw(st.sampled_from(READ_DTYPES), label="input dtype")
    read_dtype = data.draw(st.sampled_from(READ_DTYPES), label="read dtype")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))

    fmt = make_format(name, h, d)
    storage = fmt.allocate(n_cells, "cpu")
    # Fill every cell first, so "untouched" means something.
    fill = [kv_data(gen, n_cells, h, d, in_dtype) for _ in "kv"]
    fmt.write(storage, torch.arange(n_cells), *fill)
    before = snapshot(storage)

    cells = torch.randperm(n_cells, generator=gen)[:t]
    k, v = kv_data(gen, t, h, d, in_dtype), kv_data(gen, t, h, d, in_dtype)
    fmt.write(storage, cells, k, v)

    k_ref, v_ref = ref_round_trip(name, k, v)
    order = torch.randperm(t, generator=gen)  # read in another order than written
    k_got, v_got = fmt.read(storage, cells[order], read_dtype)
    assert_bits_equal(k_got, k_ref[order].to(read_dtype))
    assert_bits_equal(v_got, v_ref[order].to(read_dtype))

    untouched = torch.ones(n_cells, dtype=torch.bool)
    untouched[cells] = False
    for run in fmt.runs():
        assert torch.equal(storage[run.name][untouched], before[run.name][untouched]), run.name


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_overwrite_replaces_the_cell(name: str) -> None:
    fmt = make_format(name, 2, 64)
    gen = torch.Generator().manual_seed(7)
    cells = torch.tensor([5, 1, 3])
    first = [kv_data(gen, 3, 2, 64, torch.float32) for _ in "kv"]
    second = [kv_data(gen, 3, 2, 64, torch.float32) for _ in "kv"]

    overwritten = fmt.allocate(8, "cpu")
    fmt.write(overwritten, cells, *first)
    fmt.write(overwritten, cells, *second)
    fresh = fmt.allocate(8, "cpu")
    fmt.write(fresh, cells, *second)
    for run in fmt.runs():
        assert torch.equal(overwritten[run.name], fresh[run.name]), run.name

    k_ref, v_ref = ref_round_trip(name, *second)
    k_got, v_got = fmt.read(overwritten, cells, torch.float32)
    assert_bits_equal(k_got, k_ref)
    assert_bits_equal(v_got, v_ref)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_same_bits_whatever_the_batch(name: str) -> None:
    """A cell's bytes depend on its own K/V only: one write of 16 tokens equals 16 writes of one."""
    fmt = make_format(name, 4, 128)
    gen = torch.Generator().manual_seed(11)
    k, v = (kv_data(gen, 16, 4, 128, torch.bfloat16) for _ in "kv")
    together, one_by_one = fmt.allocate(16, "cpu"), fmt.allocate(16, "cpu")
    fmt.write(together, torch.arange(16), k, v)
    for i in range(16):
        fmt.write(one_by_one, torch.tensor([i]), k[i : i + 1], v[i : i + 1])
    for run in fmt.runs():
        assert torch.equal(together[run.name], one_by_one[run.name]), run.name


# ---- Q4_0 bytes ---------------------------------------------------------------------------


def q4_0_cases() -> torch.Tensor:
    """Blocks that probe ggml's rules: zeros, sign ties, codes on their edges, huge range."""
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(128, generator=gen) * s for s in (1e-6, 1.0, 300.0)]
    zeros_then_random = torch.cat((torch.zeros(32), torch.randn(96, generator=gen)))
    ties = torch.randn(128, generator=gen)
    ties[0], ties[5] = 9.0, -9.0  # +a first: d = -9/8
    ties[40], ties[33] = 9.0, -9.0  # -a first: d = +9/8
    edges = (torch.arange(128, dtype=torch.float32) % 16 - 8) + 0.5
    edges[0::32] = -8.0  # d = 1, so every x * (1/d) + 8.5 is an integer
    wide = torch.randn(128, generator=gen) * torch.logspace(-4, 4, 128)
    return torch.stack([*rows, zeros_then_random, ties, edges, wide]).reshape(7, 1, 128)


def test_q4_0_bytes_equal_gguf() -> None:
    gen = torch.Generator().manual_seed(5)
    k = torch.cat((q4_0_cases(), kv_data(gen, 9, 1, 128, torch.float32)))
    v = kv_data(gen, 16, 1, 128, torch.float32)
    for name, run, x in (("q4_0", "k_q4", k), ("q4_0", "v_q4", v), ("k8v4", "v_q4", v)):
        fmt = make_format(name, 1, 128)
        storage = fmt.allocate(16, "cpu")
        fmt.write(storage, torch.arange(16), k, v)
        src = ref_rotate(x) if name == "k8v4" else x
        want = gguf.quants.quantize(src.reshape(16, 128).numpy(), Q4_0)
        assert np.array_equal(storage[run].reshape(16, -1).numpy(), want), (name, run)


# ---- sizes --------------------------------------------------------------------------------


def test_k8v4_cell_is_816_bytes_for_4_heads_of_128() -> None:
    fmt = make_format("k8v4", 4, 128)
    assert {r.name: r.nbytes for r in fmt.runs()} == {"k_q": 512, "k_s": 16, "v_q4": 288}
    assert fmt.cell_bytes() == 816
    assert kv_block_bytes(fmt, 4096) == 816 * 4096


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("h,d", [(1, 32), (4, 128), (8, 64), (2, 256)])
def test_cell_bytes_by_formula(name: str, h: int, d: int) -> None:
    fmt = make_format(name, h, d)
    formula = {
        "fp32": 2 * h * d * 4,
        "fp16": 2 * h * d * 2,
        "bf16": 2 * h * d * 2,
        "int8": 2 * (h * d + 4 * h),
        "q4_0": 2 * h * (d // 32) * 18,
        "k8v4": h * d + 4 * h + h * (d // 32) * 18,
    }[name]
    assert fmt.cell_bytes() == formula
    storage = fmt.allocate(3, "cpu")
    assert [n for n in storage] == [r.name for r in fmt.runs()]
    assert sum(t.numel() * t.element_size() for t in storage.values()) == kv_block_bytes(fmt, 3)
    assert all(t.shape[0] == 3 for t in storage.values())


def test_head_dims_a_format_cannot_hold_are_refused() -> None:
    with pytest.raises(ValueError, match="head_dim=48"):
        make_format("q4_0", 4, 48)
    with pytest.raises(ValueError, match="head_dim=96"):
        make_format("k8v4", 4, 96)  # a multiple of 32, but no power of two
    with pytest.raises(ValueError, match="head_dim=16"):
        make_format("k8v4", 4, 16)
    with pytest.raises(ValueError, match="q8_0"):
        make_format("q8_0", 4, 128)
    assert make_format("int8", 4, 48).cell_bytes() == 2 * (4 * 48 + 16)


# ---- rotation -----------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 32, 128, 256])
def test_hadamard_matrix_is_orthogonal_and_symmetric(d: int) -> None:
    m = hadamard_matrix(d)
    assert torch.allclose(m @ m.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert torch.equal(m, m.T)
    assert torch.equal(m.abs(), torch.full((d, d), d ** -0.5, dtype=torch.float64))


@pytest.mark.parametrize("d", [32, 128, 256])
def test_rotation_is_the_matrix_and_its_own_inverse(d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    x = torch.randn((5, 3, d), generator=gen)
    y = hadamard_rotate(x)
    assert_bits_equal(y, ref_rotate(x))
    assert torch.allclose(y.double(), x.double() @ hadamard_matrix(d), atol=1e-5)
    assert torch.allclose(hadamard_rotate(y), x, atol=1e-5)
    assert_bits_equal(hadamard_rotate(x[2:3]), y[2:3])  # batch-invariant


def test_finish_output_rotates_the_attention_output_back() -> None:
    """softmax(s) @ V_rotated, rotated back, is attention over V as written (up to 4-bit error)."""
    gen = torch.Generator().manual_seed(1)
    t, h, d = 24, 2, 128
    fmt = make_format("k8v4", h, d)
    storage = fmt.allocate(t, "cpu")
    k, v = (torch.randn((t, h, d), generator=gen) for _ in "kv")
    fmt.write(storage, torch.arange(t), k, v)
    _, v_rot = fmt.read(storage, torch.arange(t), torch.float32)
    p = torch.softmax(torch.randn((h, 3, t), generator=gen), dim=-1)  # 3 queries per head

    out = fmt.finish_output(torch.einsum("hqt,thd->qhd", p, v_rot))
    v_back = fmt.finish_output(v_rot)  # each V row rotated back
    assert torch.allclose(out, torch.einsum("hqt,thd->qhd", p, v_back), atol=1e-5)

    def rel(a: torch.Tensor) -> float:
        return float((a - v).norm() / v.norm())

    assert rel(v_back) < 0.15  # that row is V up to Q4_0 error
    assert rel(v_rot) > 1.0  # while the stored V is really rotated

    bf = torch.randn((3, 2, d), generator=gen).to(torch.bfloat16)
    assert fmt.finish_output(bf).dtype == torch.bfloat16
    for name in ("fp16", "int8", "q4_0"):
        assert make_format(name, h, d).finish_output(bf) is bf


# ---- quality ------------------------------------------------------------------------------


def test_rotation_lowers_v_error_with_outlier_channels() -> None:
    gen = torch.Generator().manual_seed(2)
    t, h, d = 256, 4, 128
    k = torch.randn((t, h, d), generator=gen)
    v = torch.randn((t, h, d), generator=gen)
    v[..., [7, 77]] *= 20.0  # outlier channels, as real V projections have
    rot = format_error("k8v4", k, v)
    norot = format_error("k8v4_norot", k, v)
    assert rot["k"] == norot["k"] == format_error("int8", k, v)["k"]
    assert rot["v"] < 0.5 * norot["v"], (rot, norot)
    assert format_error("fp32", k, v) == {"k": 0.0, "v": 0.0}
    with pytest.raises(ValueError, match="nope"):
        format_error("nope", k, v)


# ---- CUDA ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_cuda_bits_equal_cpu_bits(name: str) -> None:
    fmt: KvFormat = make_format(name, 4, 128)
    gen = torch.Generator().manual_seed(9)
    k, v = (kv_data(gen, 64, 4, 128, torch.bfloat16) for _ in "kv")
    cells = torch.randperm(100, generator=gen)[:64]
    on_cpu, on_gpu = fmt.allocate(100, "cpu"), fmt.allocate(100, "cuda")
    fmt.write(on_cpu, cells, k, v)
    fmt.write(on_gpu, cells.cuda(), k.cuda(), v.cuda())
    for run in fmt.runs():
        assert torch.equal(on_cpu[run.name], on_gpu[run.name].cpu()), run.name
    got = fmt.read(on_gpu, cells.cuda(), torch.bfloat16)
    want = fmt.read(on_cpu, cells, torch.bfloat16)
    for g, w in zip(got, want):
        assert_bits_equal(g.cpu(), w)
    out = torch.randn((5, 8, 128), generator=gen)
    assert_bits_equal(fmt.finish_output(out.cuda()).cpu(), fmt.finish_output(out))
