"""The shared KV pool: per-layer storage over the lanes' chunk tables.

Every attention layer's K/V storage is allocated once, as `num_chunks + 1`
chunks of `chunk_size` cells (the last chunk is the trash chunk, owned by no
lane). Which chunks a lane holds is its row of the chunk tables
(`kv/tables.py: ChunkTables`, forwarded through `TablePool`): reserving,
releasing and moving a conversation between lanes (swapping table rows, no
K/V copy) happen there.

The device copy of the tables lives at a fixed address (kernels and captured
graphs read it); the host copy is the scheduler's. A pool holds only the
model layers that attend over it (`DecoderModel.pool_layers()`: a hybrid
model's recurrent and sliding-window layers keep fixed-size state in
`kv/state.py` instead), any increasing sequence of them; one stage of a layer
split holds a contiguous range and shares the split's one `ChunkTables`.
Layer indices stay the model's: `storage(layer)` finds that layer's arrays,
`local(layer)` its index among the pool's. Streamed K/V (`--kv-resident`) is
a subclass, `kv/stream.py: StreamedPool`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from strata.kv.formats import KvFormat, Storage
from strata.kv.tables import ChunkTables, TablePool


class KvPool(TablePool):
    """Storage of each of the pool's model layers on one device, over the lanes' chunk tables."""

    in_place = True  # attention may read `layers` where they are (a streamed pool: no)

    def __init__(
        self,
        fmt: KvFormat,
        layers: int | Sequence[int],
        num_lanes: int,
        max_context: int,
        chunk_size: int,
        pool_tokens: int | None,
        device: torch.device | str = "cpu",
        pin: bool = False,
        tables: ChunkTables | None = None,
    ) -> None:
        """`layers`: the model layers held (an int n: layers 0..n-1), increasing; `tables`: the
        split's shared tables (they must have this geometry); None: the pool's own."""
        self.chunks = tables or ChunkTables(num_lanes, max_context, chunk_size, pool_tokens)
        if self.chunks.geometry() != (num_lanes, max_context, chunk_size, pool_tokens):
            raise ValueError(f"shared chunk tables of geometry {self.chunks.geometry()} for a pool of "
                             f"{(num_lanes, max_context, chunk_size, pool_tokens)}")
        self.fmt = fmt
        self.device = torch.device(device)
        num_cells = (self.num_chunks + 1) * chunk_size
        self.layer_ids: tuple[int, ...] = tuple(range(layers)) if isinstance(layers, int) else tuple(layers)
        if not self.layer_ids or any(b <= a for a, b in zip(self.layer_ids, self.layer_ids[1:])):
            raise ValueError(f"a pool's layers must be increasing and not empty, not {self.layer_ids}")
        self._local = {layer: i for i, layer in enumerate(self.layer_ids)}
        # the model layers from the pool's first to its last: a split's stage holds exactly these
        self.layer_range = range(self.layer_ids[0], self.layer_ids[-1] + 1)
        self.layers: list[Storage] = [fmt.allocate(num_cells, self.device, pin) for _ in self.layer_ids]
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
    def local(self, layer: int) -> int:
        """The pool's own index of model layer `layer` (a KeyError: a layer it does not hold)."""
        return self._local[layer]

    def storage(self, layer: int) -> Storage:
        """The arrays of model layer `layer` (which must be one of `layer_ids`)."""
        return self.layers[self._local[layer]]

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

