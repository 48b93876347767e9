"""Between lanes and the conversation cache: park a lane's conversation, restore one.

The cache (`conversation_cache.py`) only keeps tensors and decides capacity;
this module knows the pool: it captures a lane's cells as the format's raw
runs (no dequantization, so a restore is bit-exact) and writes them back into
a lane's chunks.
"""

from __future__ import annotations

from strata.engine.conversation_cache import ConversationCache, ParkedEntry
from strata.engine.scheduler import Lane
from strata.kv.formats import Storage
from strata.kv.tables import TablePool


class Parking:
    def __init__(self, pool: TablePool, cache: ConversationCache) -> None:
        self.pool = pool
        self.cache = cache
        self.bytes_per_token = pool.bytes_per_cell()

    def capture(self, lane: Lane, start: int, end: int) -> list[Storage]:
        """Raw runs of positions [start, end) of a lane, per layer, on the CPU."""
        return self.pool.export_range(lane.index, start, end)

    def park(self, lane: Lane) -> bool:
        """Park the lane's conversation (only what the reuse image lacks is captured)."""
        if not lane.tokens:
            return False
        tokens = list(lane.tokens)
        eid = self.cache.park(tokens, lambda s, e: self.capture(lane, s, e), self.bytes_per_token)
        return eid is not None

    def find(self, prompt: list[int]) -> tuple[int, int] | None:
        """(entry id, usable shared length) of the parked conversation best matching `prompt`."""
        hit = self.cache.lookup(prompt)
        if hit is None:
            return None
        eid, n = hit
        return eid, min(n, len(prompt) - 1)

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
        write_entry(self.pool, lane.index, entry, n)
        lane.tokens = entry.tokens[:n].tolist()


def write_entry(pool: TablePool, lane: int, entry: ParkedEntry, n: int) -> None:
    """Copy the first n cells of a parked entry into `lane`'s reserved cells."""
    pool.import_range(lane, 0, [{k: t[:n] for k, t in runs.items()} for runs in entry.kv.layers()])
