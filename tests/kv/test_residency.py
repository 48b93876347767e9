"""The residency policy of KV streaming: which blocks stay on the device."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.kv.residency import BlockUsage, ResidencyConfig, choose_resident, keep_order, protected

CFG = ResidencyConfig(sink_blocks=1, recent_blocks=2, short_blocks=4)


def _usage(rows: list[tuple[int, int, bool, bool, int, int]]) -> BlockUsage:
    """rows of (block, last_use, needed, resident, index, span)."""
    cols = list(zip(*rows))
    return BlockUsage(
        block=torch.tensor(cols[0], dtype=torch.int64),
        last_use=torch.tensor(cols[1], dtype=torch.int64),
        needed=torch.tensor(cols[2], dtype=torch.bool),
        resident=torch.tensor(cols[3], dtype=torch.bool),
        index=torch.tensor(cols[4], dtype=torch.int64),
        span=torch.tensor(cols[5], dtype=torch.int64),
    )


def _kept(u: BlockUsage, capacity: int) -> set[int]:
    return set(u.block[choose_resident(u, capacity, CFG)].tolist())


def test_protected_blocks_are_sinks_recent_and_short_sessions() -> None:
    index = torch.tensor([0, 1, 5, 8, 9, 0, 3, -1])
    span = torch.tensor([10, 10, 10, 10, 10, 4, 4, 0])
    got = protected(index, span, CFG).tolist()
    assert got == [True, False, False, True, True, True, True, False]


def test_lru_among_unprotected_blocks() -> None:
    # one long lane (span 20), middle blocks used at different times; none needed now
    u = _usage([(10 + i, t, False, True, i, 20) for i, t in [(3, 5), (4, 2), (5, 9), (6, 1)]])
    assert _kept(u, 2) == {10 + 5, 10 + 3}  # the two most recently used
    assert _kept(u, 1) == {10 + 5}


def test_sinks_and_recent_blocks_outlive_older_middle_blocks() -> None:
    rows = [(100 + i, 1 if i in (0, 18, 19) else 7, False, True, i, 20) for i in range(20)]
    u = _usage(rows)
    # sinks (0) and recent (18, 19) are kept although they were used longest ago
    assert _kept(u, 3) == {100, 118, 119}


def test_short_sessions_keep_everything() -> None:
    short = [(i, 1, False, True, i, 4) for i in range(4)]  # 4 blocks: short, all protected
    long_ = [(50 + i, 3, False, True, i, 30) for i in range(5, 10)]  # middle of a long one
    u = _usage(short + long_)
    assert _kept(u, 4) == {0, 1, 2, 3}


def test_needed_blocks_beat_everything_else() -> None:
    rows = [(0, 9, False, True, 0, 3)]  # another short lane's sink, used recently
    rows += [(10 + i, 4, True, False, i + 5, 30) for i in range(3)]  # misses of this read
    assert _kept(_usage(rows), 3) == {10, 11, 12}


def test_overflow_prefers_protected_misses_then_resident_hits() -> None:
    # a read needs 5 blocks of a 30-block lane; the cache has 3 slots
    rows = [
        (1, 8, True, True, 6, 30),  # resident middle block
        (2, 8, True, True, 7, 30),  # resident middle block
        (3, 8, True, False, 8, 30),  # missed middle block
        (4, 8, True, False, 0, 30),  # missed sink
        (5, 8, True, False, 29, 30),  # missed recent block
    ]
    kept = _kept(_usage(rows), 3)
    assert kept == {4, 5, 1}  # protected misses displace a hit; among the rest, resident wins


def test_order_is_deterministic_by_block_id() -> None:
    u = _usage([(b, 1, False, True, 5, 40) for b in (7, 3, 9, 1)])
    assert u.block[keep_order(u, CFG)].tolist() == [1, 3, 7, 9]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 20), st.booleans(), st.booleans(), st.integers(-1, 30),
                  st.integers(0, 31)),
        min_size=1,
        max_size=30,
    ),
    st.integers(0, 35),
)
def test_keeps_exactly_capacity_and_no_kept_block_ranks_below_a_dropped_one(rows, capacity) -> None:
    u = _usage([(i, t, n, r, idx, sp) for i, (t, n, r, idx, sp) in enumerate(rows)])
    keep = choose_resident(u, capacity, CFG)
    assert int(keep.sum()) == min(capacity, len(rows))
    order = keep_order(u, CFG)
    assert sorted(order.tolist()) == list(range(len(rows)))
    # kept blocks are exactly a prefix of the order, and needed ones come before the rest
    n_kept = int(keep.sum())
    assert keep[order].tolist() == [True] * n_kept + [False] * (len(rows) - n_kept)
    needed = u.needed[order].tolist()
    assert needed == sorted(needed, reverse=True)
