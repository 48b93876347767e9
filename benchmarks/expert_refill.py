"""The host's share of mapped expert reads (`--expert-misses mapped`): one `ExpertRefill.after_step`, as JSON.

A mapped step decides nothing on the host, but after each step the refill reads
the step's routing log, counts, records the use for the policy and picks the
copies (models/expert_refill.py). That work runs while the step runs on the
GPU, so it costs nothing as long as it is shorter than the step. Here it is
timed on the CPU alone with a model's shape of cached layers (tiny tensors: the
copies cost nothing, the bookkeeping is what is timed) and routing drawn from a
skewed popularity (expert of rank r chosen with weight r^-skew; one random
order per layer), so the hit rate it reaches is reported beside it.

    python -m benchmarks.expert_refill [--layers 48 --experts 128 --top-k 8 --slots 32 --lanes 1,16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from strata.models.expert_refill import ExpertRefill
from strata.models.experts import CacheStats, ExpertCache
from strata.models.moe import DenseMath


def run(layers: int, experts: int, top_k: int, slots: int, lanes: int, uploads: int, steps: int,
        skew: float, seed: int) -> dict[str, Any]:
    """Median ms of after_step over the last half of `steps` steps of `lanes` rows, and the hit rate."""
    stats = CacheStats()
    tiny = [torch.zeros(experts, 1, 1)] * 3
    caches = [ExpertCache(DenseMath(), tiny, slots, torch.device("cpu"), j, stats, fused=True)
              for j in range(layers)]
    refill = ExpertRefill(caches, top_k, uploads, torch.device("cpu"), rows=lanes)
    rng = np.random.default_rng(seed)
    weight = np.arange(1, experts + 1, dtype=np.float64) ** -skew
    popularity = []  # per layer: expert -> probability, the ranks in a random order
    for _ in range(layers):
        p = np.empty(experts)
        p[rng.permutation(experts)] = weight / weight.sum()
        popularity.append(p)
    times = []
    for _ in range(steps):
        for j, p in enumerate(popularity):
            ids = np.stack([rng.choice(experts, size=top_k, replace=False, p=p) for _ in range(lanes)])
            refill.logs[j, : lanes * top_k] = torch.from_numpy(ids.reshape(-1))
        t = time.perf_counter()
        refill.after_step(lanes)
        times.append(time.perf_counter() - t)
    return {"layers": layers, "experts": experts, "top_k": top_k, "slots": slots, "lanes": lanes,
            "uploads": uploads, "skew": skew, "steps": steps,
            "after_step_ms": 1e3 * statistics.median(times[steps // 2:]), "hit_rate": stats.hit_rate()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--lanes", default="1,16")
    p.add_argument("--uploads", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--skew", type=float, default=0.35, help="popularity exponent (tools/synth's router: 0.35)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [run(a.layers, a.experts, a.top_k, a.slots, int(n), a.uploads, a.steps, a.skew, a.seed)
            for n in a.lanes.split(",") if n]
    json.dump(rows, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
