"""Sliding-window attention over per-lane state (`models/window.py`) against dense attention.

Several sequences of one state pool are stepped together: fresh ones, ones
continuing inside their first window and past it, prompt parts longer than
the window and single decode rows, so the ring wraps many times. Each step's
output must equal softmax attention over the sequence's whole k/v history
with the sliding mask, on both paths (the C++ kernel, torch).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.kv.state import StatePool
from strata.models.window import WindowStep, window_state_shapes

W, HQ, HKV, D = 5, 4, 2, 16
SCALE = D**-0.5


def _dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, Hq, D] at positions start.. over the whole history keys/values [start + n, Hkv, D]."""
    n, total = q.shape[0], keys.shape[0]
    qpos = torch.arange(start, start + n)[:, None]
    kpos = torch.arange(total)[None, :]
    mask = (kpos <= qpos) & (kpos > qpos - W)
    g = HQ // HKV
    out = F.scaled_dot_product_attention(q.transpose(0, 1).double(),
                                         keys.repeat_interleave(g, 1).transpose(0, 1).double(),
                                         values.repeat_interleave(g, 1).transpose(0, 1).double(),
                                         attn_mask=mask, scale=SCALE)
    return out.transpose(0, 1).float()


@pytest.mark.parametrize("kernel", [None, False], ids=["cpu-kernel", "torch"])
def test_window_state_attends_as_dense_attention(kernel: bool | None) -> None:
    torch.manual_seed(0)
    lanes = 3
    pool = StatePool({0: window_state_shapes(W, HKV, D)}, lanes, "cpu")
    history: list[list[torch.Tensor]] = [[] for _ in range(lanes)]  # per lane: (k, v) of every position
    # (lane, rows) per step: lanes start, continue inside the first window, cross it, wrap the ring
    plan = [[(0, 3), (1, 9)], [(0, 1), (1, 1), (2, 2)], [(2, 7), (0, 6)], [(0, 1), (1, 1), (2, 1)],
            [(1, 12), (2, 1)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (2, 4)]]
    for step in plan:
        spans, lanes_of, fresh, positions, r = [], [], [], [], 0
        for lane, n in step:
            start = len(history[lane])
            spans.append((r, n))
            lanes_of.append(lane)
            fresh.append(start == 0)
            positions.append(torch.arange(start, start + n))
            r += n
        t = r
        q, k, v = torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)
        states = pool.step(spans, lanes_of, fresh)
        out = WindowStep(torch.cat(positions), states, W, SCALE, kernel=kernel).attend(0, q, k, v)
        for (r0, n), lane in zip(spans, lanes_of):
            start = len(history[lane])
            history[lane] += [(k[i], v[i]) for i in range(r0, r0 + n)]
            keys = torch.stack([kv[0] for kv in history[lane]])
            values = torch.stack([kv[1] for kv in history[lane]])
            torch.testing.assert_close(out[r0 : r0 + n], _dense(q[r0 : r0 + n], keys, values, start),
                                       atol=1e-5, rtol=1e-5)
    assert pool.layers[0]["k"].shape == (lanes, W, HKV, D)  # the window, not the context
    for lane in range(lanes):  # the ring holds each lane's last W positions at position mod W
        total = len(history[lane])
        for p in range(total - W, total):
            assert torch.equal(pool.layers[0]["k"][pool.slot_of[lane], p % W], history[lane][p][0])


def test_a_sequence_at_position_0_reads_nothing_of_its_slot() -> None:
    """The validity count, not zeros: a slot left over by another conversation (not zeroed here)
    is never read by a sequence that starts at position 0."""
    torch.manual_seed(1)
    pool = StatePool({0: window_state_shapes(W, HKV, D)}, 1, "cpu")
    pool.layers[0]["k"].fill_(50.0)
    pool.layers[0]["v"].fill_(50.0)
    q, k, v = torch.randn(3, HQ, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    step = WindowStep(torch.arange(3), pool.step([(0, 3)], [0], [False]), W, SCALE)
    torch.testing.assert_close(step.attend(0, q, k, v), _dense(q, k, v, 0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [None, False], ids=["cpu-kernel", "torch"])
@pytest.mark.parametrize("start,n", [(3, 3), (9, 4), (12, 5), (6, 12)])  # 12 rows: past the window
def test_a_rewound_run_leaves_the_ring_of_its_kept_rows(kernel: bool | None, start: int, n: int) -> None:
    """A verified run of drafts (`runs`) writes its n rows into the ring; rewound to keep j of
    them, the lane's ring holds the last W positions of its history up to that row, as if the
    rejected rows never came: run's own k/v and slots they overwrote alike."""
    torch.manual_seed(2)
    history_k, history_v = torch.randn(start + n, HKV, D), torch.randn(start + n, HKV, D)
    for kept in range(1, n + 1):
        pool = StatePool({0: window_state_shapes(W, HKV, D)}, 2, "cpu")
        for lane in range(2):  # lane 1: the history up to `start`, read beside lane 0's run
            WindowStep(torch.arange(start), pool.step([(0, start)], [lane], [True]), W, SCALE,
                       kernel=kernel).attend(0, torch.randn(start, HQ, D), history_k[:start],
                                             history_v[:start])
        states = pool.step([(0, n), (n, 1)], [0, 1], [False, False], [True, False])
        k = torch.cat((history_k[start:], history_k[start : start + 1]))
        v = torch.cat((history_v[start:], history_v[start : start + 1]))
        positions = torch.cat((torch.arange(start, start + n), torch.tensor([start])))
        WindowStep(positions, states, W, SCALE, kernel=kernel).attend(0, torch.randn(n + 1, HQ, D), k, v)
        before = pool.layers[0]["k"][pool.slot_of[0]].clone()
        pool.rewind(0, kept)
        ring = pool.layers[0]
        end = start + kept
        for p in range(max(0, end - W), end):
            assert torch.equal(ring["k"][pool.slot_of[0], p % W], history_k[p])
            assert torch.equal(ring["v"][pool.slot_of[0], p % W], history_v[p])
        if kept < n:  # negative control: before the rewind a rejected row sat in a needed slot
            needed = [p % W for p in range(max(0, end - W), end)]
            assert any(not torch.equal(before[c], ring["k"][pool.slot_of[0], c]) for c in needed)
