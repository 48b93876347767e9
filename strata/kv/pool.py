"""The shared KV pool: per-layer storage, chunks, and one chunk table per lane.

Every attention layer's K/V storage is allocated once, as `num_chunks + 1`
chunks of `chunk_size` cells (the last chunk is the trash chunk, owned by no
lane). A lane maps its positions to cells through its chunk table: position
p lives in cell `table[p // chunk_size] * chunk_size + p % chunk_size`
(`kv/step.py: cells_at`). Unreserved table entries point at the trash chunk,
so a stray write never lands in another lane's cells.

Two layouts share this one mechanism:
- identity (no --kv-pool-tokens): every lane permanently holds the chunks
  for --max-context; `release` keeps them.
- shared (--kv-pool-tokens N): lanes reserve chunks as their tokens reach
  them and give them back when their conversation ends or is evicted.

Moving a conversation between lanes swaps their table rows: no K/V is
copied, whatever its length. The device copy of the tables lives at a fixed
address (kernels and captured graphs read it); the host copy is the
scheduler's. A pool may hold a contiguous range of the model's layers (one
stage of a layer split): layer indices stay the model's, `storage(layer)`
finds the range's own arrays. Streamed K/V (`--kv-resident`) is a subclass,
`kv/stream.py: StreamedPool`.
"""

from __future__ import annotations

import torch

from strata.kv.formats import KvFormat, Storage
from strata.kv.step import cells_at


class KvPool:
    """Storage of every layer in the pool's range, chunks, and the lanes' chunk tables."""

    in_place = True  # attention may read `layers` where they are (a streamed pool: no)

    def __init__(
        self,
        fmt: KvFormat,
        layers: int | range,
        num_lanes: int,
        max_context: int,
        chunk_size: int,
        pool_tokens: int | None,
        device: torch.device | str = "cpu",
        pin: bool = False,
    ) -> None:
        if chunk_size <= 0:
            raise ValueError(f"--kv-chunk must be positive, got {chunk_size}")
        self.fmt = fmt
        self.chunk_size = chunk_size
        self.num_lanes = num_lanes
        self.max_chunks = -(-max_context // chunk_size)  # table width
        self.shared = pool_tokens is not None
        if self.shared:
            assert pool_tokens is not None
            self.num_chunks = pool_tokens // chunk_size
            if self.num_chunks < 1:
                raise ValueError(
                    f"--kv-pool-tokens {pool_tokens} is smaller than one chunk ({chunk_size} cells)"
                )
        else:
            self.num_chunks = num_lanes * self.max_chunks
        self.trash = self.num_chunks
        self.device = torch.device(device)
        num_cells = (self.num_chunks + 1) * chunk_size
        self.layer_range = range(layers) if isinstance(layers, int) else layers
        self.layers: list[Storage] = [fmt.allocate(num_cells, self.device, pin) for _ in self.layer_range]
        self.tables = torch.full((num_lanes, self.max_chunks), self.trash, dtype=torch.int64)
        self.tables_device = self.tables.to(self.device)  # fixed address: updated in place
        self.reserved = [0] * num_lanes  # chunks each lane holds (a prefix of its table)
        self.owner: list[int | None] = [None] * self.num_chunks
        self._free: list[int] = list(range(self.num_chunks - 1, -1, -1))  # pop() takes the lowest
        if not self.shared:
            for s in range(num_lanes):
                for c in range(self.max_chunks):
                    self._assign(s, c, s * self.max_chunks + c)
            self._free.clear()
            self._sync()

    # ---- figures -------------------------------------------------------
    @property
    def total_cells(self) -> int:
        return self.num_chunks * self.chunk_size

    @property
    def free_chunks(self) -> int:
        return len(self._free)

    @property
    def used_cells(self) -> int:
        return (self.num_chunks - len(self._free)) * self.chunk_size

    @property
    def free_cells(self) -> int:
        return len(self._free) * self.chunk_size

    def bytes_per_cell(self) -> int:
        """Bytes of one cell over all layers."""
        return self.fmt.cell_bytes() * len(self.layers)

    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.layers for t in st.values())

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

    # ---- cell I/O -------------------------------------------------------------
    def storage(self, layer: int) -> Storage:
        """The arrays of model layer `layer` (which must be in `layer_range`)."""
        return self.layers[layer - self.layer_range.start]

    def write(self, layer: int, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] of one layer at distinct cell indices `cells` [T]."""
        self.fmt.write(self.storage(layer), cells, k, v)

    def read(self, layer: int, cells: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized k, v [N, Hkv, D] of one layer at cell indices `cells` [N]."""
        return self.fmt.read(self.storage(layer), cells, dtype)

    def export_range(self, lane: int, start: int, end: int) -> list[Storage]:
        """The raw runs (format bytes, no dequantization) of positions [start, end) of a lane,
        one Storage per layer of the pool, on the CPU: what parking and session files keep."""
        idx = self.cells_of_range(lane, start, end).to(self.device)
        return [{name: t[idx].cpu() for name, t in st.items()} for st in self.layers]

    def import_range(self, lane: int, start: int, runs: list[Storage]) -> None:
        """Write per-layer raw runs (as `export_range` returns them) to the lane's positions from
        `start` on (as many as the runs hold). The positions must be reserved."""
        if len(runs) != len(self.layers):
            raise ValueError(f"{len(runs)} layers of runs for a pool of {len(self.layers)}")
        if not runs:
            return
        n = next(iter(runs[0].values())).shape[0]
        idx = self.cells_of_range(lane, start, start + n).to(self.device)
        for st, layer_runs in zip(self.layers, runs):
            for name, t in st.items():
                t.index_copy_(0, idx, torch.as_tensor(layer_runs[name]).to(t.device))

    def figures(self) -> dict[str, int] | None:
        """Streaming figures (`StreamedPool`); None for a pool that keeps everything in place."""
        return None

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

    def _sync(self, lane: int | None = None) -> None:
        if lane is None:
            self.tables_device.copy_(self.tables)
        else:
            self.tables_device[lane].copy_(self.tables[lane])

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
        assert torch.equal(self.tables_device.cpu(), self.tables), "device tables out of sync"
