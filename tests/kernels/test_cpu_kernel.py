"""The C++ CPU attention kernel: against float64 attention, row by row, and inside TableAttention."""

from __future__ import annotations

import pytest
import torch

from strata.attention.reference import TableAttention
from strata.kv.step import SeqSpec
from strata.kernels.cpu.loader import cpu_kernel
from strata.kv.formats import make_format
from strata.kv.pool import KvPool


@pytest.fixture(scope="module")
def kernel():
    k = cpu_kernel()
    assert k is not None, "the CPU attention kernel did not build (is a C++ compiler installed?)"
    return k


def _float64_attention(q, k, v, cells, row_seq, row_pos, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    g = q.shape[1] // k.shape[1]
    for t in range(q.shape[0]):
        c = cells[row_seq[t], : int(row_pos[t]) + 1]
        kk = k[c].double().repeat_interleave(g, dim=1)
        vv = v[c].double().repeat_interleave(g, dim=1)
        p = (torch.einsum("hd,nhd->hn", q[t].double(), kk) * scale).softmax(-1)
        out[t] = torch.einsum("hn,nhd->hd", p, vv)
    return out


CASES = [  # (query heads, kv heads, head dim): the fixed 64/128 paths and the generic one with tails
    (9, 3, 64), (32, 8, 128), (4, 4, 16), (6, 2, 24), (8, 1, 40),
]


@pytest.mark.parametrize("hq,hkv,d", CASES)
@pytest.mark.parametrize("qdt,kvdt,tol", [
    (torch.float32, torch.float32, 2e-6), (torch.bfloat16, torch.bfloat16, 1e-2),
    (torch.float16, torch.float16, 2e-3), (torch.float32, torch.bfloat16, 2e-6),
])
def test_matches_float64_attention(kernel, hq, hkv, d, qdt, kvdt, tol) -> None:
    torch.manual_seed(hq * 1000 + d)
    n_cells = 700
    k = torch.randn(n_cells, hkv, d).to(kvdt)
    v = torch.randn(n_cells, hkv, d).to(kvdt)
    cells = torch.stack([torch.randperm(n_cells)[:300], torch.randperm(n_cells)[:300]])
    row_seq = torch.tensor([0, 0, 1, 1, 0, 1])
    row_pos = torch.tensor([0, 1, 15, 16, 130, 299])  # one key, the 4-key tail, a long row
    q = torch.randn(6, hq, d).to(qdt)
    got = kernel.attend(q, k, v, cells, row_seq, row_pos, d**-0.5)
    want = _float64_attention(q, k, v, cells, row_seq, row_pos, d**-0.5)
    assert got.dtype == qdt
    # bf16/fp16 outputs are rounded once: the error is that rounding, not more
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (6, 2, 24)])  # the fixed path and the generic one
@pytest.mark.parametrize("window", [0, 700])
def test_long_rows_read_in_chunks_match_float64(kernel, hq, hkv, d, window) -> None:
    """Rows past 512 keys are read in 512-key pieces and combined (windowed rows from their
    first key): 511 / 512 / 513 keys sit at the edge, 1,400 keys make three pieces."""
    torch.manual_seed(d)
    n_cells = 1500
    k = (torch.randn(n_cells, hkv, d) * 2).bfloat16()
    v = torch.randn(n_cells, hkv, d).bfloat16()
    cells = torch.randperm(n_cells)[None]
    row_pos = torch.tensor([510, 511, 512, 1023, 1399])
    row_seq = torch.zeros(5, dtype=torch.long)
    q = torch.randn(5, hq, d)
    got = kernel.attend(q, k, v, cells, row_seq, row_pos, d**-0.5, window)
    want = torch.empty(q.shape, dtype=torch.float64)
    for t in range(5):  # the float64 reference over the row's window
        first = max(0, int(row_pos[t]) - window + 1) if window else 0
        one = _float64_attention(q[t:t + 1], k, v, cells[:, first:], row_seq[t:t + 1], row_pos[t:t + 1] - first,
                                 d**-0.5)
        want[t] = one[0]
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("d", [64, 40])
def test_a_row_is_the_same_bits_alone_or_in_any_batch(kernel, d) -> None:
    torch.manual_seed(1)
    k = torch.randn(600, 2, d).bfloat16()
    v = torch.randn(600, 2, d).bfloat16()
    cells = torch.stack([torch.arange(600), torch.arange(600).flip(0)])
    q = torch.randn(40, 6, d).bfloat16()
    row_seq = torch.randint(0, 2, (40,))
    row_pos = torch.randint(0, 600, (40,))
    full = kernel.attend(q, k, v, cells, row_seq, row_pos, 0.1)
    for t in range(40):
        alone = kernel.attend(q[t : t + 1].contiguous(), k, v, cells, row_seq[t : t + 1],
                              row_pos[t : t + 1], 0.1)
        assert torch.equal(alone, full[t : t + 1]), t
    # the same sequence padded with more cells past the row's end changes nothing either
    wide = torch.cat([cells, cells[:, :100]], dim=1).contiguous()
    assert torch.equal(kernel.attend(q, k, v, wide, row_seq, row_pos, 0.1), full)


