"""One decode row's attention through the C++ CPU kernel (`attend`), per layer (JSON).

The default model's attention shape (9 query heads over 3 KV heads of 64, bf16
cells): one query row reads `context` keys gathered by cell from a pool that
holds 30 layers' worth of cells, each repetition another layer's, so the
K/V come from memory as in a decode step rather than from cache. Reported per
thread count: microseconds a layer and the K/V bytes read per second.

    python -m benchmarks.cpu_attention --contexts 512,4096 --threads 1,2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from strata.kernels.cpu.loader import cpu_kernel

HQ, HKV, D, LAYERS = 9, 3, 64, 30


def layer_us(kernel, context: int, reps: int = 30) -> float:
    """Microseconds of one layer's attention for one row over `context` keys."""
    q = torch.randn(1, HQ, D).bfloat16()
    k = torch.randn(context * LAYERS, HKV, D).bfloat16()
    v = torch.randn(context * LAYERS, HKV, D).bfloat16()
    cells = torch.arange(context).view(1, context)
    row_seq, row_pos = torch.zeros(1, dtype=torch.long), torch.tensor([context - 1])
    for _ in range(3):
        kernel.attend(q, k, v, cells, row_seq, row_pos, D**-0.5)
    start = time.perf_counter()
    for i in range(reps):
        kernel.attend(q, k, v, cells + (i % LAYERS) * context, row_seq, row_pos, D**-0.5)
    return (time.perf_counter() - start) / reps * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--threads", default="1,2")
    a = p.parse_args(argv)
    kernel = cpu_kernel()
    if kernel is None:
        raise SystemExit("the CPU kernels did not build")
    rows = []
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        for context in (int(c) for c in a.contexts.split(",")):
            us = layer_us(kernel, context)
            rows.append({"threads": threads, "context": context, "us_per_layer": round(us, 1),
                         "kv_gb_per_s": round(context * HKV * D * 2 * 2 / us / 1e3, 2)})
    print(json.dumps({"shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D}, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
