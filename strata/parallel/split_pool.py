"""The pool of a layer split: one set of chunk tables over every stage's part of the K/V.

The scheduler, parking and session files see one pool: reserving, moving and
releasing go to the split's one `ChunkTables` (so a conversation keeps one
table whatever devices hold its layers), and a range of a lane's cells is
exported or imported as the raw runs of every layer, stage by stage, in
layer order (a remote stage's part travels over its link). Attention never
sees this object: each stage's backend reads its own part.
"""

from __future__ import annotations

from typing import Protocol

import torch

from strata.kv.formats import KvFormat, Storage
from strata.kv.tables import ChunkTables, TablePool

# streaming figures that count something in every stage (the rest, per-layer sizes, are equal)
_ADDED = {"lookups", "hits", "misses", "blocks_copied", "bytes_copied", "overflow_blocks",
          "overflow_bytes", "host_bytes", "pinned_bytes", "cache_bytes"}


class StagePart(Protocol):
    """One stage's K/V: a local `KvPool` (or `StreamedPool`), or a remote stage's (`remote.py`)."""

    layer_range: range

    def bytes_per_cell(self) -> int: ...

    def total_bytes(self) -> int: ...

    def export_range(self, lane: int, start: int, end: int) -> list[Storage]: ...

    def import_range(self, lane: int, start: int, runs: list[Storage]) -> None: ...

    def figures(self) -> dict | None: ...


class SplitPool(TablePool):
    def __init__(self, chunks: ChunkTables, fmt: KvFormat, parts: list[StagePart],
                 device: torch.device, kept: RemoteParts | None = None) -> None:
        """`kept`: remote stages keep their part of parked conversations (`--prompt-cache`)."""
        expect = 0
        for part in parts:
            if part.layer_range.start != expect:
                raise ValueError(f"stage parts are not contiguous at layer {expect}")
            expect = part.layer_range.stop
        self.chunks = chunks
        self.fmt = fmt
        self.parts = parts
        self.device = device  # the main device (the sampled logits')
        self.layer_range = range(0, expect)
        self.kept = kept

    @property
    def num_layers(self) -> int:
        return len(self.layer_range)

    def bytes_per_cell(self) -> int:
        return sum(p.bytes_per_cell() for p in self.parts)

    def total_bytes(self) -> int:
        return sum(p.total_bytes() for p in self.parts)

    def export_range(self, lane: int, start: int, end: int) -> list[Storage]:
        return [st for p in self.parts for st in p.export_range(lane, start, end)]

    def import_range(self, lane: int, start: int, runs: list[Storage]) -> None:
        if len(runs) != self.num_layers:
            raise ValueError(f"{len(runs)} layers of runs for a pool of {self.num_layers}")
        for p in self.parts:
            r = p.layer_range
            p.import_range(lane, start, runs[r.start : r.stop])

    def figures(self) -> dict | None:
        """Streaming figures of the stages that stream (their counts added up), or None."""
        found = [f for f in (p.figures() for p in self.parts) if f is not None]
        if not found:
            return None
        total: dict = {}
        for f in found:
            for k, v in f.items():
                if k in _ADDED:
                    total[k] = total.get(k, 0) + v
                else:
                    total.setdefault(k, v)
        if "lookups" in total and "hits" in total:
            total["hit_rate"] = total["hits"] / total["lookups"] if total["lookups"] else 1.0
        return total


class KeptPart(Protocol):
    """A remote stage that keeps conversation parts under ids (`remote.py: RemoteStage`)."""

    def keep(self, part: str, lane: int, n: int, keep: list[str]) -> None: ...

    def restore(self, part: str, lane: int, n: int, keep: list[str]) -> bool: ...

    def fetch(self, part: str, n: int) -> list[Storage]: ...


class RemoteParts:
    """Parking with `--prompt-cache` over a remote stage: the main's conversation cache holds the
    runs of its own layers, and each worker keeps its layers' part under the id parking hands it
    (nothing crosses the link but the ids)."""

    def __init__(self, local: list[StagePart], remote: list[KeptPart]) -> None:
        self.local = local
        self.remote = remote

    def local_bytes_per_cell(self) -> int:
        return sum(p.bytes_per_cell() for p in self.local)

    def export_local(self, lane: int, start: int, end: int) -> list[Storage]:
        return [st for p in self.local for st in p.export_range(lane, start, end)]

    def import_local(self, lane: int, start: int, runs: list[Storage]) -> None:
        for p in self.local:
            r = p.layer_range
            p.import_range(lane, start, runs[r.start : r.stop])

    def keep(self, part: str, lane: int, n: int, keep: list[str]) -> None:
        for r in self.remote:
            r.keep(part, lane, n, keep)

    def restore(self, part: str, lane: int, n: int, keep: list[str]) -> bool:
        return all([r.restore(part, lane, n, keep) for r in self.remote])  # every stage restores

    def fetch(self, part: str, n: int) -> list[Storage]:
        return [st for r in self.remote for st in r.fetch(part, n)]