def test_bad_input_is_a_clear_error(kernel) -> None:
    q = torch.randn(1, 4, 16)
    k = torch.randn(10, 2, 16)
    cells = torch.arange(10)[None]
    with pytest.raises(RuntimeError, match="reads 11 keys of 10 cells"):
        kernel.attend(q, k, k, cells, torch.tensor([0]), torch.tensor([10]), 0.25)
    with pytest.raises(RuntimeError, match="int64"):
        kernel.attend(q, k, k, cells.int(), torch.tensor([0]), torch.tensor([3]), 0.25)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        kernel.attend(torch.randn(1, 3, 16), k, k, cells, torch.tensor([0]), torch.tensor([3]), 0.25)


@pytest.mark.parametrize("fmt", ["bf16", "fp32", "int8", "q4_0", "k8v4"])
def test_table_attention_kernel_close_to_torch_reference(fmt) -> None:
    """Every KV format through the kernel (plain cells in place, others dequantized) vs torch."""
    torch.manual_seed(2)
    hq, hkv, d = 8, 2, 64
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    pools = [KvPool(make_format(fmt, hkv, d), 1, 2, 300, 32, None) for _ in range(2)]
    seqs = [SeqSpec(0, 0, 70), SeqSpec(1, 0, 5)]
    q = torch.randn(75, hq, d).to(dtype)
    k = torch.randn(75, hkv, d).to(dtype)
    v = torch.randn(75, hkv, d).to(dtype)
    outs = []
    for pool, kern in zip(pools, [None, False]):
        for s in seqs:
            assert pool.reserve(s.lane, s.end)
        ctx = TableAttention(pool, seqs, d**-0.5, kernel=kern)
        assert (ctx.kernel is not None) == (kern is None)
        outs.append(ctx.attend(0, q, k, v))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)


def test_turned_off_by_environment(monkeypatch) -> None:
    monkeypatch.setenv("STRATA_CPU_KERNEL", "0")
    cpu_kernel.cache_clear()
    try:
        assert cpu_kernel() is None
    finally:
        monkeypatch.delenv("STRATA_CPU_KERNEL")
        cpu_kernel.cache_clear()
    assert cpu_kernel() is not None


def test_a_failed_build_falls_back_to_torch_with_one_warning(monkeypatch, caplog) -> None:
    """No compiler (or a broken one): the engine still runs, on the torch path, and says so."""
    from torch.utils import cpp_extension

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'strata_cpu_kernels': g++ not found")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: "/nonexistent")
    cpu_kernel.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert cpu_kernel() is None
        assert "CPU kernels unavailable (Error building extension" in caplog.text
        pool = KvPool(make_format("bf16", 2, 16), 1, 1, 64, 16, None)
        assert pool.reserve(0, 3)
        ctx = TableAttention(pool, [SeqSpec(0, 0, 3)], 0.25)
        assert ctx.kernel is None
        out = ctx.attend(0, torch.randn(3, 4, 16).bfloat16(), torch.randn(3, 2, 16).bfloat16(),
                         torch.randn(3, 2, 16).bfloat16())
        assert out.shape == (3, 4, 16) and torch.isfinite(out.float()).all()
    finally:
        cpu_kernel.cache_clear()


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path) -> None:
    """A build killed mid-way leaves torch's lock file, on which every later start would wait
    forever; a lock older than any build is removed, a recent one (a build in progress) kept."""
    import os
    import time

    from strata.kernels.cpu.loader import STALE_LOCK_S, _drop_stale_lock

    old, new = tmp_path / "old", tmp_path / "new"
    old.touch()
    new.touch()
    then = time.time() - STALE_LOCK_S - 60
    os.utime(old, (then, then))
    _drop_stale_lock(old)
    _drop_stale_lock(new)
    _drop_stale_lock(tmp_path / "missing")  # nothing there: nothing to do
    assert not old.exists() and new.exists()
