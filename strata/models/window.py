"""Sliding-window attention over per-lane state: a window layer keeps only its window's k/v.

A sliding layer's query at position p sees the keys at p - W + 1 .. p. So
the last W positions are all such a layer ever needs of a conversation, and
they are the layer's fixed-size state per lane (`kv/state.py`), in the
model's dtype (the values a pool cell would hold), instead of cells in the
KV pool: a lane's memory for these layers follows the window, not the
context, and the model is a state model (resumed from its whole
conversation or from a checkpoint, `engine/checkpoints.py`).

The state is a ring of W slots: position q lives in slot q mod W. A
sequence that starts at position s holds min(s, W) valid slots (positions
max(0, s - W) .. s - 1); a fresh one none, so whatever its slot held is
never read. The ring has W slots, not W - 1, so that a decode row can be
written to its slot before it attends (the slot held position p - W, which
row p no longer sees) and then read with the rest of its window where it
lies: a decode step copies nothing but its own k/v. A sequence with several
rows (prompt reading) gathers its W - 1 cells before the rows, attends over
[those] + [its rows' k/v] and writes its last W rows into the ring after.

A verified run of drafts (speculative decoding) is such a sequence of
several rows. Its rejected rows would leave their k/v in slots that held
positions the lane still needs, so the step keeps, for each of the run's
rows, what the slots it wrote must hold if the lane ends after that row
(the run's own k/v, or what the slot held before the step) and
`StatePool.rewind` writes them back.

Either way each row's keys are read in position order by the same C++
kernel as the pool's attention on the CPU (`kernels/cpu/`), one by one: a
row's bits depend only on its keys, so a sequence read at once, in parts or
resumed from a checkpoint gives the same bits (and the bits the pool path
gave). Elsewhere a padded torch path computes the same attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kv.state import RunStates, StateContext, StateShapes
from strata.models import ops


def window_state_shapes(window: int, num_kv_heads: int, head_dim: int) -> StateShapes:
    """The k and v of a lane's last `window` positions, a ring indexed by position mod window."""
    return {"k": (window, num_kv_heads, head_dim), "v": (window, num_kv_heads, head_dim)}


@dataclass
class _Run:
    """A verified run's slots (its lane's ring entries the step writes) and, per row, where
    each slot's value comes from should the lane end after that row."""

    seq: int  # the sequence's index in the step
    cells: torch.Tensor  # [m] the slots (ring entries 0..W-1 of the lane)
    flat: torch.Tensor  # [m] the same as cells of the layer's flat ring (slot * W + entry)
    rows: torch.Tensor  # [n] the run's rows in the step
    source: torch.Tensor  # [n, m] index into [the slots before the step (m)] + [the run's k/v (n)]


def run_sources(start: int, n: int, window: int) -> tuple[list[int], torch.Tensor]:
    """The ring entries a run of n rows from position `start` writes, and for each row j the
    source of each entry if the lane keeps rows 0..j: the run's row (index m + row) when the
    position the entry then holds (the latest before start + j + 1 with its residue) is the
    run's, else the entry's value before the step (its index < m)."""
    cells = sorted({q % window for q in range(start, start + n)})
    m = len(cells)
    source = torch.empty(n, m, dtype=torch.int64)
    for j in range(n):
        end = start + j + 1  # the lane's length if it keeps rows 0..j
        for c_index, c in enumerate(cells):
            q = end - 1 - (end - 1 - c) % window  # the position entry c holds at that length
            source[j, c_index] = m + q - start if q >= start else c_index
    return cells, source


