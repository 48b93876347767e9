"""What reading new tokens after a reused prefix costs, by prefix length (a benchmark, not a test).

    python -m benchmarks.prefix_extend --prefixes 10,2500 --new 363

For each prefix length: one lane reads the prefix (timed: a read from 0),
then the same prompt plus `--new` tokens (timed: only the new tokens are
read, after the prefix the lane keeps). An agent's round trip is the second
kind; if its time grows with the prefix, attention over the prefix is what
grows. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams

TEXT = "def step(state):\n    return state + 1  # advance the counter\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--prefixes", default="10,2500")
    ap.add_argument("--new", type=int, default=363)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    prefixes = [int(x) for x in args.prefixes.split(",")]
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    rows = []
    cfg = EngineConfig(model=args.model, device=args.device, parallel=1,
                       max_context=max(prefixes) + args.new + 64)
    with Engine(cfg) as eng:
        words = eng.tokenizer.encode(TEXT * (1 + (max(prefixes) + args.new) // 10))
        for n in prefixes:
            prefix = words[:n]
            start = time.perf_counter()
            eng.complete(prefix, one)
            read = time.perf_counter() - start
            start = time.perf_counter()
            done = eng.complete(prefix + words[n:n + args.new], one)
            extend = time.perf_counter() - start
            rows.append({"prefix": n, "read_from_0_s": round(read, 3), "new_tokens": args.new,
                         "reused": done.cached_tokens, "extend_s": round(extend, 3)})
    print(json.dumps({"model": cfg.model, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
