"""Scheduler and pool together under random admit / grow / finish / reuse / evict / refuse."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine.request import Request, RequestHandle
from strata.engine.scheduler import Scheduler
from strata.engine.types import SamplingParams
from strata.errors import KvPoolFull
from strata.kv.formats import make_format
from strata.kv.pool import KvPool

CHUNK = 4

ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 3), st.integers(1, 30)),  # prefix family, length
        st.tuples(st.just("grow"), st.integers(0, 3), st.integers(1, 12)),  # lane, tokens decoded
        st.tuples(st.just("finish"), st.integers(0, 3), st.booleans()),  # lane, keep its cache
        st.tuples(st.just("evict"), st.integers(0, 3), st.just(0)),
    ),
    max_size=40,
)


def _prompt(family: int, n: int) -> list[int]:
    return [100 * family + (i % 7) for i in range(n)]


def _check(sched: Scheduler) -> None:
    pool = sched.pool
    pool.check_invariants()
    for lane in sched.lanes:  # a lane's tokens always fit in what it holds
        assert len(lane.tokens) <= pool.backed(lane.index)
        if pool.shared and lane.request is None:  # an idle lane holds no more than its conversation
            assert pool.reserved[lane.index] <= pool.chunks_for(len(lane.tokens) + 1)


@settings(max_examples=120, deadline=None)
@given(ops, st.sampled_from([None, 32, 48]))
def test_random_lifecycles_keep_the_pool_consistent(script: list, pool_tokens: int | None) -> None:
    pool = KvPool(make_format("bf16", 1, 4), 1, 4, 40, CHUNK, pool_tokens)
    sched = Scheduler(pool, lanes=4, prefill_chunk=8)
    for kind, a, b in script:
        if kind == "admit":
            if not sched.free_lanes():
                continue
            req = Request(_prompt(a, b), SamplingParams(), RequestHandle("r"))
            before = sched.counters.refusals
            try:
                lane = sched.admit(req)
            except KvPoolFull:
                assert sched.counters.refusals == before + 1
            else:
                assert lane.tokens == req.prompt[: req.cursor]  # the reused prefix is the prompt's
                lane.tokens = list(req.prompt)  # the prompt is read
                lane.request = req
        elif kind == "grow":
            lane = sched.lanes[a]
            if lane.request is None:
                continue
            for _ in range(b):
                pos = len(lane.tokens)
                if pos >= 40 or (pool.backed(lane.index) <= pos and not sched.reserve_for(lane, pos + 1)):
                    sched.release_lane(lane, keep_cache=False)  # truncated: chunks go back
                    break
                lane.tokens.append(7)
        elif kind == "finish":
            lane = sched.lanes[a]
            if lane.request is not None:
                sched.release_lane(lane, keep_cache=b)
        else:
            lane = sched.lanes[a]
            if lane.request is None and lane.tokens:
                sched.drop_cache(lane)
        _check(sched)
    for lane in sched.lanes:
        sched.release_lane(lane, keep_cache=False)
    _check(sched)
    if pool.shared:
        assert pool.used_cells == 0
        assert bool((pool.tables == pool.trash).all())
    assert sum(len(lane.tokens) for lane in sched.lanes) == 0


def test_admission_reuses_the_longest_cached_prefix() -> None:
    pool = KvPool(make_format("bf16", 1, 4), 1, 3, 40, CHUNK, 64)
    sched = Scheduler(pool, lanes=3, prefill_chunk=8)
    for lane, fam in zip(sched.lanes, (1, 2, 3)):
        assert pool.reserve(lane.index, 10)
        lane.tokens = _prompt(fam, 10)
    req = Request(_prompt(2, 6) + [999, 998], SamplingParams(), RequestHandle("r"))
    lane = sched.admit(req)
    assert lane.index == 1 and req.cached == 6
    assert sched.counters.prefix_reuse_hits == 1 and sched.counters.prefix_tokens_reused == 6
    assert pool.backed(1) >= 8
    pool.check_invariants()
    assert torch.equal(pool.tables_device.cpu(), pool.tables)
