"""One prompt read through `Engine.complete`, timed, then profiled: host against device time.

    python -m benchmarks.prompt_probe MODEL.gguf [--tokens 512] [--tree DIR]

`--tree` imports Strata from another checkout (e.g. an older commit's
`git archive` unpacked), so two trees can be compared on one machine in one
run. Prints JSON: the wall time of each read (ms) and the profile's top
kernels (name, device ms, calls).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prompt_probe", description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--tree", default=None, help="import strata from this folder")
    args = ap.parse_args(argv)
    if args.tree:
        sys.path.insert(0, args.tree)
    import torch
    from torch.profiler import ProfilerActivity, profile

    import strata
    from strata.engine.config import EngineConfig
    from strata.engine.engine import Engine
    from strata.engine.types import SamplingParams

    cfg = EngineConfig(model=args.model, device="cuda", parallel=64, max_context=args.tokens + 192,
                       kv_pool_tokens=64 * (args.tokens + 192), kv_chunk=1024,
                       prefill_chunk=args.tokens)
    eng = Engine(cfg)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    out: dict = {"tree": strata.__file__, "attention": eng.runner.context.__name__, "ms": []}
    for rep in range(args.reps + 1):  # the first read warms up
        ids = [(7 * i + 1009 * rep) % 40000 + 100 for i in range(args.tokens)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.complete(ids, one)
        torch.cuda.synchronize()
        out["ms"].append(round((time.perf_counter() - t0) * 1e3, 2))
    ids = [(11 * i) % 40000 + 100 for i in range(args.tokens)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.complete(ids, one)
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]
    out["top"] = [(e.key[:60], round(e.device_time_total / 1e3, 3), e.count) for e in rows]
    eng.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
