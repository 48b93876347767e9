"""The engine's figures: the pool, the lanes and the scheduler's counters, as one flat dict.

`Engine.stats()` adds the loop's own counters; the server turns the dict
into /metrics and /v1/state (strata/serve/metrics.py, state.py).
"""

from __future__ import annotations

from typing import Any

import torch

from strata.engine.scheduler import Scheduler
from strata.kv.tables import TablePool
from strata.memory import device_memory
from strata.models.blocks import weight_bytes


def _lane_state(lane: Any) -> str:
    if lane.request is not None:
        return "busy"
    return "idle" if lane.tokens else "empty"


def pool_and_lane_figures(sched: Scheduler, pool: TablePool) -> dict[str, Any]:
    """Cells and bytes of the pool, each lane's state, and what admission has done so far.

    Cells are counted three ways because they answer different questions: holding tokens
    (what the conversations occupy), reserved (what admission can no longer hand out),
    free (what it still can).
    """
    lanes = sched.lanes
    c = sched.counters
    holding = sum(len(lane.tokens) for lane in lanes)  # busy and idle lanes: K/V written and kept
    return {
        # Per layer, in cells (one token's K/V). Reserved cells are whole chunks held by lanes,
        # so an idle server whose lanes each keep a short conversation is mostly reserved but
        # barely used: `pool_usage_fraction` is the figure that follows the tokens.
        "pool_cells_total": pool.total_cells,
        "pool_cells_holding_tokens": holding,
        "pool_cells_reserved": pool.used_cells,
        "pool_cells_used": pool.used_cells,  # the older name of pool_cells_reserved, kept for dashboards
        "pool_cells_free": pool.free_cells,
        "pool_usage_fraction": holding / pool.total_cells if pool.total_cells else 0.0,
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


def memory_figures(loaded: Any, pool: TablePool) -> dict[str, Any]:
    """Weight bytes on each device (each storage once), the stored tensors' bytes, the KV pool and
    what each device has free now."""
    weights = weight_bytes(loaded.model)
    free: dict[str, int] = {}
    total: dict[str, int] = {}
    for dev in weights:
        f, t = device_memory(torch.device(dev))
        if f is not None:
            free[dev] = f
        if t is not None:
            total[dev] = t
    return {"weight_mode": loaded.weights, "weight_bytes": weights, "weight_file_bytes": loaded.file_bytes,
            "pool_bytes": pool.total_bytes(), "device_free_bytes": free, "device_total_bytes": total}


def describe_memory(mem: dict[str, Any]) -> str:
    """The start-up line: weights per device against the file, the pool, what is left."""
    gib = 2**30
    where = ", ".join(f"{b / gib:.2f} GiB on {d}" for d, b in mem["weight_bytes"].items())
    left = ", ".join(f"{d} {f / gib:.1f} of {mem['device_total_bytes'].get(d, 0) / gib:.1f} GiB"
                     for d, f in mem["device_free_bytes"].items())
    return (f"memory: weights ({mem['weight_mode']}) {where} (tensors in the file: "
            f"{mem['weight_file_bytes'] / gib:.2f} GiB); KV pool {mem['pool_bytes'] / gib:.2f} GiB; "
            f"free now: {left or 'unknown'}")
