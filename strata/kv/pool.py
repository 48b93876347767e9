"""The shared KV pool: per-layer storage, chunks, and one chunk table per session.

Every attention layer's K/V storage is allocated once, as `num_chunks + 1`
chunks of `chunk_size` cells (the last chunk is the trash chunk, owned by no
session). A session (a lane) maps its positions to cells through its chunk
table: position p lives in cell `table[p // chunk_size] * chunk_size +
p % chunk_size`. Unreserved table entries point at the trash chunk, so a
stray write never lands in another session's cells.

Two layouts share this one mechanism:
- identity (no --kv-pool-tokens): every session permanently holds the chunks
  for --max-context; `release` keeps them.
- shared (--kv-pool-tokens N): sessions reserve chunks as their tokens reach
  them and give them back when their conversation ends or is evicted.

Moving a conversation between sessions swaps their table rows: no K/V is
copied, whatever its length. The device copy of the tables lives at a fixed
address (kernels and captured graphs read it); the host copy is the
scheduler's.
"""

from __future__ import annotations

import torch

from strata.kv.formats import KvFormat, Storage


class KvPool:
    def __init__(
        self,
        fmt: KvFormat,
        num_layers: int,
        num_sessions: int,
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
        self.num_sessions = num_sessions
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
            self.num_chunks = num_sessions * self.max_chunks
        self.trash = self.num_chunks
        self.device = torch.device(device)
        num_cells = (self.num_chunks + 1) * chunk_size
        self.layers: list[Storage] = [fmt.allocate(num_cells, self.device, pin) for _ in range(num_layers)]
        self.store = None  # a KV streaming store (kv/stream.py) when --kv-resident is set
        self.tables = torch.full((num_sessions, self.max_chunks), self.trash, dtype=torch.int64)
        self.tables_device = self.tables.to(self.device)  # fixed address: updated in place
        self.reserved = [0] * num_sessions  # chunks each session holds (a prefix of its table)
        self.owner: list[int | None] = [None] * self.num_chunks
        self._free: list[int] = list(range(self.num_chunks - 1, -1, -1))  # pop() takes the lowest
        if not self.shared:
            for s in range(num_sessions):
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
    def capacity(self, session: int) -> int:
        """Positions the session can hold without reserving more."""
        return self.reserved[session] * self.chunk_size

    def shortfall(self, session: int, n_tokens: int) -> int:
        """Chunks still to be found before `session` can hold `n_tokens`."""
        need = self.chunks_for(n_tokens) - self.reserved[session]
        return max(0, need - len(self._free))

    def reserve(self, session: int, n_tokens: int) -> bool:
        """Back positions [0, n_tokens) of `session`; all or nothing."""
        if n_tokens > self.max_chunks * self.chunk_size:
            return False
        need = self.chunks_for(n_tokens) - self.reserved[session]
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            self._assign(session, self.reserved[session], self._free.pop())
        self._sync(session)
        return True

    def release(self, session: int, keep_tokens: int = 0) -> int:
        """Give back the session's chunks beyond those holding `keep_tokens`; returns chunks freed.

        In the identity layout chunks are never given back.
        """
        if not self.shared:
            return 0
        keep = self.chunks_for(keep_tokens)
        freed = 0
        while self.reserved[session] > keep:
            idx = self.reserved[session] - 1
            chunk = int(self.tables[session, idx])
            self.owner[chunk] = None
            self._free.append(chunk)
            self.tables[session, idx] = self.trash
            self.reserved[session] = idx
            freed += 1
        if freed:
            self._sync(session)
        return freed

    def swap(self, a: int, b: int) -> None:
        """Move conversations: session a takes b's chunks and b takes a's (no K/V copy)."""
        if a == b:
            return
        self.tables[[a, b]] = self.tables[[b, a]]
        self.reserved[a], self.reserved[b] = self.reserved[b], self.reserved[a]
        for s in (a, b):
            for c in range(self.reserved[s]):
                self.owner[int(self.tables[s, c])] = s
        self._sync(a)
        self._sync(b)

    # ---- cell I/O (streaming replaces these through `store`) ----------------
    def write(self, layer: int, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] of one layer at distinct cell indices `cells` [T]."""
        if self.store is not None:
            self.store.write(layer, cells, k, v)
        else:
            self.fmt.write(self.layers[layer], cells, k, v)

    def read(self, layer: int, cells: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized k, v [N, Hkv, D] of one layer at cell indices `cells` [N]."""
        if self.store is not None:
            return self.store.read(layer, cells, dtype)
        return self.fmt.read(self.layers[layer], cells, dtype)

    def export_cells(self, layer: int, cells: torch.Tensor) -> Storage:
        """The raw runs (format bytes, no dequantization) of `cells` of one layer, on the CPU."""
        st = self.layers[layer]
        idx = cells.to(self.device)
        return {name: t[idx].cpu() for name, t in st.items()}

    def import_cells(self, layer: int, cells: torch.Tensor, runs: Storage) -> None:
        """Write raw runs (as `export_cells` returns them) into `cells` of one layer."""
        st = self.layers[layer]
        idx = cells.to(self.device)
        for name, t in st.items():
            t.index_copy_(0, idx, runs[name].to(t.device))
        if self.store is not None and hasattr(self.store, "invalidate"):
            self.store.invalidate(cells)

    # ---- addressing -------------------------------------------------------
    def cells(self, session: int, positions: torch.Tensor) -> torch.Tensor:
        """Cell indices (host, int64) of `positions` of `session`; unreserved ones land in trash."""
        chunk = positions // self.chunk_size
        table = self.tables[session]
        base = table[chunk.clamp(max=self.max_chunks - 1)]
        return base * self.chunk_size + positions % self.chunk_size

    def cells_of_range(self, session: int, start: int, end: int) -> torch.Tensor:
        return self.cells(session, torch.arange(start, end, dtype=torch.int64))

    # ---- internals ----------------------------------------------------------
    def _assign(self, session: int, index: int, chunk: int) -> None:
        self.tables[session, index] = chunk
        self.owner[chunk] = session
        self.reserved[session] = max(self.reserved[session], index + 1)

    def _sync(self, session: int | None = None) -> None:
        if session is None:
            self.tables_device.copy_(self.tables)
        else:
            self.tables_device[session].copy_(self.tables[session])

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call this)."""
        seen: dict[int, int] = {}
        for s in range(self.num_sessions):
            row = self.tables[s].tolist()
            for i, c in enumerate(row):
                if i < self.reserved[s]:
                    assert c != self.trash, f"session {s} entry {i} reserved but points at trash"
                    assert c not in seen, f"chunk {c} owned by sessions {seen[c]} and {s}"
                    assert self.owner[c] == s, f"chunk {c} owner {self.owner[c]} != {s}"
                    seen[c] = s
                else:
                    assert c == self.trash, f"session {s} entry {i} unreserved but points at {c}"
        assert len(seen) + len(self._free) == self.num_chunks, "chunks lost or duplicated"
        assert not (set(seen) & set(self._free)), "a free chunk is in a table"
        assert all(self.owner[c] is None for c in self._free), "a free chunk has an owner"
        assert self.used_cells == sum(self.reserved) * self.chunk_size
        assert torch.equal(self.tables_device.cpu(), self.tables), "device tables out of sync"
