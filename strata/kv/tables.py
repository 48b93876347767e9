"""Chunk tables: which chunks of the pool each lane holds, shared by every stage of a split.

A lane maps its positions to cells through its row of the tables: position
p lives in cell `table[p // chunk_size] * chunk_size + p % chunk_size`
(`kv/step.py: cells_at`). Unreserved entries point at the trash chunk, so a
stray write never lands in another lane's cells.

Two layouts share this one mechanism:
- identity (no --kv-pool-tokens): every lane permanently holds the chunks
  for --max-context; `release` keeps them.
- shared (--kv-pool-tokens N): lanes reserve chunks as their tokens reach
  them and give them back when their conversation ends or is evicted.

A layer split keeps ONE `ChunkTables` for all its stages, so a conversation
has one table whatever number of devices hold its layers. Each device gets a
copy at a fixed address (`device_copy`: kernels and captured graphs read it),
updated in place whenever a row changes; a remote stage learns the changed
rows through a `watch` set and mirrors them with `set_row`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from strata.kv.formats import KvFormat, Storage
from strata.kv.step import cells_at


class ChunkTables:
    """The lanes' chunk tables, the free list and who owns which chunk."""

    def __init__(self, num_lanes: int, max_context: int, chunk_size: int, pool_tokens: int | None) -> None:
        if chunk_size <= 0:
            raise ValueError(f"--kv-chunk must be positive, got {chunk_size}")
        self.chunk_size = chunk_size
        self.num_lanes = num_lanes
        self.max_context = max_context
        self.pool_tokens = pool_tokens
        self.max_chunks = -(-max_context // chunk_size)  # table width
        self.shared = pool_tokens is not None
        if pool_tokens is not None:
            self.num_chunks = pool_tokens // chunk_size
            if self.num_chunks < 1:
                raise ValueError(
                    f"--kv-pool-tokens {pool_tokens} is smaller than one chunk ({chunk_size} cells)"
                )
        else:
            self.num_chunks = num_lanes * self.max_chunks
        self.trash = self.num_chunks
        self.tables = torch.full((num_lanes, self.max_chunks), self.trash, dtype=torch.int64)
        self.reserved = [0] * num_lanes  # chunks each lane holds (a prefix of its table)
        self.owner: list[int | None] = [None] * self.num_chunks
        self._free: list[int] = list(range(self.num_chunks - 1, -1, -1))  # pop() takes the lowest
        self._copies: dict[str, torch.Tensor] = {}
        self._watchers: list[set[int]] = []
        if not self.shared:
            for s in range(num_lanes):
                for c in range(self.max_chunks):
                    self._assign(s, c, s * self.max_chunks + c)
            self._free.clear()

    def geometry(self) -> tuple[int, int, int, int | None]:
        """What two mirrors of one table must agree on: lanes, context, chunk, pool tokens."""
        return (self.num_lanes, self.max_context, self.chunk_size, self.pool_tokens)

    # ---- copies and watchers ------------------------------------------------
    def device_copy(self, device: torch.device | str) -> torch.Tensor:
        """The copy of the tables on `device`, at a fixed address, kept in sync (one per device)."""
        key = str(torch.device(device))
        if key not in self._copies:
            self._copies[key] = self.tables.to(device)
        return self._copies[key]

    def watch(self) -> set[int]:
        """A set that every row change adds its lane to (the watcher empties it when it has sent
        the rows); it starts with every lane."""
        changed = set(range(self.num_lanes))
        self._watchers.append(changed)
        return changed

    def unwatch(self, changed: set[int]) -> None:
        self._watchers = [w for w in self._watchers if w is not changed]

    def set_row(self, lane: int, row: list[int], reserved: int) -> None:
        """Mirror another process's row of `lane` (a remote stage's copy of the main's tables)."""
        if len(row) != self.max_chunks or not 0 <= reserved <= self.max_chunks:
            raise ValueError(f"a table row of {len(row)} entries, {reserved} reserved, for tables "
                             f"{self.max_chunks} wide")
        if any(not 0 <= c <= self.trash for c in row):
            raise ValueError(f"a table row names chunks outside 0..{self.trash}")
        self.tables[lane] = torch.tensor(row, dtype=torch.int64)
        self.reserved[lane] = reserved
        self._sync(lane)

    # ---- figures -------------------------------------------------------
    @property
    def total_cells(self) -> int:
        return self.num_chunks * self.chunk_size

    @property
    def free_chunks(self) -> int:
        return len(self._free)

    @property
    def used_cells(self) -> int:
        """Cells of the chunks lanes have reserved: whole chunks, not the tokens written in them."""
        return (self.num_chunks - len(self._free)) * self.chunk_size

    @property
    def free_cells(self) -> int:
        return len(self._free) * self.chunk_size

    def chunks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.chunk_size)

    # ---- reservation -----------------------------------------------------
    def backed(self, lane: int) -> int:
        """Positions the lane can hold without reserving more."""
        return self.reserved[lane] * self.chunk_size

    def shortfall(self, lane: int, n_tokens: int) -> int:
        """Chunks still to be found before `lane` can hold `n_tokens`."""
        need = self.chunks_for(n_tokens) - self.reserved[lane]
        return max(0, need - len(self._free))

    def reserve(self, lane: int, n_tokens: int) -> bool:
        """Back positions [0, n_tokens) of `lane`; all or nothing."""
        if n_tokens > self.max_chunks * self.chunk_size:
            return False
        need = self.chunks_for(n_tokens) - self.reserved[lane]
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            self._assign(lane, self.reserved[lane], self._free.pop())
        self._sync(lane)
        return True

    def release(self, lane: int, keep_tokens: int = 0) -> int:
        """Give back the lane's chunks beyond those holding `keep_tokens`; returns chunks freed.

        In the identity layout chunks are never given back.
        """
        if not self.shared:
            return 0
        keep = self.chunks_for(keep_tokens)
        freed = 0
        while self.reserved[lane] > keep:
            idx = self.reserved[lane] - 1
            chunk = int(self.tables[lane, idx])
            self.owner[chunk] = None
            self._free.append(chunk)
            self.tables[lane, idx] = self.trash
            self.reserved[lane] = idx
            freed += 1
        if freed:
            self._sync(lane)
        return freed

    def swap(self, a: int, b: int) -> None:
        """Move conversations: lane a takes b's chunks and b takes a's (no K/V copy)."""
        if a == b:
            return
        self.tables[[a, b]] = self.tables[[b, a]]
        self.reserved[a], self.reserved[b] = self.reserved[b], self.reserved[a]
        for s in (a, b):
            for c in range(self.reserved[s]):
                self.owner[int(self.tables[s, c])] = s
        self._sync(a)
        self._sync(b)

    # ---- addressing -------------------------------------------------------
    def cells(self, lane: int, positions: torch.Tensor) -> torch.Tensor:
        """Cell indices (host, int64) of `positions` of `lane`; unreserved ones land in trash."""
        return cells_at(self.tables, self.chunk_size, torch.tensor(lane), positions)

    def cells_of_range(self, lane: int, start: int, end: int) -> torch.Tensor:
        return self.cells(lane, torch.arange(start, end, dtype=torch.int64))

    # ---- internals ----------------------------------------------------------
    def _assign(self, lane: int, index: int, chunk: int) -> None:
        self.tables[lane, index] = chunk
        self.owner[chunk] = lane
        self.reserved[lane] = max(self.reserved[lane], index + 1)

    def _sync(self, lane: int) -> None:
        for copy in self._copies.values():
            copy[lane].copy_(self.tables[lane])
        for changed in self._watchers:
            changed.add(lane)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call this)."""
        seen: dict[int, int] = {}
        for s in range(self.num_lanes):
            row = self.tables[s].tolist()
            for i, c in enumerate(row):
                if i < self.reserved[s]:
                    assert c != self.trash, f"lane {s} entry {i} reserved but points at trash"
                    assert c not in seen, f"chunk {c} owned by lanes {seen[c]} and {s}"
                    assert self.owner[c] == s, f"chunk {c} owner {self.owner[c]} != {s}"
                    seen[c] = s
                else:
                    assert c == self.trash, f"lane {s} entry {i} unreserved but points at {c}"
        assert len(seen) + len(self._free) == self.num_chunks, "chunks lost or duplicated"
        assert not (set(seen) & set(self._free)), "a free chunk is in a table"
        assert all(self.owner[c] is None for c in self._free), "a free chunk has an owner"
        assert self.used_cells == sum(self.reserved) * self.chunk_size
        for copy in self._copies.values():
            assert torch.equal(copy.cpu(), self.tables), "device tables out of sync"


class TablePool(ABC):
    """What the scheduler, parking and session files see of a pool: its tables (`chunks`),
    forwarded here, and its cells' raw I/O over every layer (in the subclasses: one device's
    `KvPool`, or a layer split's `parallel.SplitPool`)."""

    chunks: ChunkTables
    fmt: KvFormat
    device: torch.device

    @property
    @abstractmethod
    def num_layers(self) -> int: ...

    @abstractmethod
    def bytes_per_cell(self) -> int:
        """Bytes of one cell over all layers."""

    @abstractmethod
    def total_bytes(self) -> int: ...

    @abstractmethod
    def export_range(self, lane: int, start: int, end: int) -> list[Storage]:
        """The raw runs (format bytes, no dequantization) of positions [start, end) of a lane,
        one Storage per layer, on the CPU: what parking and session files keep."""

    @abstractmethod
    def import_range(self, lane: int, start: int, runs: list[Storage]) -> None:
        """Write per-layer raw runs (as `export_range` returns them) to the lane's positions from
        `start` on (as many as the runs hold). The positions must be reserved."""

    @abstractmethod
    def figures(self) -> dict | None:
        """Streaming figures; None for a pool that keeps everything in place."""

    @property
    def tables(self) -> torch.Tensor:
        return self.chunks.tables

    @property
    def reserved(self) -> list[int]:
        return self.chunks.reserved

    @property
    def chunk_size(self) -> int:
        return self.chunks.chunk_size

    @property
    def num_lanes(self) -> int:
        return self.chunks.num_lanes

    @property
    def max_chunks(self) -> int:
        return self.chunks.max_chunks

    @property
    def num_chunks(self) -> int:
        return self.chunks.num_chunks

    @property
    def trash(self) -> int:
        return self.chunks.trash

    @property
    def shared(self) -> bool:
        return self.chunks.shared

    @property
    def total_cells(self) -> int:
        return self.chunks.total_cells

    @property
    def free_chunks(self) -> int:
        return self.chunks.free_chunks

    @property
    def used_cells(self) -> int:
        return self.chunks.used_cells

    @property
    def free_cells(self) -> int:
        return self.chunks.free_cells

    def chunks_for(self, n_tokens: int) -> int:
        return self.chunks.chunks_for(n_tokens)

    def backed(self, lane: int) -> int:
        return self.chunks.backed(lane)

    def shortfall(self, lane: int, n_tokens: int) -> int:
        return self.chunks.shortfall(lane, n_tokens)

    def reserve(self, lane: int, n_tokens: int) -> bool:
        return self.chunks.reserve(lane, n_tokens)

    def release(self, lane: int, keep_tokens: int = 0) -> int:
        return self.chunks.release(lane, keep_tokens)

    def swap(self, a: int, b: int) -> None:
        self.chunks.swap(a, b)

    def cells(self, lane: int, positions: torch.Tensor) -> torch.Tensor:
        return self.chunks.cells(lane, positions)

    def cells_of_range(self, lane: int, start: int, end: int) -> torch.Tensor:
        return self.chunks.cells_of_range(lane, start, end)

    def check_invariants(self) -> None:
        self.chunks.check_invariants()
