"""Streamed K/V (`--kv-resident`) on CUDA: the Triton kernels read the device block cache directly.

A streamed pool keeps every cell in its host store (pinned) and, per layer,
`slots` blocks of `store.block` cells in the device cache `store.area`
(kv/stream.py). The kernels address cells through a table of chunks; here
the "chunk" is the block: per step and layer a translated table
[sequences, blocks] maps a sequence's block index to the block's row in the
area (its resident slot, or a scratch block for a block the cache cannot
hold this step), and the kernels run with that table and chunk size = block
size, over `halves(...)` views of the area. Design and ordering rules:
docs/GPU_STREAMING.md.

One step (`GpuStreamAttention`):
1. on the host, once: the blocks the step reads (the same in every layer),
   every layer's residency (`StreamStore.plan_layers`), the translated
   tables, write cells and kernel metadata, uploaded in one copy;
2. the misses of layer L (admitted blocks into their slots, overflow blocks
   into a scratch region) are copied by the store's copy engine
   (`store.copies`, kv/stream_copies.py): one gather launch per layer reading
   the pinned store in place (its (source, destination) block pairs come
   with the step's metadata), or one `copy_` per run of consecutive blocks;
   with `store.overlap`, `prefetch` layers ahead of the compute;
3. new K/V go into the cache rows by the Triton write kernel, and a second
   time into the copy engine's device staging area, written behind to the
   host store.

Without CUDA (tests, Triton's interpreter) the same code runs with every
copy done at once and no streams. `plan_step` needs neither a GPU nor
Triton.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from strata.attention.base import WINDOW_UNSUPPORTED
from strata.kv.formats import K8V4Format, PlainFormat
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec, StepCells, cells_at, step_cells
from strata.kv.stream import StreamedPool, StreamStore
from strata.kv.stream_copies import Run, coalesce

try:  # planning needs neither a GPU nor Triton; the kernels do
    from strata.attention.layout import halves
    from strata.attention.triton_pool import batch_parts, batches
    from strata.kernels.triton.decode import decode_attention
    from strata.kernels.triton.prefill import prefill_attention
    from strata.kernels.triton.write import write_plain, write_quantized

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the installation
    HAVE_TRITON = False


@dataclass
class StepPlan:
    """Host-side result of one step's planning (tests read it)."""

    need: torch.Tensor  # [U] pool blocks the step reads, sorted
    tables: torch.Tensor  # [layers, S, max_blocks] area block of each sequence block
    write_rows: torch.Tensor  # [layers, T] area row of each new token
    cells: torch.Tensor  # [T] pool cells of the new tokens
    pairs: list[np.ndarray]  # per layer: [n, 2] (host block, area block) copies, by host block
    overflow: list[int]  # per layer: blocks read from scratch
    ring: int
    region_blocks: int
    block: int  # cells of a block
    step: StepCells  # the step's sequences and new cells (kv/step.py)

    @cached_property
    def runs(self) -> list[list[Run]]:
        """Per layer: the copies as runs of consecutive cells (the `copy_` path's)."""
        b = self.block
        return [[(src * b, dst * b, n * b) for src, dst, n in coalesce(p[:, 0], p[:, 1])]
                for p in self.pairs]



