"""Recurrent-state checkpoints (`engine/checkpoints.py`) and the state pool they copy."""

from __future__ import annotations

import pytest
import torch

from strata.engine.checkpoints import Checkpoints, cut_points
from strata.kv.state import StatePool

SHAPES = {0: {"conv": (3, 2), "ssm": (2, 2, 2)}, 2: {"ssm": (2, 2, 2)}}


def _fill(pool: StatePool, lane: int, value: float) -> None:
    for named in pool.layers.values():
        for t in named.values():
            t[pool.slot_of[lane]].fill_(value)


def _value(pool: StatePool, lane: int) -> set[float]:
    return {float(v) for named in pool.layers.values() for t in named.values()
            for v in t[pool.slot_of[lane]].unique()}


def test_cut_points() -> None:
    assert cut_points(0, 10, 0) == [9]
    assert cut_points(0, 100, 40) == [40, 80, 99]
    # cuts nearer than MIN_CUT_GAP (16) to the one before them go; the one before the end stays
    assert cut_points(50, 100, 40, named=[30, 60, 70, 92]) == [70, 92, 99]
    assert cut_points(0, 10, 4) == [9]
    assert cut_points(0, 1, 0) == []  # a one-token prompt: nothing before its end


def test_save_best_resume_and_cut() -> None:
    pool = StatePool(SHAPES, 2, "cpu")
    cps = Checkpoints(pool, per_lane=3)
    assert cps.stats.bytes_per_checkpoint == (3 * 2 + 8 + 8) * 4
    for pos, value in ((4, 1.0), (9, 2.0)):
        _fill(pool, 0, value)
        cps.save(0, pos)
    _fill(pool, 0, 7.0)
    assert cps.best(0, 8) == 4 and cps.best(0, 9) == 9 and cps.best(0, 3) == 0
    cps.resume(0, 4)
    assert _value(pool, 0) == {1.0}
    assert [c.position for c in cps.lanes[0]] == [4]  # the one past the resumed point is gone
    cps.resume(0, 0)
    assert _value(pool, 0) == {0.0} and cps.lanes[0] == []
    assert cps.stats.restores == 1 and cps.stats.tokens_reused == 4


def test_a_full_lane_drops_the_checkpoint_nearest_the_one_before_it() -> None:
    pool = StatePool(SHAPES, 1, "cpu")
    cps = Checkpoints(pool, per_lane=3)
    for pos in (100, 200, 210, 400):
        cps.save(0, pos)
    assert [c.position for c in cps.lanes[0]] == [100, 200, 400] and cps.stats.dropped == 1
    cps.save(0, 402)  # the newest stays even where it is nearest: 100 and 200 tie, 100 is older
    assert [c.position for c in cps.lanes[0]] == [200, 400, 402]
    cps.resume(0, 200)  # the lane is cut back to 200: 400 and 402 go
    for pos in (300, 500, 510):
        cps.save(0, pos)
    assert [c.position for c in cps.lanes[0]] == [200, 500, 510] and cps.stats.dropped == 5
    assert cps.stats.held == 3 and cps.stats.bytes == 3 * pool.bytes_per_lane()


def test_swap_moves_state_and_checkpoints_without_copies() -> None:
    pool = StatePool(SHAPES, 2, "cpu")
    cps = Checkpoints(pool, per_lane=2)
    _fill(pool, 0, 5.0)
    cps.save(0, 2)
    storage = pool.layers[0]["ssm"].data_ptr()
    cps.swap(0, 1)
    assert _value(pool, 1) == {5.0} and _value(pool, 0) == {0.0}
    assert cps.best(1, 2) == 2 and cps.best(0, 2) == 0
    assert pool.layers[0]["ssm"].data_ptr() == storage


def test_step_states_start_fresh_at_position_zero() -> None:
    pool = StatePool(SHAPES, 3, "cpu")
    _fill(pool, 0, 1.0)
    _fill(pool, 2, 2.0)
    step = pool.step([(0, 4), (4, 1)], [2, 0], [True, False])
    got = step.load(0)
    assert got["ssm"][0].abs().sum() == 0 and bool((got["ssm"][1] == 1.0).all())
    step.save(0, {"conv": torch.full((2, 3, 2), 3.0), "ssm": torch.full((2, 2, 2, 2), 4.0)})
    assert bool((pool.layers[0]["ssm"][2] == 4.0).all()) and bool((pool.layers[0]["conv"][0] == 3.0).all())
    assert bool((pool.layers[2]["ssm"][2] == 2.0).all())  # a layer not saved keeps its state


def test_a_snapshot_installs_into_another_lane_with_its_checkpoints() -> None:
    pool = StatePool(SHAPES, 2, "cpu")
    cps = Checkpoints(pool, per_lane=4)  # room for more than the three
    for pos, value in ((3, 1.0), (6, 2.0)):
        _fill(pool, 0, value)
        cps.save(0, pos)
    _fill(pool, 0, 7.0)
    states = cps.snapshot(0, 9)  # the two checkpoints and the state at the full length
    assert [c.position for c in states] == [3, 6, 9]
    cps.install(1, states, 9)
    assert _value(pool, 1) == {7.0} and [c.position for c in cps.lanes[1]] == [3, 6, 9]
    cps.install(1, states, 6)  # a regenerate of a parked chat: the checkpoint before its end
    assert _value(pool, 1) == {2.0} and [c.position for c in cps.lanes[1]] == [3, 6]
    few = Checkpoints(pool, per_lane=2)
    few.install(1, states, 9)
    assert [c.position for c in few.lanes[1]] == [6, 9]
    with pytest.raises(ValueError, match="no saved state at position 5"):
        cps.install(1, states, 5)
