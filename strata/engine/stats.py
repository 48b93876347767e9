"""The engine's figures: the pool, the lanes and the scheduler's counters, as one flat dict.

`Engine.stats()` adds the loop's own counters; the server turns the dict
into /metrics and /v1/state (strata/serve/metrics.py, state.py).
"""

from __future__ import annotations

from typing import Any

from strata.engine.scheduler import Scheduler
from strata.kv.tables import TablePool


def _lane_state(lane: Any) -> str:
    if lane.request is not None:
        return "busy"
    return "idle" if lane.tokens else "empty"


def pool_and_lane_figures(sched: Scheduler, pool: TablePool) -> dict[str, Any]:
    """Cells and bytes of the pool, each lane's state, and what admission has done so far."""
    lanes = sched.lanes
    c = sched.counters
    return {
        "pool_cells_total": pool.total_cells,
        "pool_cells_used": pool.used_cells,
        "pool_cells_free": pool.free_cells,
        "pool_cells_holding_tokens": sum(len(lane.tokens) for lane in lanes),
        "pool_bytes": pool.total_bytes(),
        "pool_shared": pool.shared,
        "kv_format": pool.fmt.name,
        "kv_chunk": pool.chunk_size,
        "chunks_per_session": {lane.index: pool.reserved[lane.index] for lane in lanes},
        "lanes": [{"id": lane.index, "state": _lane_state(lane), "n_tokens": len(lane.tokens),
                   "chunks": pool.reserved[lane.index]} for lane in lanes],
        "tokens_per_session": {lane.index: len(lane.tokens) for lane in lanes},
        "lanes_total": len(lanes),
        "lanes_busy": sum(1 for lane in lanes if lane.request is not None),
        "lanes_idle": sum(1 for lane in lanes if lane.request is None and lane.tokens),
        "queue_length": len(sched.waiting),
        "prefix_reuse_hits": c.prefix_reuse_hits,
        "prefix_tokens_reused": c.prefix_tokens_reused,
        "refusals": c.refusals,
        "truncations": c.truncations,
        "evictions": c.evictions,
        "moves": c.moves,
        "conversation_parks": c.parks,
        "conversation_restores": c.restores,
        "conversation_tokens_restored": c.restored_tokens,
        "restore_misses": c.restore_misses,
        "kv_stream": pool.figures(),
    }
