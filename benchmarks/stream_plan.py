"""Host time of a streamed step's plan (`attention/triton_stream.plan_step`), on the CPU (JSON).

A streamed decode step on the GPU starts with this plan: every layer's
residency (`StreamStore.plan_layers`), translated tables and copy pairs. It
runs on the host whatever the device, so it is timed here on a CPU pool of
the 8B shape's layout (32 layers, 8 KV heads of 128, bf16 cells, blocks of 64
cells, 4,096 resident cells a layer), one lane decoding at each context.

    python -m benchmarks.stream_plan --contexts 8192,32768
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from strata.attention.triton_stream import plan_step
from strata.kv.formats import make_format
from strata.kv.step import SeqSpec
from strata.kv.stream import StreamedPool


def plan_ms(context: int, layers: int = 32, resident: int = 4096, reps: int = 20) -> float:
    """Milliseconds per plan of a one-lane decode step at `context` cells."""
    pool = StreamedPool(make_format("bf16", 8, 128), layers, 1, context + 512, 4096, None, "cpu",
                        resident_cells=resident, block_cells=64, overlap=True)
    assert pool.reserve(0, context + 1)
    store = pool.store
    ring = min(store.copies.prefetch, layers)
    seqs = [SeqSpec(0, context, 1)]
    for _ in range(3):  # the cache settles into its steady state
        plan_step(store, seqs, ring)
    start = time.perf_counter()
    for _ in range(reps):
        plan_step(store, seqs, ring)
    return (time.perf_counter() - start) / reps * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--layers", type=int, default=32)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out = {f"plan_ms_{c}": round(plan_ms(int(c), a.layers), 3) for c in a.contexts.split(",")}
    print(json.dumps({"layers": a.layers, "threads": 1, **out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