def plan_step(store: StreamStore, seqs: list[SeqSpec], ring: int) -> StepPlan:
    """Everything the step needs from the host, computed once (see the module docstring)."""
    pool = store.pool
    state = store.copies
    B = store.block
    n_layers = len(store.host)
    S = len(seqs)
    sc = step_cells(pool, seqs)
    ends = sc.ends
    mb = -(-int(ends.max()) // B) if S else 0
    first = torch.arange(mb, dtype=torch.int64) * B
    cell0 = cells_at(pool.tables, pool.chunk_size, sc.lanes[:, None], first[None, :])  # [S, mb]
    valid = first[None, :] < ends[:, None]
    need, inv = torch.unique(cell0[valid] // B, return_inverse=True)
    plans = store.plan_layers(need)
    slot = torch.stack([p[0] for p in plans]) if plans else torch.empty(0, need.numel())
    over = slot < 0  # [layers, U]
    n_over = over.sum(1)
    state.layout(ring, int(n_over.max()) if n_layers else 0)
    layer_ix = torch.arange(n_layers, dtype=torch.int64)
    base = torch.tensor([state.region_base(layer) for layer in range(n_layers)], dtype=torch.int64)
    scratch = base[:, None] + torch.cumsum(over.to(torch.int64), 1) - 1
    entry = torch.where(over, scratch, layer_ix[:, None] * store.slots + slot)  # [layers, U]
    tables = torch.zeros((n_layers, S, mb), dtype=torch.int64)
    tables[:, valid] = entry[:, inv]
    # new tokens: pool cells (host store) and area rows per layer
    t = sc.write.numel()
    cells = sc.write
    write_rows = tables[:, sc.token_seq, sc.positions // B] * B + sc.positions % B  # [layers, T]
    # copies: admitted blocks into their slots, overflow blocks into the layer's region
    need_np = need.numpy()
    pairs, overflow = [], []
    cell_bytes = store.fmt.cell_bytes()
    for layer, (_, admit, slots) in enumerate(plans):
        o = over[layer].numpy()
        src = np.concatenate([admit.numpy(), need_np[o]])
        dst = np.concatenate([layer * store.slots + slots.numpy(),
                              int(base[layer]) + np.arange(int(o.sum()))])
        order = np.argsort(src, kind="stable")
        pairs.append(np.stack([src[order], dst[order]], 1).astype(np.int64))
        overflow.append(int(o.sum()))
    store.stats.overflow_bytes += sum(overflow) * B * cell_bytes
    assert t == cells.numel()
    return StepPlan(need, tables, write_rows, cells, pairs, overflow, ring, state.region_blocks, B, sc)


class GpuStreamAttention:
    """The AttentionContext of one engine step over a streamed pool: Triton kernels over the cache."""

    def __init__(self, pool: KvPool, seqs: list[SeqSpec], scale: float) -> None:
        assert isinstance(pool, StreamedPool)
        store = pool.store
        self.pool, self.store = pool, store
        self.fmt = pool.fmt
        self.scale = scale
        self.plain = isinstance(pool.fmt, PlainFormat)
        self.rotate_v = isinstance(pool.fmt, K8V4Format) and pool.fmt.rotate
        self.state = state = store.copies
        self.overlap = store.overlap
        self.layers = len(store.host)
        ring = min(state.prefetch, self.layers) if self.overlap else 1
        plan = self.plan = plan_step(store, seqs, ring)  # bookkeeping only: nothing read yet
        state.flush()  # the last step's K/V reach the host store before any copy out of it
        t = plan.cells.numel()
        self.tokens = t
        state.begin_step(plan.cells)
        self.stage = state.staging(self.layers * t)
        # kernel metadata, one upload (as in GpuTableAttention, but the sequences index the rows
        # of the step's translated tables)
        sc = plan.step
        stage_rows = torch.arange(self.layers * t, dtype=torch.int64)
        parts = [plan.tables.reshape(-1), plan.write_rows.reshape(-1), stage_rows,
                 *batch_parts(sc, torch.arange(len(seqs), dtype=torch.int64))]
        self.gather = state.use_gather()
        if self.gather:  # every layer's (host block, area block) copies, in the same upload
            parts.append(torch.from_numpy(np.concatenate(plan.pairs).reshape(-1)))
        packed = torch.cat(parts)
        if state.cuda:
            packed = packed.pin_memory().to(store.device, non_blocking=True)
            if self.gather:  # the copy stream reads the pairs
                state.metadata_uploaded(packed)
        views = packed.split([p.numel() for p in parts])
        self.tables = views[0].view(plan.tables.shape)
        self.write_rows = views[1].view(plan.write_rows.shape)
        self.stage_rows = views[2].view(self.layers, t)
        self.decode, self.prefill = batches(sc, list(views[3:12]))
        self.pairs: list[torch.Tensor] = []
        if self.gather:
            self.pairs = list(views[12].view(-1, 2).split([len(p) for p in plan.pairs]))
        self.halves = halves(self.fmt, store.area)
        self.stage_halves = halves(self.fmt, self.stage)
        if self.overlap:
            for layer in range(ring):
                self._enqueue(layer)

    def _enqueue(self, layer: int) -> None:
        """Layer `layer`'s copies: its pairs to the gather kernel, or its runs to `copy_`.

        A gather that cannot launch (a launcher refusing the host pointers, say)
        raises before it enqueues anything: then this store copies with `copy_`
        from here on, with a warning (`use_gather()` says which path runs).
        """
        if self.gather:
            try:
                self.state.enqueue(layer, [], self.overlap, self.pairs[layer])
                return
            except Exception as e:  # noqa: BLE001 - the fallback is exact too
                warnings.warn(f"streamed K/V: the gather kernel failed ({type(e).__name__}: {e}); "
                              "copying with copy_ instead", RuntimeWarning, stacklevel=2)
                self.state.gather_failed()
                self.gather = False
        self.state.enqueue(layer, self.plan.runs[layer], self.overlap)

    def _write(self, kh, vh, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.plain:
            write_plain(kh.data, vh.data, rows, k, v)
        else:
            write_quantized(kh, vh, rows, k, v, self.rotate_v)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        """Store k, v [T, Hkv, D]; causal attention of q [T, Hq, D] over the cache -> [T, Hq, D]."""
        if window is not None:
            raise NotImplementedError(WINDOW_UNSUPPORTED)
        state, plan = self.state, self.plan
        layer = self.pool.local(layer)  # the store's own index
        if not self.overlap:
            self._enqueue(layer)
        state.before_layer(layer)
        kh, vh = self.halves
        self._write(kh, vh, self.write_rows[layer], k, v)
        sk, sv = self.stage_halves
        self._write(sk, sv, self.stage_rows[layer], k, v)
        state.staged(layer)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        table = self.tables[layer]
        block = self.store.block
        decode_attention(q, out, self.decode, kh, vh, table, block, self.scale, self.rotate_v)
        prefill_attention(q, out, self.prefill, kh, vh, table, block, self.scale, self.rotate_v)
        state.after_layer(layer)
        nxt = layer + plan.ring
        if self.overlap and nxt < self.layers:
            self._enqueue(nxt)
        if layer == self.layers - 1:
            state.send_behind()
        return out
