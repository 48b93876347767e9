"""The CUDA-graph step's metadata staging, on the CPU: what the copy to the device carries.

Runs without a GPU (the staging is host work): ids, positions, lanes,
lengths and write cells of the live lanes, and padding lanes that read one
cell of lane 0 and write into the trash chunk, also after a larger step.
"""

from __future__ import annotations

import pytest
import torch

from strata.engine.graphs import META_ROWS, DecodeGraphs, _Entry
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec


class _NoEvent:
    def synchronize(self) -> None: ...

    def record(self) -> None: ...


def _entry(size: int) -> _Entry:
    host = torch.zeros((META_ROWS, size), dtype=torch.int64)
    return _Entry(size, host, torch.zeros_like(host), None, _NoEvent())  # type: ignore[arg-type]


def test_staging_holds_lanes_then_padding() -> None:
    pool = KvPool(make_format("bf16", 2, 32), 1, 4, 256, 16, 8 * 16, "cpu")
    for s, n in ((0, 40), (2, 20), (3, 3)):
        assert pool.reserve(s, n)
    graphs = DecodeGraphs(None, pool, 1.0)  # type: ignore[arg-type]
    e = _entry(4)
    graphs._pad(e.host.numpy(), 0, 4)
    trash_cell = pool.trash * pool.chunk_size

    seqs = [SeqSpec(0, 39, 1), SeqSpec(2, 17, 1), SeqSpec(3, 2, 1)]
    graphs._fill(e, seqs, [5, 6, 7])
    ids, pos, _, lane_ids, lens, cells, _ = e.meta.tolist()
    assert ids == [5, 6, 7, 0] and pos == [39, 17, 2, 0] and lane_ids == [0, 2, 3, 0]
    assert lens == [40, 18, 3, 1]
    want = [int(pool.tables[s.lane, s.start // 16]) * 16 + s.start % 16 for s in seqs]
    assert cells == want + [trash_cell]

    graphs._fill(e, [SeqSpec(2, 18, 1)], [9])  # fewer lanes: the old ones become padding
    ids, _, _, lane_ids, lens, cells, _ = e.meta.tolist()
    assert ids == [9, 0, 0, 0] and lane_ids == [2, 0, 0, 0] and lens == [19, 1, 1, 1]
    assert cells[1:] == [trash_cell] * 3
    assert cells[0] == int(pool.tables[2, 1]) * 16 + 2


def test_a_recurrent_model_stages_its_lanes_state_slots() -> None:
    """With a state pool each lane's slot is staged (after a swap, the swapped slot), padding
    rows the trash slot no lane owns, and the last step's kept runs are let go."""
    from strata.kv.state import StatePool

    pool = KvPool(make_format("bf16", 2, 32), 1, 3, 256, 16, 8 * 16, "cpu")
    for s in range(3):
        assert pool.reserve(s, 10)
    states = StatePool({0: {"ssm": (2, 2)}}, 3, "cpu", trash=True)
    states.swap(0, 2)
    states.kept_runs = {1: []}
    graphs = DecodeGraphs(None, pool, 1.0, states=states)  # type: ignore[arg-type]
    e = _entry(4)
    graphs._pad(e.host.numpy(), 0, 4)
    graphs._fill(e, [SeqSpec(0, 9, 1), SeqSpec(1, 9, 1)], [5, 6])
    assert e.meta[-1].tolist() == [2, 1, 3, 3] and states.kept_runs == {}
    assert graphs.step_rows([SeqSpec(0, 9, 2)], [2]) is None  # a run of drafts: not graph rows
    assert graphs.step_rows([SeqSpec(0, 9, 1)], [1]) == [SeqSpec(0, 9, 1)]
    assert not graphs.supports([SeqSpec(0, 0, 1)], [1])  # a state starting from zeros: eager


def test_graphs_of_a_recurrent_model_need_the_trash_slot() -> None:
    from strata.kv.state import StatePool

    pool = KvPool(make_format("bf16", 2, 32), 1, 2, 256, 16, 8 * 16, "cpu")
    with pytest.raises(ValueError, match="trash"):
        DecodeGraphs(None, pool, 1.0, states=StatePool({0: {"ssm": (2,)}}, 2, "cpu"))  # type: ignore[arg-type]


def _prompt_graphs(lanes: int = 3):
    from strata.engine.prompt_graphs import PromptGraphs
    from strata.kv.state import StatePool

    pool = KvPool(make_format("bf16", 2, 32), 1, lanes, 256, 16, 16 * 16, "cpu")
    for s in range(lanes):
        assert pool.reserve(s, 60)
    states = StatePool({0: {"ssm": (2, 2)}}, lanes, "cpu", trash=True)
    return pool, states, PromptGraphs(None, pool, 1.0, states, [8, 16, 32])  # type: ignore[arg-type]


def test_a_prompt_step_stages_its_rows_then_padding() -> None:
    """A captured prompt step of one lane: its tokens' ids, positions and write cells, which rows
    precede the last token, and the lane's table row, start, count, state slot and last row; the rest of the
    rows write into the trash chunk. A shorter step after a longer one pads again."""
    from strata.engine.prompt_graphs import META_ROWS
    from strata.engine.prompt_graphs import _Entry as PromptEntry

    pool, states, graphs = _prompt_graphs()
    states.swap(1, 2)
    states.cut_states = {1: {}}
    host = torch.zeros((META_ROWS, 16), dtype=torch.int64)
    e = PromptEntry(16, host, torch.zeros_like(host), _NoEvent())  # type: ignore[arg-type]
    trash_cell = pool.trash * pool.chunk_size
    seq = SeqSpec(1, 30, 11, prompt=True)
    graphs._fill(e, seq, list(range(100, 111)))
    ids, pos, cells, head, one = e.meta.tolist()
    assert ids == list(range(100, 111)) + [0] * 5
    assert pos == list(range(30, 41)) + [0] * 5
    want = [int(pool.tables[1, p // 16]) * 16 + p % 16 for p in range(30, 41)]
    assert cells == want + [trash_cell] * 5
    assert head == [1] * 10 + [0] * 6
    assert one[:5] == [1, 30, 11, 2, 10]  # lane, start, count, slot (swapped), last row
    assert states.cut_states == {}
    graphs._fill(e, SeqSpec(0, 50, 3, prompt=True), [7, 8, 9])
    ids, _, cells, head, one = e.meta.tolist()
    assert ids == [7, 8, 9] + [0] * 13 and head == [1] * 2 + [0] * 14
    assert cells[3:] == [trash_cell] * 13 and one[:5] == [0, 50, 3, 0, 2]


def test_prompt_graphs_take_one_lane_s_short_piece_that_continues_its_state() -> None:
    _, _, graphs = _prompt_graphs()
    assert graphs.supports([SeqSpec(0, 30, 20, prompt=True)], [1])
    assert graphs.supports([SeqSpec(0, 30, 32, prompt=True)], [0])  # a piece before the last
    assert graphs.size_for(20) == 32 and graphs.size_for(8) == 8
    assert not graphs.supports([SeqSpec(0, 30, 33, prompt=True)], [1])  # longer than the largest
    assert not graphs.supports([SeqSpec(0, 0, 20, prompt=True)], [1])  # from zeros: eager
    assert graphs.supports([SeqSpec(0, 30, 20, prompt=True, cuts=(19,))], [1])  # the cut before the end
    assert not graphs.supports([SeqSpec(0, 30, 20, prompt=True, cuts=(5,))], [1])  # another checkpoint
    assert not graphs.supports([SeqSpec(0, 30, 20, prompt=True, cuts=(5, 19))], [1])
    assert not graphs.supports([SeqSpec(0, 30, 20, prompt=True), SeqSpec(1, 9, 1)], [1, 1])  # two lanes
    assert not graphs.supports([SeqSpec(0, 30, 1)], [1])  # a decode row: the decode graphs'
    assert not graphs.supports([SeqSpec(0, 30, 3, drafted=True)], [3])


def test_prompt_graphs_need_the_trash_slot() -> None:
    from strata.engine.prompt_graphs import PromptGraphs
    from strata.kv.state import StatePool

    pool = KvPool(make_format("bf16", 2, 32), 1, 2, 256, 16, 8 * 16, "cpu")
    with pytest.raises(ValueError, match="trash"):
        PromptGraphs(None, pool, 1.0, StatePool({0: {"ssm": (2,)}}, 2, "cpu"), [8])  # type: ignore[arg-type]
