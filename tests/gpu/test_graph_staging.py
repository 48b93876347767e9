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
