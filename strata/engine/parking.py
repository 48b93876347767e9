"""Between lanes and the conversation cache: park a lane's conversation, restore one.

The cache (`conversation_cache.py`) only keeps tensors and decides capacity;
this module knows the pool: it captures a lane's cells as the format's raw
runs (no dequantization, so a restore is bit-exact) and writes them back into
a lane's chunks. A recurrent model's conversation also takes its saved states
(`checkpoints.py`); it comes back only at one of their positions, since its
state cannot be cut to any other prefix.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import torch

from strata.engine.checkpoints import Checkpoints
from strata.engine.conversation_cache import ConversationCache, ParkedEntry
from strata.engine.scheduler import Lane
from strata.errors import PartMissing
from strata.kv.formats import Storage
from strata.kv.tables import TablePool


class KeptRemotely(Protocol):
    """Remote stages that keep their part of parked conversations under ids
    (`parallel/split_pool.py`); the cache then holds only this process's layers."""

    def local_bytes_per_cell(self) -> int: ...

    def export_local(self, lane: int, start: int, end: int) -> list[Storage]: ...

    def import_local(self, lane: int, start: int, runs: list[Storage]) -> None: ...

    def keep(self, part: str, lane: int, n: int, keep: list[str]) -> None: ...

    def restore(self, part: str, lane: int, n: int, keep: list[str]) -> bool: ...

    def fetch(self, part: str, n: int) -> list[Storage]: ...


def part_id(tokens: torch.Tensor) -> str:
    """The id a remote stage keeps a conversation's part under: a hash of its tokens."""
    return hashlib.sha256(tokens.to(torch.int32).numpy().tobytes()).hexdigest()[:32]


class Parking:
    def __init__(self, pool: TablePool, cache: ConversationCache, remote: KeptRemotely | None = None,
                 checkpoints: Checkpoints | None = None) -> None:
        """checkpoints: a recurrent model's (the lanes' states are parked with their K/V)."""
        if remote is not None and checkpoints is not None:
            raise ValueError("remote stages do not keep recurrent state")
        self.pool = pool
        self.cache = cache
        self.remote = remote
        self.checkpoints = checkpoints
        self.bytes_per_token = pool.bytes_per_cell() if remote is None else remote.local_bytes_per_cell()

    def capture(self, lane: Lane, start: int, end: int) -> list[Storage]:
        """Raw runs of positions [start, end) of a lane, per layer kept here, on the CPU."""
        if self.remote is not None:
            return self.remote.export_local(lane.index, start, end)
        return self.pool.export_range(lane.index, start, end)

    def park(self, lane: Lane) -> bool:
        """Park the lane's conversation (only what the reuse image lacks is captured); remote
        stages keep their part of it under its id."""
        if not lane.tokens:
            return False
        tokens = list(lane.tokens)
        states = self.checkpoints.snapshot(lane.index, len(tokens)) if self.checkpoints is not None else []
        eid = self.cache.park(tokens, lambda s, e: self.capture(lane, s, e), self.bytes_per_token,
                              states=states)
        if eid is not None and self.remote is not None:
            self.remote.keep(part_id(self.cache.entry(eid).tokens), lane.index, len(tokens), self.live_parts())
        return eid is not None

    def live_parts(self) -> list[str]:
        """The ids of every conversation the cache holds (entries and the reuse image): what remote
        stages keep; they drop the rest."""
        ids = [part_id(self.cache.entry(e).tokens) for e in self.cache.entry_ids()]
        image = self.cache.reuse_image
        if image is not None:
            ids.append(part_id(image.tokens))
        return ids

    def entry_runs(self, eid: int) -> list[Storage]:
        """Every layer's raw runs of a parked conversation (a remote stage's fetched over its link)."""
        entry = self.cache.entry(eid)
        runs = entry.kv.layers()
        if self.remote is not None:
            runs = runs + self.remote.fetch(part_id(entry.tokens), entry.kv.n_cells)
        return runs

    def find(self, prompt: list[int]) -> tuple[int, int] | None:
        """(entry id, usable shared length) of the parked conversation best matching `prompt`."""
        hit = self.cache.lookup(prompt)
        if hit is None:
            return None
        eid, n = hit
        n = min(n, len(prompt) - 1)
        if self.checkpoints is not None:  # only where a saved state is
            n = max((c.position for c in self.cache.entry(eid).states if c.position <= n), default=0)
            if n == 0:
                return None
        return eid, n

    def restore(self, lane: Lane, eid: int, n: int) -> None:
        """Write the first `n` parked positions into the lane's (already reserved) chunks.

        A request that extends the whole parked conversation takes the entry
        (its bytes stay as the reuse image, for an incremental re-park); one
        that shares only a prefix borrows it, so it stays parked for its owner.
        """
        entry = self.cache.entry(eid)
        if n >= len(entry.tokens) - 1:
            entry = self.cache.take(eid)
        else:
            entry = self.cache.borrow(eid)
        if self.remote is None:
            write_entry(self.pool, lane.index, entry, n)
            if self.checkpoints is not None:
                self.checkpoints.install(lane.index, entry.states, n)
        else:
            self.remote.import_local(lane.index, 0, [{k: t[:n] for k, t in runs.items()}
                                                     for runs in entry.kv.layers()])
            if not self.remote.restore(part_id(entry.tokens), lane.index, n, self.live_parts()):
                raise PartMissing("a remote stage no longer holds its part of the conversation")
        lane.tokens = entry.tokens[:n].tolist()


def write_entry(pool: TablePool, lane: int, entry: ParkedEntry, n: int) -> None:
    """Copy the first n cells of a parked entry into `lane`'s reserved cells."""
    pool.import_range(lane, 0, [{k: t[:n] for k, t in runs.items()} for runs in entry.kv.layers()])
