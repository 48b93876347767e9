"""The expert cache's eviction orders compared on recorded routing traces, as JSON.

A trace (`gpu_bench --expert-cache N --trace-out FILE`) lists, per layer, the
experts each step used. Every policy of `kv/expert_residency.py` replays
every layer's trace with a cache of each size, starting empty; the figure is
the hit rate over all layers (what decides the bytes copied per token), and
how far each policy is from the best one at that size.

    python -m benchmarks.expert_policy TRACE.json [--slots 8,16,32,64] [--half-lives 16,64,256]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from strata.kv.expert_residency import POLICIES, simulate


def compare(trace: dict[str, Any], slots: list[int], half_lives: list[float]) -> list[dict[str, Any]]:
    """One row per (slots, policy, half-life where it matters): hits, misses, hit rate."""
    experts = int(trace["experts"])
    rows = []
    for n in slots:
        for policy in POLICIES:
            for half in half_lives if policy == "lfru" else half_lives[:1]:
                hits = misses = 0
                for layer in trace["layers"]:
                    h, m = simulate(layer, experts, n, policy, half)
                    hits += h
                    misses += m
                row = {"slots": n, "policy": policy, "hits": hits, "misses": misses,
                       "hit_rate": hits / max(1, hits + misses)}
                if policy == "lfru":
                    row["half_life"] = half
                rows.append(row)
        best = max(r["hit_rate"] for r in rows if r["slots"] == n)
        for r in rows:
            if r["slots"] == n:
                r["misses_vs_best"] = (1 - r["hit_rate"]) / max(1e-12, 1 - best)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.expert_policy", description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--slots", default="8,16,32,64")
    p.add_argument("--half-lives", default="16,64,256")
    args = p.parse_args(argv)
    with open(args.trace) as f:
        trace = json.load(f)
    rows = compare(trace, [int(s) for s in args.slots.split(",")], [float(h) for h in args.half_lives.split(",")])
    print(json.dumps({"trace": args.trace, "steps": len(trace["layers"][0]) if trace["layers"] else 0,
                      "layers": len(trace["layers"]), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
