"""The shared KV pool: per-layer storage over the lanes' chunk tables.

Every attention layer's K/V storage is allocated once, as `num_chunks + 1`
chunks of `chunk_size` cells (the last chunk is the trash chunk, owned by no
lane). Which chunks a lane holds is its row of the chunk tables
(`kv/tables.py: ChunkTables`, forwarded through `TablePool`): reserving,
releasing and moving a conversation between lanes (swapping table rows, no
K/V copy) happen there.

The device copy of the tables lives at a fixed address (kernels and captured
graphs read it); the host copy is the scheduler's. A pool may hold a
contiguous range of the model's layers (one stage of a layer split, sharing
the split's one `ChunkTables`): layer indices stay the model's,
`storage(layer)` finds the range's own arrays. Streamed K/V (`--kv-resident`)
is a subclass, `kv/stream.py: StreamedPool`.
"""

from __future__ import annotations

import torch

from strata.kv.formats import KvFormat, Storage
from strata.kv.tables import ChunkTables, TablePool


class KvPool(TablePool):
    """Storage of every layer in the pool's range on one device, over the lanes' chunk tables."""

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
        tables: ChunkTables | None = None,
    ) -> None:
        """`tables`: the split's shared tables (they must have this geometry); None: the pool's own."""
        self.chunks = tables or ChunkTables(num_lanes, max_context, chunk_size, pool_tokens)
        if self.chunks.geometry() != (num_lanes, max_context, chunk_size, pool_tokens):
            raise ValueError(f"shared chunk tables of geometry {self.chunks.geometry()} for a pool of "
                             f"{(num_lanes, max_context, chunk_size, pool_tokens)}")
        self.fmt = fmt
        self.device = torch.device(device)
        num_cells = (self.num_chunks + 1) * chunk_size
        self.layer_range = range(layers) if isinstance(layers, int) else layers
        self.layers: list[Storage] = [fmt.allocate(num_cells, self.device, pin) for _ in self.layer_range]
        self.tables_device = self.chunks.device_copy(self.device)  # fixed address: updated in place

    # ---- figures -------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bytes_per_cell(self) -> int:
        """Bytes of one cell over all layers."""
        return self.fmt.cell_bytes() * len(self.layers)

    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.layers for t in st.values())

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

