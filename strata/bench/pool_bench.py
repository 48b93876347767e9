"""Pool figures: memory that follows tokens in use, and the cost of a move."""

from __future__ import annotations

import time
from typing import Any

from strata.engine.config import EngineConfig
from strata.kv.formats import make_format
from strata.kv.pool import KvPool

# the default model's attention shape (SmolLM2-135M): 30 layers, 3 KV heads of 64
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def bench_pool(cfg: EngineConfig) -> dict[str, Any]:
    kv = "bf16" if cfg.kv == "auto" else cfg.kv
    fmt = make_format(kv, KV_HEADS, HEAD_DIM)
    per_cell = fmt.cell_bytes() * LAYERS
    chunk = 4096
    max_context = 32768
    convs = [600, 2500, 9000, 31000]  # a mix of short and long conversations on 4 lanes
    lanes_x_context = len(convs) * max_context * per_cell
    chunks = sum(-(-n // chunk) for n in convs)
    shared = chunks * chunk * per_cell
    # move a 100k-token conversation between two sessions of a real-size pool
    move_tokens = 100_000
    pool = KvPool(fmt, 1, 2, 131072, chunk, 131072, "cpu")
    pool.reserve(0, move_tokens)
    reps = 1000
    t0 = time.perf_counter()
    for _ in range(reps):
        pool.swap(0, 1)
    move_s = (time.perf_counter() - t0) / reps
    n_chunks = pool.chunks_for(move_tokens)
    copy_bytes = move_tokens * per_cell
    return {
        "kv_format": kv,
        "bytes_per_cell_all_layers": per_cell,
        "lanes": len(convs),
        "conversation_tokens": convs,
        "max_context": max_context,
        "kv_chunk": chunk,
        "bytes_lanes_x_max_context": lanes_x_context,
        "bytes_shared_pool_in_use": shared,
        "memory_ratio": shared / lanes_x_context,
        "move_tokens": move_tokens,
        "move_chunks": n_chunks,
        "move_seconds": move_s,
        "move_seconds_per_chunk": move_s / n_chunks,
        "copy_bytes_avoided": copy_bytes,
    }
