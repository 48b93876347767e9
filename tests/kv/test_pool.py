"""The pool's bookkeeping: invariants under random operation sequences, moves, layouts."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.kv.formats import make_format
from strata.kv.policy import IdleLane, choose_evictions
from strata.kv.pool import KvPool

CHUNK = 4


def _pool(pool_tokens: int | None, lanes: int = 4, max_context: int = 32) -> KvPool:
    return KvPool(make_format("bf16", 2, 8), 2, lanes, max_context, CHUNK, pool_tokens)


op = st.one_of(
    st.tuples(st.just("reserve"), st.integers(0, 3), st.integers(0, 40)),
    st.tuples(st.just("release"), st.integers(0, 3), st.integers(0, 32)),
    st.tuples(st.just("swap"), st.integers(0, 3), st.integers(0, 3)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=40), st.sampled_from([None, 24, 60]))
def test_random_operations_keep_invariants(ops: list, pool_tokens: int | None) -> None:
    pool = _pool(pool_tokens)
    for kind, a, b in ops:
        if kind == "reserve":
            before = list(pool.reserved)
            ok = pool.reserve(a, b)
            if ok:
                assert pool.backed(a) >= b
            else:
                assert pool.reserved == before, "a refused reservation must reserve nothing"
        elif kind == "release":
            pool.release(a, b)
        else:
            pool.swap(a, b)
        pool.check_invariants()
    for s in range(pool.num_lanes):
        pool.release(s)
    pool.check_invariants()
    if pool.shared:
        assert pool.used_cells == 0
        assert (pool.tables == pool.trash).all()


def test_unreserved_writes_land_in_trash_not_in_other_sessions() -> None:
    pool = _pool(16)
    assert pool.reserve(0, 8)
    assert pool.reserve(1, 8)
    cells = pool.cells(1, torch.arange(8, 16))  # lane 1 holds only positions < 8
    assert (cells // CHUNK == pool.trash).all()
    owned0 = set(pool.cells(0, torch.arange(8)).tolist())
    assert not owned0 & set(cells.tolist())


def test_identity_layout_holds_max_context_and_never_releases() -> None:
    pool = _pool(None, lanes=3, max_context=10)
    assert pool.total_cells == 3 * 12  # rounded up to whole chunks
    assert all(pool.backed(s) == 12 for s in range(3))
    assert pool.release(1) == 0
    assert pool.free_chunks == 0
    pool.check_invariants()


def test_swap_moves_conversation_without_copying() -> None:
    pool = _pool(32)
    assert pool.reserve(2, 13)
    k = torch.randn(13, 2, 8).bfloat16()
    cells = pool.cells_of_range(2, 0, 13)
    pool.fmt.write(pool.layers[0], cells, k, k)
    storage_ptr = pool.layers[0]["k"].data_ptr()
    pool.swap(2, 0)
    assert pool.reserved[0] == 4 and pool.reserved[2] == 0
    moved = pool.fmt.read(pool.layers[0], pool.cells_of_range(0, 0, 13), torch.bfloat16)[0]
    assert torch.equal(moved, k)
    assert pool.layers[0]["k"].data_ptr() == storage_ptr
    pool.check_invariants()


def test_move_time_does_not_grow_with_length() -> None:
    """A move swaps table rows: a long conversation moves as fast as a short one."""
    pool = KvPool(make_format("bf16", 1, 8), 1, 2, 131072, 64, 131072)
    assert pool.reserve(0, 131072)
    t0 = time.perf_counter()
    for _ in range(20):
        pool.swap(0, 1)
    per_move = (time.perf_counter() - t0) / 20
    assert per_move < 0.5  # 2048 chunks; a copy of the K/V would be the real cost
    pool.check_invariants()


def test_too_small_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="smaller than one chunk"):
        _pool(2)


def test_evictions_lru_first_and_only_as_many_as_needed() -> None:
    idle = [IdleLane(0, 2, 30.0), IdleLane(1, 1, 10.0), IdleLane(2, 5, 20.0)]
    assert choose_evictions(3, 3, idle) == []
    assert choose_evictions(4, 3, idle) == [1]
    assert choose_evictions(5, 3, idle) == [1, 2]
    assert choose_evictions(11, 3, idle) == [1, 2, 0]
    assert choose_evictions(12, 3, idle) is None
    assert choose_evictions(1, 0, [IdleLane(0, 0, 1.0)]) is None


def test_a_pool_of_scattered_layers() -> None:
    """A hybrid model's pool holds only its attention layers, under the model's layer numbers:
    cells, bytes and export/import runs are of those layers only."""
    fmt = make_format("bf16", 2, 8)
    pool = KvPool(fmt, (3, 7), 2, 64, CHUNK, None)
    every = KvPool(fmt, 8, 2, 64, CHUNK, None)
    assert pool.layer_ids == (3, 7) and pool.num_layers == 2 and every.num_layers == 8
    assert pool.bytes_per_cell() == 2 * fmt.cell_bytes() and every.bytes_per_cell() == 8 * fmt.cell_bytes()
    assert pool.total_bytes() * 4 == every.total_bytes()
    assert pool.local(7) == 1 and pool.storage(7) is pool.layers[1]
    with pytest.raises(KeyError):
        pool.storage(5)  # a recurrent or sliding layer: not in the pool
    with pytest.raises(ValueError):
        KvPool(fmt, (7, 3), 2, 64, CHUNK, None)
    assert pool.reserve(0, 20) and pool.reserve(1, 20)
    k = torch.randn(20, 2, 8).to(torch.bfloat16)
    cells = pool.cells_of_range(0, 0, 20)
    pool.write(3, cells, k, -k)
    pool.write(7, cells, 2 * k, k)
    runs = pool.export_range(0, 0, 20)
    pool.import_range(1, 0, runs)
    for layer, (want_k, want_v) in {3: (k, -k), 7: (2 * k, k)}.items():
        got_k, got_v = pool.read(layer, pool.cells_of_range(1, 0, 20), torch.bfloat16)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