@dataclass
class _Group:
    """Sequences attended in one kernel call over one key buffer."""

    rows: torch.Tensor  # [R] the step's rows, by sequence then position (on the model's device)
    cells: torch.Tensor  # [S, L] each sequence's keys in position order, as buffer indices (host)
    row_seq: torch.Tensor  # [R] each row's sequence in the group (host)
    row_pos: torch.Tensor  # [R] each row's key count - 1: the kernel's position (host)
    gather: torch.Tensor | None  # ring cells copied ahead of the rows' own k/v (None: in place)
    write: torch.Tensor  # [K] ring cells the step writes (flat: slot * W + position mod W)
    write_rows: torch.Tensor  # [K] the rows they take k/v from
    padded: tuple[torch.Tensor, ...] | None = None  # the torch path's indices, made on first use
    runs: list[_Run] | None = None  # verified runs of drafts among the sequences


class WindowStep:
    """What every sliding layer of one step shares: where each row's keys are, which ring cells
    the step writes. Built once per forward from the step's positions and row spans."""

    def __init__(self, positions: torch.Tensor, states: StateContext, window: int, scale: float,
                 kernel: bool | None = None) -> None:
        """kernel: None picks the C++ kernel on the CPU where it is built; False: the torch path."""
        self.states = states
        self.window = window
        self.scale = scale
        self.kernel = kernel
        self.device = positions.device
        spans = states.spans
        first_rows = torch.tensor([r for r, _ in spans], dtype=torch.int64, device=positions.device)
        starts = positions[first_rows].tolist()
        slots = states.slots.tolist()
        seqs = list(zip(spans, starts, slots))
        ones = [x for x in seqs if x[0][1] == 1]
        more = [x for x in seqs if x[0][1] > 1]
        self.groups = [g for g in (self._decode(ones), self._prompt(more)) if g is not None]
        runs = [self._run(i, spans[i], starts[i], slots[i]) for i, run in enumerate(states.runs) if run]
        if runs:  # runs have several rows: the prompt group (the last) holds them
            self.groups[-1].runs = runs

    def _run(self, seq: int, span: tuple[int, int], start: int, slot: int) -> _Run:
        first, n = span
        cells, source = run_sources(start, n, self.window)
        local = torch.tensor(cells, dtype=torch.int64)
        return _Run(seq, local.to(self.device), (slot * self.window + local).to(self.device),
                    torch.arange(first, first + n, device=self.device), source.to(self.device))

    def _decode(self, seqs: list) -> _Group | None:
        """One-row sequences, in place: the row's cell is written first, then its window read."""
        if not seqs:
            return None
        w = self.window
        s_count = len(seqs)
        rows = torch.tensor([r for (r, _), _, _ in seqs], dtype=torch.int64)
        pos = torch.tensor([p for _, p, _ in seqs], dtype=torch.int64)
        slot = torch.tensor([s for _, _, s in seqs], dtype=torch.int64)
        count = torch.clamp(pos + 1, max=w)  # keys each row sees, itself included
        ar = torch.arange(w)
        key_pos = pos[:, None] - count[:, None] + 1 + ar[None, :]  # [S, W], position order
        cells = torch.where(ar[None, :] < count[:, None], slot[:, None] * w + key_pos % w, 0)
        return _Group(rows.to(self.device), cells.contiguous(), torch.arange(s_count), count - 1, None,
                      (slot * w + pos % w).to(self.device), rows.to(self.device))

    def _prompt(self, seqs: list) -> _Group | None:
        """Sequences of several rows: their W - 1 ring cells gathered ahead of their rows."""
        if not seqs:
            return None
        w = self.window
        valid = [min(s, w - 1) for _, s, _ in seqs]
        gather = torch.cat([slot * w + torch.arange(s - v, s) % w for (_, s, slot), v in zip(seqs, valid)])
        g_total = gather.numel()
        width = max(v + n for ((_, n), _, _), v in zip(seqs, valid))
        cells = torch.zeros(len(seqs), width, dtype=torch.int64)
        rows, row_seq, row_pos, write, write_rows = [], [], [], [], []
        g0 = r0 = 0
        for i, (((r, n), s, slot), v) in enumerate(zip(seqs, valid)):
            cells[i, :v] = g0 + torch.arange(v)
            cells[i, v : v + n] = g_total + r0 + torch.arange(n)
            rows.append(r + torch.arange(n))
            row_seq.append(torch.full((n,), i, dtype=torch.int64))
            row_pos.append(v + torch.arange(n))
            keep = min(n, w)  # the ring holds the last W positions after the step
            write.append(slot * w + torch.arange(s + n - keep, s + n) % w)
            write_rows.append(r + n - keep + torch.arange(keep))
            g0 += v
            r0 += n
        dev = self.device
        return _Group(torch.cat(rows).to(dev), cells, torch.cat(row_seq), torch.cat(row_pos),
                      gather.to(dev), torch.cat(write).to(dev), torch.cat(write_rows).to(dev))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of one sliding layer -> [T, Hq, D]; the layer's ring
        moves past the step's rows."""
        ring = self.states.in_place(layer)
        hkv, d = k.shape[1], k.shape[2]
        ring_k, ring_v = ring["k"].view(-1, hkv, d), ring["v"].view(-1, hkv, d)  # [lanes * W, Hkv, D]
        out = torch.empty_like(q)
        kernel = ops.cpu_kernels(q) if self.kernel is not False else None
        for g in self.groups:
            before = self._before(g, ring_k, ring_v)
            qg = q[g.rows]
            if g.gather is None:  # write first, then read the window where it lies
                ring_k.index_copy_(0, g.write, k[g.write_rows].to(ring_k.dtype))
                ring_v.index_copy_(0, g.write, v[g.write_rows].to(ring_v.dtype))
                keys, values = ring_k, ring_v
            else:
                keys = torch.cat((ring_k[g.gather].to(k.dtype), k[g.rows]))
                values = torch.cat((ring_v[g.gather].to(v.dtype), v[g.rows]))
            if kernel is not None:
                og = kernel.attend(qg, keys, values, g.cells, g.row_seq, g.row_pos, self.scale, self.window)
            else:
                og = self._attend_torch(g, qg, keys, values)
            out[g.rows] = og.to(q.dtype)
            if g.gather is not None:
                ring_k.index_copy_(0, g.write, k[g.write_rows].to(ring_k.dtype))
                ring_v.index_copy_(0, g.write, v[g.write_rows].to(ring_v.dtype))
            for run, (old_k, old_v) in zip(g.runs or [], before):
                after = {name: torch.cat((old, new[run.rows].to(old.dtype)))[run.source]
                         for name, old, new in (("k", old_k, k), ("v", old_v, v))}
                self.states.keep_run(layer, run.seq, RunStates(after, {"k": run.cells, "v": run.cells}))
        return out

    @staticmethod
    def _before(g: _Group, ring_k: torch.Tensor, ring_v: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The slots each verified run of `g` writes, as they are before the step writes them."""
        return [(ring_k[run.flat], ring_v[run.flat]) for run in g.runs or []]  # copies (indexing)

    def _attend_torch(self, g: _Group, q: torch.Tensor, keys: torch.Tensor,
                      values: torch.Tensor) -> torch.Tensor:
        """The group's attention in torch, every sequence padded to the longest (float32)."""
        if g.padded is None:
            s_count, width = g.cells.shape
            counts = torch.bincount(g.row_seq, minlength=s_count)
            nmax = int(counts.max())
            first = torch.cumsum(counts, 0) - counts
            col = torch.arange(g.row_seq.numel()) - first[g.row_seq]
            rows = torch.zeros(s_count, nmax, dtype=torch.int64)
            qpos = torch.full((s_count, nmax), -1, dtype=torch.int64)
            rows[g.row_seq, col] = torch.arange(g.row_seq.numel())
            qpos[g.row_seq, col] = g.row_pos
            key_pos = torch.arange(width)[None, None, :]
            seen = (key_pos <= qpos[:, :, None]) & (key_pos > qpos[:, :, None] - self.window)
            g.padded = tuple(t.to(self.device) for t in (g.cells, rows, seen, qpos >= 0))
        cells, rows, seen, real = g.padded
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
