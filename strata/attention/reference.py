"""Attention through the chunk tables: the C++ kernel on the CPU, plain torch elsewhere.

One engine step reads a set of sequences (`kv/step.py: SeqSpec`), each a run
of new tokens at positions [start, start + n) of a lane. `TableAttention` writes their K/V
into the pool and computes causal grouped-query attention over each
sequence's cells [0, start + n), gathered through its chunk table (a sliding
layer's row at p: only positions > p - window; every cell stays in the pool).

On the CPU the rows go to the C++ kernel (`strata/kernels/cpu/loader.py`), which computes
each query row by itself and so is exact by construction; it needs none of
the machinery below. The torch path (the reference, the oracle for the GPU
kernels, and the path wherever the kernel is not built) is exact this way:
keys are processed in blocks of `BLOCK` absolute
positions. Per block the probabilities are summed by the same bf16 matmul
that weights V (a column of ones rides along), and blocks are combined by a
sequential prefix sum that is read at the query's own block. Blocks past a
query contribute exact zeros it never reads, so a query's result does not
depend on which other sequences, queries or padding were computed beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from strata.attention.base import InPlaceCells
from strata.kernels.cpu.loader import cpu_kernel
from strata.kv.formats import PlainFormat
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec, StepCells, key_cells, step_cells

BLOCK = 128
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class _Group:
    """Sequences computed together, padded to the same query and key lengths."""

    rows: torch.Tensor  # [S, nmax] indices into the step's flattened tokens (padding -> 0)
    valid: torch.Tensor  # [S, nmax] bool: a real query row
    qpos: torch.Tensor  # [S, nmax] positions (padding -> 0)
    key_cells: torch.Tensor  # [S * Lp] cells to gather (past the end -> trash)
    lp: int  # padded key length, a multiple of BLOCK
    out_rows: torch.Tensor  # [R] flattened token indices of valid rows
    out_sel: torch.Tensor  # [R] indices into the group's S * nmax rows
    # per window (None: causal only), [S*Hkv, nb, nmax*G, BLOCK] bool: keys a query must not see
    hidden: dict[int | None, torch.Tensor] = field(default_factory=dict)
    block_of: torch.Tensor | None = None  # [S*Hkv, 1, nmax*G, D+1] the block each query reads
    ones: torch.Tensor | None = None  # [S*Hkv, nb, BLOCK, D+1]: V of the layer, then a column of
    # ones that sums the probabilities in the same matmul
    in_order: bool = False  # the group's valid rows are all the step's rows, in order
    spans: list[int] | None = None  # first cell of each sequence when its Lp cells are consecutive


class TableAttention:
    """The AttentionContext of one engine step over the shared pool.

    `kernel`: None picks the C++ kernel for a CPU pool where it is built;
    False forces the torch reference.
    """

    def __init__(self, pool: KvPool, seqs: list[SeqSpec], scale: float,
                 kernel: bool | None = None) -> None:
        self.pool = pool
        self.fmt = pool.fmt
        self.scale = scale
        dev = pool.device
        cells = step_cells(pool, seqs)
        self.write_cells = cells.write.to(dev)
        self.kernel = None
        if kernel is not False and dev.type == "cpu" and seqs:
            self.kernel = cpu_kernel()
        if self.kernel is not None:
            self._kernel_inputs(pool, seqs, cells)
            return
        offsets, t = [], 0
        for s in seqs:
            offsets.append(t)
            t += s.n
        decode = [i for i, s in enumerate(seqs) if s.n == 1]
        prefill = [i for i, s in enumerate(seqs) if s.n > 1]
        self.groups = [
            self._group(pool, [seqs[i] for i in idx], [offsets[i] for i in idx], dev)
            for idx in (decode, prefill)
            if idx
        ]
        if len(self.groups) == 1:
            g = self.groups[0]
            g.in_order = bool(len(g.out_rows) == t and torch.equal(g.out_rows.cpu(), torch.arange(t)))

    @staticmethod
    def _group(pool: KvPool, seqs: list[SeqSpec], offsets: list[int], dev: torch.device) -> _Group:
        nmax = max(s.n for s in seqs)
        lp = -(-max(s.end for s in seqs) // BLOCK) * BLOCK
        ar_q = torch.arange(nmax)
        starts = torch.tensor([s.start for s in seqs])
        ns = torch.tensor([s.n for s in seqs])
        offs = torch.tensor(offsets)
        valid = ar_q[None, :] < ns[:, None]
        rows = torch.where(valid, offs[:, None] + ar_q[None, :], 0)
        qpos = torch.where(valid, starts[:, None] + ar_q[None, :], 0)
        trash_cell = pool.trash * pool.chunk_size
        keys = []
        ar_k = torch.arange(lp)
        spans: list[int] | None = [] if pool.in_place else None
        lane_cells = key_cells(pool, torch.tensor([s.lane for s in seqs]), lp)
        for s, c in zip(seqs, lane_cells):
            keys.append(torch.where(ar_k < s.end, c, trash_cell))
            if spans is not None:
                # the cells it reads are consecutive: read them as a view, not a gather (the
                # positions past its end read finite cells that the mask hides, as trash would)
                base = int(c[0])
                n_cells = (pool.num_chunks + 1) * pool.chunk_size
                if base + lp <= n_cells and torch.equal(c[: s.end], base + ar_k[: s.end]):
                    spans.append(base)
                else:
                    spans = None
        flat_valid = valid.reshape(-1)
        return _Group(
            rows=rows.to(dev),
            valid=valid.to(dev),
            qpos=qpos.to(dev),
            key_cells=torch.cat(keys).to(dev),
            lp=lp,
            out_rows=rows.reshape(-1)[flat_valid].to(dev),
            out_sel=torch.nonzero(flat_valid).reshape(-1).to(dev),
            spans=spans,
        )

    def _kernel_inputs(self, pool: KvPool, seqs: list[SeqSpec], cells: StepCells) -> None:
        """Every sequence's cells [S, Lmax], and each row's sequence and position (the step's)."""
        self.cells = key_cells(pool, cells.lanes, max(s.end for s in seqs)).contiguous()
        self.row_seq = cells.token_seq
        self.row_pos = cells.positions
        # plain cells are read in place; other formats are dequantized first, one layer at a time
        self.in_place = pool.in_place and isinstance(pool.fmt, PlainFormat)

    def _attend_kernel(self, layer: int, q: torch.Tensor, window: int | None) -> torch.Tensor:
        if q.dtype not in KERNEL_DTYPES:
            raise TypeError(f"the CPU attention kernel computes in {KERNEL_DTYPES}, not {q.dtype}")
        w = window or 0  # the kernel's 0: no window
        if self.in_place:
            st = self.pool.storage(layer)
            out = self.kernel.attend(q, st["k"], st["v"], self.cells, self.row_seq, self.row_pos,
                                     self.scale, w)
        else:
            kc, vc = self.pool.read(layer, self.cells.reshape(-1), q.dtype)
            local = torch.arange(self.cells.numel()).view(self.cells.shape)
            out = self.kernel.attend(q, kc.contiguous(), vc.contiguous(), local, self.row_seq,
                                     self.row_pos, self.scale, w)
        return self.fmt.finish_output(out)

    def cells_in_place(self, layer: int, dtype: torch.dtype) -> InPlaceCells | None:
        """The layer's cells for a caller that writes and attends in one C++ call (`InPlaceCells`),
        where this context's `attend` would be exactly that: the C++ kernel over plain cells of
        `dtype` read in place. None otherwise (the torch path, quantized or streamed cells)."""
        if self.kernel is None or not self.in_place or not isinstance(self.fmt, PlainFormat) or self.fmt.dtype != dtype:
            return None
        st = self.pool.storage(layer)
        return InPlaceCells(st["k"], st["v"], self.write_cells, self.cells, self.row_seq, self.row_pos, self.scale)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        self.pool.write(layer, self.write_cells, k, v)
        if self.kernel is not None:
            return self._attend_kernel(layer, q.contiguous(), window)
        if len(self.groups) == 1 and self.groups[0].in_order and self.groups[0].rows.shape[1] == 1:
            return self.fmt.finish_output(self._attend_group(layer, self.groups[0], q, window).squeeze(1))
        out = torch.empty_like(q)
        for g in self.groups:
            o = self._attend_group(layer, g, q, window)
            out[g.out_rows] = o.reshape(-1, *o.shape[2:])[g.out_sel]
        return self.fmt.finish_output(out)

    @staticmethod
    def _hidden(g: _Group, hkv: int, grp: int, window: int | None) -> torch.Tensor:
        """The keys each query must not see, shared by every layer of the step with this window
        (made on first use)."""
        if window in g.hidden:
            return g.hidden[window]
        S, nmax = g.rows.shape
        lp = g.lp
        key_pos = torch.arange(lp, device=g.qpos.device)[None, None, :]
        allowed = key_pos <= g.qpos[:, :, None]  # [S,nmax,Lp]
        if window is not None:
            allowed &= key_pos > g.qpos[:, :, None] - window
        allowed = allowed[:, None, :, None, :].expand(S, hkv, nmax, grp, lp)
        allowed = allowed.reshape(S * hkv, nmax * grp, lp // BLOCK, BLOCK).transpose(1, 2)
        g.hidden[window] = ~allowed.contiguous()  # [S*Hkv, nb, nmax*G, BLOCK], the layout of the scores
        return g.hidden[window]

    @staticmethod
    def _prepare(g: _Group, hkv: int, grp: int, d: int, dtype: torch.dtype) -> None:
        """Indices and buffers shared by every layer of the step (made on first use)."""
        S, nmax = g.rows.shape
        lp = g.lp
        dev = g.qpos.device
        qb = (g.qpos // BLOCK)[:, None, :, None].expand(S, hkv, nmax, grp)
        g.block_of = qb.reshape(S * hkv, 1, nmax * grp, 1).expand(-1, -1, -1, d + 1).contiguous()
        g.ones = torch.ones(S * hkv, lp // BLOCK, BLOCK, d + 1, dtype=dtype, device=dev)

    def _attend_group(self, layer: int, g: _Group, q: torch.Tensor, window: int | None) -> torch.Tensor:
        S, nmax = g.rows.shape
        hq, d = q.shape[1], q.shape[2]
        if g.spans is not None:  # consecutive cells: views of the pool, no gather
            st = self.pool.storage(layer)
            parts = [self.fmt.read(st, slice(b, b + g.lp), q.dtype) for b in g.spans]
            kc = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts])
            vc = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts])
        else:
            kc, vc = self.pool.read(layer, g.key_cells, q.dtype)  # [S*Lp, Hkv, D]
        hkv = kc.shape[1]
        grp = hq // hkv
        nb = g.lp // BLOCK
        if g.in_order and nmax == 1:  # a decode step: the rows are already in place
            qg = q.view(S, 1, hkv, grp, d)
        else:
            qg = q[g.rows.reshape(-1)].view(S, nmax, hkv, grp, d)
        qh = qg.permute(0, 2, 1, 3, 4).reshape(S * hkv, 1, nmax * grp, d)
        # keys block-major, [S*Hkv, nb, D, BLOCK]: scores come out in the layout p @ V reads
        kh = kc.view(S, nb, BLOCK, hkv, d).permute(0, 3, 1, 4, 2).reshape(S * hkv, nb, d, BLOCK)
        if g.ones is None or g.ones.dtype != q.dtype:
            self._prepare(g, hkv, grp, d, q.dtype)
        scores = torch.matmul(qh, kh).float().mul_(self.scale)  # [S*Hkv, nb, nmax*G, BLOCK]
        scores.masked_fill_(self._hidden(g, hkv, grp, window), float("-inf"))
        peak = scores.amax(dim=(1, 3), keepdim=True)  # each query's largest score over all blocks
        pb = torch.exp(scores - peak).to(q.dtype)
        # V block-major beside a column of ones, in one copy into the step's buffer
        g.ones[..., :d].view(S, hkv, nb, BLOCK, d).copy_(vc.view(S, nb, BLOCK, hkv, d).permute(0, 3, 1, 2, 4))
        ob = torch.matmul(pb, g.ones).float().cumsum(dim=1)  # [S*Hkv, nb, nmax*G, D+1]
        sel = ob.gather(1, g.block_of).squeeze(1)  # [S*Hkv, nmax*G, D+1]
        o = (sel[..., :d] / sel[..., d:]).to(q.dtype)
        return o.view(S, hkv, nmax, grp, d).permute(0, 2, 1, 3, 4).reshape(S, nmax, hq, d)
