"""A sliding layer's decode step: the window as per-lane state against the window inside the pool.

`python -m benchmarks.window_state [--lanes 16] [--context 4096] [--window 1024] [--threads 1]`
prints JSON: milliseconds per layer of one decode step on the CPU (bf16, the
C++ kernel on both sides), and the bytes a lane holds for the layer. Both
paths read the same W keys per row; the pool path keeps every position of
the context, the state path a ring of W cells (`models/window.py`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from strata.attention.reference import TableAttention
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.state import StatePool
from strata.kv.step import SeqSpec
from strata.models.window import WindowStep, window_state_shapes


def _ms(f: Callable[[], object], reps: int) -> float:
    f()
    t0 = time.perf_counter()
    for _ in range(reps):
        f()
    return 1e3 * (time.perf_counter() - t0) / reps


def run(lanes: int, context: int, window: int, kv_heads: int, head_dim: int, reps: int) -> dict:
    bf = torch.bfloat16
    pool = KvPool(make_format("bf16", kv_heads, head_dim), 1, lanes, context + 1, 256, None)
    for lane in range(lanes):
        assert pool.reserve(lane, context + 1)
    for t in pool.layers[0].values():
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(bf))
    states = StatePool({0: window_state_shapes(window, kv_heads, head_dim)}, lanes, "cpu",
                       {0: {"k": bf, "v": bf}})
    for t in states.layers[0].values():
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(bf))
    q = torch.randn(lanes, 2 * kv_heads, head_dim).to(bf)
    k = torch.randn(lanes, kv_heads, head_dim).to(bf)
    seqs = [SeqSpec(lane, context, 1) for lane in range(lanes)]
    scale = head_dim**-0.5
    in_pool = _ms(lambda: TableAttention(pool, seqs, scale).attend(0, q, k, k, window=window), reps)
    positions = torch.full((lanes,), context)
    spans = [(i, 1) for i in range(lanes)]
    lane_ids = list(range(lanes))
    as_state = _ms(lambda: WindowStep(positions, states.step(spans, lane_ids, [False] * lanes), window,
                                      scale).attend(0, q, k, k), reps)
    return {"lanes": lanes, "context": context, "window": window, "kv_heads": kv_heads,
            "head_dim": head_dim, "threads": torch.get_num_threads(),
            "pool_ms_per_layer": round(in_pool, 2), "state_ms_per_layer": round(as_state, 2),
            "pool_bytes_per_lane": (context + 1) * pool.bytes_per_cell(),
            "state_bytes_per_lane": states.bytes_per_lane()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lanes", type=int, default=16)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(json.dumps(run(a.lanes, a.context, a.window, a.kv_heads, a.head_dim, a.reps)))


if __name__ == "__main__":
    main()
