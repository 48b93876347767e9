"""The state pool seen by a captured decode step: slots read from a device tensor, padding rows
in a trash slot no lane owns (`kv/state.py: decode_states`, engine/graphs.py)."""

from __future__ import annotations

import pytest
import torch

from strata.kv.state import StatePool, decode_states

SHAPES = {0: {"conv": (3, 2), "ssm": (2, 2)}, 2: {"ssm": (2, 2)}}


def _pool(lanes: int, trash: bool) -> StatePool:
    pool = StatePool(SHAPES, lanes, "cpu", trash=trash)
    for named in pool.layers.values():
        for t in named.values():
            for s in range(t.shape[0]):
                t[s] = float(s + 1)
    return pool


def test_the_trash_slot_is_one_more_slot_and_no_lane_s() -> None:
    plain, spare = _pool(3, False), _pool(3, True)
    assert plain.trash is None and spare.trash == 3
    assert spare.total_bytes() == plain.total_bytes() + plain.bytes_per_lane()
    assert spare.bytes_per_lane() == plain.bytes_per_lane()
    assert spare.trash not in spare.slot_of


def test_decode_states_gather_and_scatter_by_device_slots() -> None:
    pool = _pool(3, True)
    pool.swap(0, 2)  # lane 0 now lives in slot 2
    slots = torch.tensor([pool.slot_of[0], pool.slot_of[1], pool.trash])  # two lanes, one padding row
    ctx = decode_states(pool, slots)
    assert ctx.spans == [(0, 1), (1, 1), (2, 1)] and ctx.runs == [False] * 3
    before = ctx.load(0)
    assert before["ssm"][:, 0, 0].tolist() == [3.0, 2.0, 4.0]
    ctx.save(0, {name: t + 10 for name, t in before.items()})
    ssm = pool.layers[0]["ssm"][:, 0, 0].tolist()
    assert ssm == [1.0, 12.0, 13.0, 14.0]  # slot 0 (lane 2) untouched; the padding row wrote the trash
    assert pool.layers[2]["ssm"][:, 0, 0].tolist() == [1.0, 2.0, 3.0, 4.0]  # another layer: untouched
    # the same context reads new slots when the tensor is refilled (a graph replay)
    slots.copy_(torch.tensor([0, 0, 3]))
    assert ctx.load(0)["ssm"][:, 0, 0].tolist() == [1.0, 1.0, 14.0]
    with pytest.raises(RuntimeError):
        ctx.keep_run(0, 0, None)  # type: ignore[arg-type]


def test_an_eager_step_still_zeroes_fresh_sequences() -> None:
    pool = _pool(2, True)
    ctx = pool.step([(0, 1), (1, 3)], [0, 1], [False, True])
    assert ctx.load(0)["ssm"][:, 0, 0].tolist() == [1.0, 0.0]
    assert pool.layers[0]["ssm"][1, 0, 0] == 2.0  # loading does not clear the slot itself


def test_a_checkpoint_copy_is_views_of_one_block() -> None:
    """`pinned_like`: one block for every layer's states (pinned on CUDA machines; a plain one
    here), each view aligned, apart from the others and shaped and typed like its tensor."""
    from strata.kv.state import pinned_like

    tensors = [torch.randn(3, 5), torch.zeros(7, dtype=torch.bfloat16), torch.arange(4).view(2, 2),
               torch.empty(0), torch.ones(2, 3, 4, dtype=torch.float16)]
    views = pinned_like(tensors, pin=False)
    block = views[0].untyped_storage()
    assert all(v.untyped_storage().data_ptr() == block.data_ptr() for v in views)
    assert all(v.data_ptr() % 64 == 0 for v in views if v.numel())
    for v, t in zip(views, tensors):
        assert v.shape == t.shape and v.dtype == t.dtype
        v.copy_(t)
    assert all(torch.equal(v, t) for v, t in zip(views, tensors))  # no view overwrote another
