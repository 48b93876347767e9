"""The expert cache's eviction orders: pure functions over a layer's routing history."""

from __future__ import annotations

import pytest

from strata.kv.expert_residency import POLICIES, ExpertUsage, evict_order, simulate


def _usage(history: list[list[int]], experts: int = 6, half_life: float = 2.0) -> ExpertUsage:
    u = ExpertUsage(experts, half_life)
    for step in history:
        u.record(step)
    return u


def test_needed_experts_are_never_evicted() -> None:
    u = _usage([[0, 1], [2, 3], [0, 4]])
    for policy in POLICIES:
        order = evict_order(u, [0, 1, 2, 3, 4], {0, 2}, policy)
        assert sorted(order) == [1, 3, 4]


def test_the_three_orders() -> None:
    # expert 1: used often long ago; 3: once, most recently; 2: once, in between
    u = _usage([[1], [1], [1], [1], [2], [3]])
    assert evict_order(u, [1, 2, 3], set(), "lru") == [1, 2, 3]
    assert evict_order(u, [1, 2, 3], set(), "lfu") == [2, 3, 1]
    # half-life 2: 1's score 4 steps of hits decayed over 2 steps (~1.9) beats 2's (0.7), not 3's 1
    assert evict_order(u, [1, 2, 3], set(), "lfru") == [2, 3, 1]
    later = _usage([[1], [1], [1], [1], [2], [3], [2], [3], [2], [3]])
    assert evict_order(later, [1, 2, 3], set(), "lfru")[0] == 1  # the old favourite has faded
    assert evict_order(later, [1, 2, 3], set(), "lfu")[0] == 2  # counts alone keep it


def test_ties_go_to_the_lower_id() -> None:
    u = _usage([[0, 1, 2]])
    for policy in POLICIES:
        assert evict_order(u, [2, 0, 1], set(), policy) == [0, 1, 2]


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="lru, lfu, lfru"):
        evict_order(_usage([]), [], set(), "fifo")


def test_simulate_counts_hits_and_misses() -> None:
    trace = [[0, 1], [0, 1], [0, 2], [0, 1]]
    # two slots: 0,1 miss; hit hit; 0 hits, 2 misses (evicts 1 under lru); 0 hits, 1 misses
    assert simulate(trace, 4, 2, "lru") == (4, 4)
    assert simulate(trace, 4, 3, "lru") == (5, 3)  # nothing evicted: only first uses miss
    assert simulate(trace, 4, 2, "lfu") == (4, 4)


def test_policy_benchmark_replays_every_layer() -> None:
    from benchmarks.expert_policy import compare

    trace = {"experts": 4, "layers": [[[0, 1], [0, 1], [0, 2], [0, 1]], [[3], [3], [2], [3]]]}
    rows = compare(trace, [2], [16.0])
    lru = next(r for r in rows if r["policy"] == "lru")
    assert (lru["hits"], lru["misses"]) == (4 + 2, 4 + 2)
    assert min(r["misses_vs_best"] for r in rows) == 1.0
