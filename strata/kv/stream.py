"""KV streaming (`--kv-resident N`): all K/V in a host store, N cells per layer on the device.

`StreamedPool` is a KvPool whose own storage (`pool.layers`) is the host
store: pinned memory when the device is CUDA, so host -> device copies can be
asynchronous. Its chunk tables and the cell indices attention builds live on
the device; its `store` (a `StreamStore`) is the device block cache. The device
holds a cache of BLOCKS (a block is `block_cells` consecutive pool cells,
block id `cell // block_cells`); the cache maps pool cells, not positions, so
moving a conversation between lanes (a chunk-table swap) needs no cache
change, and chunk tables keep addressing the host store.

- `read` resolves the blocks a read needs: hits are read where they sit in the
  cache; misses are copied in as the format's byte runs (one `index_copy_` per
  run for all the layer's missed blocks); then everything is dequantized from
  the device in one read. When one read needs more blocks than the cache has
  slots, the cells of those the residency policy (kv/residency.py) leaves out
  are copied straight from the host store into a scratch tail that all layers
  share: still exact, and counted as overflow.
- `write` quantizes once, then stores the same bytes in the host store and,
  for cells whose block is resident, in the cache, so the two never disagree.

Every path moves whole runs and dequantizes with the format's own `read`, so
streamed attention equals resident attention bit for bit
(tests/kv/test_stream.py). On a machine without a GPU the cache is a second
CPU buffer and the same code runs.

On CUDA the engine does not use `read`/`write` but the Triton kernels over the
cache (`strata/attention/triton_stream.py`, docs/GPU_STREAMING.md): it resolves
every layer's residency at the start of a step (`plan_layers`), copies misses
on a side stream ahead of the layers that read them (`overlap`), one gather
launch per layer reading the pinned store in place (`gather`), and writes new
K/V behind, to the host store, without a host sync (`settle()` lands them
before anyone reads the host store directly; the pool's raw cell I/O settles
first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from strata.knobs import flag
from strata.kv.formats import KvFormat, Storage
from strata.kv.pool import KvPool
from strata.kv.residency import BlockUsage, ResidencyConfig, choose_resident
from strata.kv.stream_copies import StreamCopies, coalesce
from strata.kv.tables import ChunkTables

DEFAULT_BLOCK_CELLS = 64


@dataclass
class StreamStats:
    lookups: int = 0  # block lookups (distinct blocks per read and layer)
    hits: int = 0
    misses: int = 0
    blocks_copied: int = 0  # host -> cache
    bytes_copied: int = 0
    overflow_blocks: int = 0  # needed blocks the cache could not hold
    overflow_bytes: int = 0  # their cells, copied host -> scratch

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 1.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "hit_rate": self.hit_rate}


class StreamStore:
    """The device block cache over a streamed pool's host store (`StreamedPool.store`).

    Device memory is one tensor per run: layer l's `resident` cells at rows
    [l * R, (l + 1) * R), then a scratch tail shared by all layers for the
    cells a read takes straight from the host (it grows to the largest such read).
    """

    def __init__(
        self,
        pool: KvPool,
        resident_cells: int,
        block_cells: int = DEFAULT_BLOCK_CELLS,
        device: torch.device | str | None = None,
        residency: ResidencyConfig | None = None,
        overlap: bool | None = None,
        gather: bool | None = None,
    ) -> None:
        # A block must not straddle two chunks, or one block would mix lanes.
        self.block = math.gcd(block_cells, pool.chunk_size)
        self.slots = resident_cells // self.block
        if self.slots < 1:
            raise ValueError(
                f"--kv-resident {resident_cells} is smaller than one block ({self.block} cells)"
            )
        self.pool = pool
        self.fmt: KvFormat = pool.fmt
        self.residency = residency or ResidencyConfig()
        self.device = torch.device(device) if device is not None else pool.device
        self.host: list[Storage] = pool.layers
        num_cells = next(iter(self.host[0].values())).shape[0]
        self.num_blocks = num_cells // self.block
        n_layers = len(self.host)
        self.rows = self.slots * self.block  # device rows per layer
        self.scratch0 = n_layers * self.rows
        self.area: Storage = self.fmt.allocate(self.scratch0, self.device)
        self.block_slot = torch.full((n_layers, self.num_blocks), -1, dtype=torch.int64)
        self.slot_block = torch.full((n_layers, self.slots), -1, dtype=torch.int64)
        self.last_use = torch.zeros((n_layers, self.slots), dtype=torch.int64)
        self.span = torch.zeros(pool.num_lanes, dtype=torch.int64)  # blocks per lane
        self.clock = 0
        self.stats = StreamStats()
        self._maps_key: tuple[torch.Tensor, tuple[int, ...]] | None = None
        self._maps: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))
        # How the CUDA path (attention/triton_stream.py) copies: layer L's misses while earlier
        # layers compute (`overlap`; False: copy, then wait, as `read` does); by one gather launch
        # reading the pinned store in place (`gather` True), one `copy_` per run of blocks (False),
        # or None: the gather kernel on CUDA where it can run. Defaults: the knobs (strata/knobs.py).
        self.overlap = flag("STRATA_STREAM_OVERLAP") if overlap is None else overlap
        self.gather: bool | None = gather if gather is not None else (
            None if flag("STRATA_STREAM_GATHER") else False)
        self.copies = StreamCopies(self)

    # ---- figures -------------------------------------------------------------
    def host_bytes(self) -> int:
        return sum(t.nbytes for st in self.host for t in st.values())

    def cache_bytes(self) -> int:
        """Device bytes: the resident cells of every layer plus the scratch tail."""
        return sum(t.nbytes for t in self.area.values())

    def figures(self) -> dict[str, float | int | bool]:
        pinned = self.copies.cuda and all(t.is_pinned() for st in self.host for t in st.values())
        return {
            **self.stats.as_dict(),
            "resident_cells": self.rows,
            "block_cells": self.block,
            "host_bytes": self.host_bytes(),
            "pinned_bytes": self.host_bytes() if pinned else 0,
            "cache_bytes": self.cache_bytes(),
            "scratch_cells": next(iter(self.area.values())).shape[0] - self.scratch0,
        }

    # ---- the pool's cell I/O ---------------------------------------------------
    def write(self, layer: int, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize once; the same bytes go to the host store and to resident blocks."""
        self.settle()
        n = cells.numel()
        staged = self.fmt.allocate(n, k.device)
        self.fmt.write(staged, torch.arange(n, device=k.device), k, v)
        cells_h = cells.to("cpu")
        self._write_host(layer, cells_h, staged)
        slot = self.block_slot[layer][cells_h // self.block]
        res = slot >= 0
        if bool(res.any()):
            at = layer * self.rows + slot[res] * self.block + cells_h[res] % self.block
            at, rows = at.to(self.device), res.to(k.device)
            for name, dest in self.area.items():
                dest.index_copy_(0, at, staged[name][rows].to(self.device))

    def _write_host(self, layer: int, cells: torch.Tensor, staged: Storage) -> None:
        for name, dest in self.host[layer].items():
            dest.index_copy_(0, cells, staged[name].to("cpu"))

    def read(
        self, layer: int, cells: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized k, v [N, Hkv, D] on the device for pool cells `cells` [N]."""
        self.settle()
        cells_h = cells.to("cpu")
        need, inv = torch.unique(cells_h // self.block, return_inverse=True)
        self.clock += 1
        admit, slots = self._resolve(layer, need)
        self._copy_in(layer, admit, slots)
        slot = self.block_slot[layer][need][inv]
        res = slot >= 0
        at = layer * self.rows + slot * self.block + cells_h % self.block
        if not bool(res.all()):
            direct, where = torch.unique(cells_h[~res], return_inverse=True)
            self._ensure_scratch(direct.numel())
            d = direct.numpy()
            self.copies.copy_now(layer, coalesce(d, self.scratch0 + np.arange(d.size)))
            self.stats.overflow_bytes += direct.numel() * self.fmt.cell_bytes()
            at[~res] = self.scratch0 + where
        return self.fmt.read(self.area, at.to(self.device), dtype)

    def _ensure_scratch(self, cells: int) -> None:
        have = next(iter(self.area.values())).shape[0] - self.scratch0
        if cells > have:
            self.grow_area(self.scratch0 + max(cells, 2 * have))

    def grow_area(self, rows: int) -> None:
        """At least `rows` device rows: the resident cells are kept, the scratch tail is not.
        The caller makes sure no copy or read of the old area is still in flight."""
        if rows <= next(iter(self.area.values())).shape[0]:
            return
        grown = self.fmt.allocate(rows, self.device)
        for name, t in grown.items():
            t[: self.scratch0].copy_(self.area[name][: self.scratch0])
        self.area = grown

    # ---- the host store as the source of truth ------------------------------------
    def settle(self) -> None:
        """Land every write still on its way to the host store, and let in-flight copies out of
        it finish: after this the host store may be read or written directly."""
        self.copies.settle()

    # ---- host writes behind the store's back ------------------------------------
    def invalidate(self, cells: torch.Tensor | None = None) -> None:
        """Drop cached blocks holding `cells` (all blocks if None) in every layer.

        For code that fills the host store directly (a conversation restore, a
        lane file): the next read copies those blocks in again.
        """
        if cells is None:
            self.settle()
            self.block_slot.fill_(-1)
            self.slot_block.fill_(-1)
            return
        self.settle()
        blocks = torch.unique(cells.to("cpu") // self.block)
        for layer in range(len(self.host)):
            slot = self.block_slot[layer][blocks]
            self.slot_block[layer][slot[slot >= 0]] = -1
            self.block_slot[layer][blocks] = -1

    # ---- resolution ------------------------------------------------------------
    def plan_layers(self, need: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Residency of every layer for a step that reads the pool blocks `need` (sorted, distinct).

        The same blocks are read in every layer; only what each layer's cache
        holds differs. Per layer: (slot of each needed block after the step's
        admissions, -1 where the block stays on the host; the admitted blocks;
        their slots). Bookkeeping only: copying is the caller's.

        The step is one tick of the clock for every layer, so layers whose maps
        are equal before it decide alike: where a streamed engine's steps keep
        all layers in lockstep (every step reads the same blocks in each), layer
        0 is resolved once and the others take its result (the same maps, plans
        and figures as resolving each), instead of 32 resolutions in torch CPU
        ops a step. A layer that differs (a read or an invalidation of its own)
        is resolved by itself.
        """
        self.clock += 1
        same = ((self.block_slot == self.block_slot[0]).all(1) & (self.slot_block == self.slot_block[0]).all(1)
                & (self.last_use == self.last_use[0]).all(1))  # each layer against layer 0, before the step
        before = asdict(self.stats)
        first = self._plan_layer(0, need)
        lock = same.nonzero().squeeze(1)[1:]
        if lock.numel():  # they take layer 0's maps, and count its figures as their own
            for maps in (self.block_slot, self.slot_block, self.last_use):
                maps[lock] = maps[0].clone()
            for key, value in asdict(self.stats).items():
                setattr(self.stats, key, value + lock.numel() * (value - before[key]))
        return [first if bool(same[layer]) else self._plan_layer(layer, need) for layer in range(len(self.host))]

    def _plan_layer(self, layer: int, need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer's part of `plan_layers`, at the step's clock."""
        admit, slots = self._resolve(layer, need)
        self._admit(layer, admit, slots)
        return self.block_slot[layer][need].clone(), admit, slots

    def _resolve(self, layer: int, need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of the blocks `need` (sorted, distinct) to admit, and into which slots.

        Hits are recorded and evicted blocks leave the maps; the admitted ones
        enter them with `_admit` (the caller's, beside its copy). The caller ticks the clock.
        """
        slots = self.block_slot[layer][need]
        hit = slots >= 0
        n_hit = int(hit.sum())
        self.stats.lookups += need.numel()
        self.stats.hits += n_hit
        self.last_use[layer][slots[hit]] = self.clock
        misses = need[~hit]
        if misses.numel() == 0:
            return misses, misses
        self.stats.misses += misses.numel()
        free = (self.slot_block[layer] < 0).nonzero().squeeze(1)
        if misses.numel() <= free.numel():
            return misses, free[: misses.numel()]
        occupied = (self.slot_block[layer] >= 0).nonzero().squeeze(1)
        resident_blocks = self.slot_block[layer][occupied]
        cand = torch.cat([resident_blocks, misses])
        n_res = occupied.numel()
        index, lane = self._lane_info(cand)
        needed = torch.cat([self.last_use[layer][occupied] == self.clock,
                            torch.ones(misses.numel(), dtype=torch.bool)])
        self._update_spans(lane[needed], index[needed])
        span = torch.where(lane >= 0, self.span[lane.clamp(min=0)], 0)
        usage = BlockUsage(
            block=cand,
            last_use=torch.cat([self.last_use[layer][occupied],
                                torch.full((misses.numel(),), self.clock, dtype=torch.int64)]),
            needed=needed,
            resident=torch.cat([torch.ones(n_res, dtype=torch.bool),
                                torch.zeros(misses.numel(), dtype=torch.bool)]),
            index=index,
            span=span,
        )
        keep = choose_resident(usage, self.slots, self.residency)
        evict = occupied[~keep[:n_res]]
        admit = misses[keep[n_res:]]
        self.stats.overflow_blocks += int((~keep & needed).sum())
        self.block_slot[layer][self.slot_block[layer][evict]] = -1
        self.slot_block[layer][evict] = -1
        return admit, torch.cat([free, evict])[: admit.numel()]

    def _admit(self, layer: int, blocks: torch.Tensor, slots: torch.Tensor) -> None:
        """Enter `blocks` into the maps at `slots` (their copy is the caller's)."""
        m = blocks.numel()
        if m == 0:
            return
        self.block_slot[layer][blocks] = slots
        self.slot_block[layer][slots] = blocks
        self.last_use[layer][slots] = self.clock
        self.stats.blocks_copied += m
        self.stats.bytes_copied += m * self.block * self.fmt.cell_bytes()

    def _copy_in(self, layer: int, blocks: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy `blocks` host -> cache `slots` (runs of consecutive blocks), then admit them."""
        if blocks.numel() == 0:
            return
        b = self.block
        first = layer * self.slots
        runs = coalesce(blocks.numpy(), first + slots.numpy())
        self.copies.copy_now(layer, [(src * b, dst * b, n * b) for src, dst, n in runs])
        self._admit(layer, blocks, slots)

    # ---- lane information for the policy ------------------------------------------
    def _lane_info(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index of each block inside its lane or -1, its lane or -1) from the tables."""
        pool = self.pool
        owner, entry = self._chunk_maps()
        first_cell = blocks * self.block
        chunk = first_cell // pool.chunk_size
        lane = owner[chunk]
        pos = entry[chunk] * pool.chunk_size + first_cell % pool.chunk_size
        index = torch.where(lane >= 0, pos // self.block, -1)
        return index, lane

    def _chunk_maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per pool chunk: the owning lane and its table entry (-1: free or trash).

        Rebuilt only when the chunk tables changed since the last call.
        """
        pool = self.pool
        key = self._maps_key
        reserved = tuple(pool.reserved)
        if key is not None and key[1] == reserved and torch.equal(key[0], pool.tables):
            return self._maps
        tables = pool.tables
        width = tables.shape[1]
        owned = torch.arange(width)[None, :] < torch.tensor(reserved)[:, None]
        n_chunks = pool.num_chunks + 1
        owner = torch.full((n_chunks,), -1, dtype=torch.int64)
        entry = torch.full((n_chunks,), -1, dtype=torch.int64)
        owner[tables[owned]] = torch.arange(pool.num_lanes)[:, None].expand_as(tables)[owned]
        entry[tables[owned]] = torch.arange(width)[None, :].expand_as(tables)[owned]
        self._maps_key = (tables.clone(), reserved)
        self._maps = (owner, entry)
        return self._maps

    def _update_spans(self, lane: torch.Tensor, index: torch.Tensor) -> None:
        """A read covers its lanes' positions [0, end): their spans are known exactly now."""
        ok = lane >= 0
        if bool(ok.any()):
            s, i = lane[ok], index[ok]
            self.span[s.unique()] = 0
            self.span.scatter_reduce_(0, s, i + 1, reduce="amax")


class StreamedPool(KvPool):
    """A KvPool whose storage is the host store and whose cell I/O streams to `device`.

    The chunk tables and the cell indices attention builds stay on `device`;
    only the storage lives on the host (pinned when `device` is CUDA). Raw
    cell I/O (parking, session files) reads and writes the host store
    directly, so it lands the writes still on their way there first, and an
    import drops the cached blocks it overwrote.
    """

    in_place = False

    def __init__(
        self,
        fmt: KvFormat,
        layers: int | Sequence[int],
        num_lanes: int,
        max_context: int,
        chunk_size: int,
        pool_tokens: int | None,
        device: torch.device | str,
        resident_cells: int,
        block_cells: int = DEFAULT_BLOCK_CELLS,
        residency: ResidencyConfig | None = None,
        overlap: bool | None = None,
        gather: bool | None = None,
        tables: ChunkTables | None = None,
    ) -> None:
        dev = torch.device(device)
        super().__init__(fmt, layers, num_lanes, max_context, chunk_size, pool_tokens, "cpu",
                         pin=dev.type == "cuda", tables=tables)
        self.device = dev
        self.tables_device = self.chunks.device_copy(dev)
        self.store = StreamStore(self, resident_cells, block_cells, dev, residency, overlap, gather)

    def write(self, layer: int, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.store.write(self.local(layer), cells, k, v)

    def read(self, layer: int, cells: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.read(self.local(layer), cells, dtype)

    def export_range(self, lane: int, start: int, end: int) -> list[Storage]:
        self.store.settle()
        return super().export_range(lane, start, end)

    def import_range(self, lane: int, start: int, runs: list[Storage]) -> None:
        self.store.settle()
        super().import_range(lane, start, runs)
        if runs:
            n = next(iter(runs[0].values())).shape[0]
            self.store.invalidate(self.cells_of_range(lane, start, start + n))

    def figures(self) -> dict[str, float | int | bool]:
        return self.store.figures()
