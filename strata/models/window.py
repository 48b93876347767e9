"""Sliding-window attention over per-lane state: a window layer keeps only its last W-1 k/v.

A sliding layer's query at position p sees the keys at p - W + 1 .. p. The
W - 1 before the step's rows are all such a layer ever needs of the past, so
they are the layer's fixed-size state per lane (`kv/state.py`), in the
model's dtype (the values a pool cell would hold), instead of cells in the
KV pool: a lane's memory for these layers follows the window, not the
context, and the model is a state model (resumed from its whole
conversation or from a checkpoint, `engine/checkpoints.py`).

The state is a ring: position q lives in slot q mod (W - 1). A sequence that
starts at position s holds min(s, W - 1) valid slots (positions
max(0, s - W + 1) .. s - 1); a fresh one holds none, so its zeros are never
read. A step attends over [those cells, in position order] + [the rows' own
k/v] with the sliding mask, then writes its last W - 1 positions into the
ring: a decode step writes one slot per sequence.

On the CPU the rows go to the same C++ kernel as the pool's attention
(`kernels/cpu/`), which reads each row's keys in position order one by one:
a row's bits depend only on its keys, so a sequence read at once, in parts
or resumed from a checkpoint gives the same bits, and the same bits as the
pool path did. Elsewhere a padded torch path computes the same attention.
"""

from __future__ import annotations

import torch

from strata.kv.state import StateContext, StateShapes
from strata.models import ops


def window_state_shapes(window: int, num_kv_heads: int, head_dim: int) -> StateShapes:
    """The k and v of the W - 1 positions before a step, per lane."""
    return {"k": (window - 1, num_kv_heads, head_dim), "v": (window - 1, num_kv_heads, head_dim)}


class WindowStep:
    """What every sliding layer of one step shares: where each row's keys are, which ring slots
    the step writes. Built once per forward from the step's positions and row spans."""

    def __init__(self, positions: torch.Tensor, states: StateContext, window: int, scale: float,
                 kernel: bool | None = None) -> None:
        """kernel: None picks the C++ kernel on the CPU where it is built; False: the torch path."""
        self.kernel = kernel
        self.states = states
        self.window = window
        self.scale = scale
        m = self.ring = window - 1
        spans = states.spans
        starts = positions[torch.tensor([r for r, _ in spans], dtype=torch.int64, device=positions.device)]
        starts = starts.tolist() if spans else []
        s_count = len(spans)
        valid = [min(s, m) for s in starts]  # ring cells each sequence reads
        lengths = [v + n for v, (_, n) in zip(valid, spans)]
        width = max(lengths, default=1)
        # cells[i, j]: sequence i's j-th key, in position order, indexing [ring cells of every
        # sequence (S * m)] + [the step's rows (T)]; padding reads cell 0 and is never seen
        cells = torch.zeros(s_count, width, dtype=torch.int64)
        row_seq, row_pos, w_seq, w_slot, w_row = [], [], [], [], []
        for i, ((r, n), s, v) in enumerate(zip(spans, starts, valid)):
            if v:
                cells[i, :v] = i * m + torch.arange(s - v, s) % m
            cells[i, v : v + n] = s_count * m + r + torch.arange(n)
            row_seq.append(torch.full((n,), i, dtype=torch.int64))
            row_pos.append(v + torch.arange(n))
            keep = min(n, m)  # the positions the ring holds after the step: the last m
            w_seq.append(torch.full((keep,), i, dtype=torch.int64))
            w_slot.append(torch.arange(s + n - keep, s + n) % m if m else torch.zeros(0, dtype=torch.int64))
            w_row.append(r + n - keep + torch.arange(keep))
        self.cells = cells
        self.row_seq = torch.cat(row_seq) if row_seq else torch.zeros(0, dtype=torch.int64)
        self.row_pos = torch.cat(row_pos) if row_pos else torch.zeros(0, dtype=torch.int64)
        dev = positions.device
        self.write_seq, self.write_slot, self.write_row = (
            torch.cat(x).to(dev) if x else torch.zeros(0, dtype=torch.int64, device=dev)
            for x in (w_seq, w_slot, w_row))
        self.lengths = lengths
        self.device = dev
        self._torch: tuple[torch.Tensor, ...] | None = None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of one sliding layer -> [T, Hq, D]; the layer's state
        moves past the step's rows."""
        before = self.states.load(layer)
        ring_k, ring_v = before["k"], before["v"]  # [S, m, Hkv, D]
        hkv, d = k.shape[1], k.shape[2]
        keys = torch.cat((ring_k.reshape(-1, hkv, d).to(k.dtype), k))
        values = torch.cat((ring_v.reshape(-1, hkv, d).to(v.dtype), v))
        kernel = ops.cpu_kernels(q) if self.kernel is not False else None
        if kernel is not None:
            out = kernel.attend(q.contiguous(), keys, values, self.cells, self.row_seq, self.row_pos,
                                self.scale, self.window)
        else:
            out = self._attend_torch(q, keys, values)
        if self.ring:
            ring_k[self.write_seq, self.write_slot] = k[self.write_row].to(ring_k.dtype)
            ring_v[self.write_seq, self.write_slot] = v[self.write_row].to(ring_v.dtype)
            self.states.save(layer, {"k": ring_k, "v": ring_v})
        return out

    def _attend_torch(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The same attention in torch, every sequence padded to the longest (float32 scores)."""
        if self._torch is None:
            s_count, width = self.cells.shape
            nmax = max((n for _, n in self.states.spans), default=1)
            rows = torch.zeros(s_count, nmax, dtype=torch.int64)
            qpos = torch.full((s_count, nmax), -1, dtype=torch.int64)
            for i, (r, n) in enumerate(self.states.spans):
                rows[i, :n] = r + torch.arange(n)
                qpos[i, :n] = self.row_pos[r : r + n]
            key_pos = torch.arange(width)[None, None, :]
            seen = (key_pos <= qpos[:, :, None]) & (key_pos > qpos[:, :, None] - self.window)
            real = qpos >= 0
            self._torch = tuple(t.to(self.device) for t in (self.cells, rows, seen, real))
        cells, rows, seen, real = self._torch
        s_count, width = cells.shape
        nmax = rows.shape[1]
        hq, d = q.shape[1], q.shape[2]
        hkv = keys.shape[1]
        grp = hq // hkv
        kc = keys[cells.reshape(-1)].view(s_count, width, hkv, d).permute(0, 2, 3, 1).float()
        vc = values[cells.reshape(-1)].view(s_count, width, hkv, d).permute(0, 2, 1, 3).float()
        qg = q[rows.reshape(-1)].view(s_count, nmax, hkv, grp, d).permute(0, 2, 1, 3, 4)
        qg = qg.reshape(s_count, hkv, nmax * grp, d).float()
        scores = torch.matmul(qg, kc) * self.scale  # [S, Hkv, nmax*G, width]
        hidden = ~seen[:, None, :, None, :].expand(s_count, hkv, nmax, grp, width)
        scores.masked_fill_(hidden.reshape(s_count, hkv, nmax * grp, width), float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), vc)  # [S, Hkv, nmax*G, D]
        o = o.view(s_count, hkv, nmax, grp, d).permute(0, 2, 1, 3, 4).reshape(s_count * nmax, hq, d)
        out = torch.empty_like(q)
        out[rows[real]] = o[real.reshape(-1)].to(q.dtype)
        return out
