"""The batch-invariant products (`strata/kernels/triton/matmul.py`) against cuBLAS, on the GPU (JSON).

For each matrix of the 8B shape and each row count it times cuBLAS (F.linear),
the invariant kernel under its rule's launch shape and under every shape of a
small grid, and checks that row 0 has the same bits at every row count and
launch shape (`invariant`). Timings replay a CUDA graph over enough weight
copies (2 GiB) that none sits in L2, as in a decode step (`gemv_sweep._time`).

    python -m benchmarks.matmul_sweep --rows 1,16,64,512 --out matmul.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.gemv_sweep import _time, shapes

try:  # the arguments parse without Triton (a CPU machine); the sweep itself needs it and CUDA
    from strata.kernels.triton import matmul
except ImportError:
    matmul = None  # type: ignore[assignment]

GRID: list[tuple[int, int, int, int]] = [
    (16, 32, 4, 4), (16, 32, 4, 6), (16, 64, 4, 4), (16, 64, 4, 6), (16, 128, 4, 4), (32, 64, 4, 5),
    (64, 32, 4, 5), (64, 64, 4, 4), (64, 64, 4, 6), (64, 128, 4, 4), (64, 128, 8, 4),
    (128, 128, 8, 4), (128, 256, 8, 3),
]


def sweep_matrix(n: int, k: int, rows: list[int], grid: bool, gib: float = 2.0) -> dict[str, Any]:
    """cuBLAS and the invariant kernel at each row count for one [n, k] weight."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    copies = max(2, math.ceil(gib * 2**30 / (n * k * 2)))
    w = torch.randn(copies, n, k, device=dev, dtype=dt) * k**-0.5
    xs = torch.randn(max(rows), k, device=dev, dtype=dt)
    row0 = matmul.matmul(xs[:1], w[0])[0]
    out: dict[str, Any] = {"rows": n, "cols": k, "weight_bytes": n * k * 2, "by_m": {}}
    invariant = True
    for m in rows:
        x = xs[:m]
        r: dict[str, Any] = {"cublas_us": _time(lambda i: F.linear(x, w[i]), copies)}
        r["rule"] = list(matmul.config_for(m, n, dt))
        r["strata_us"] = _time(lambda i: matmul.matmul(x, w[i]), copies)
        invariant &= bool(torch.equal(matmul.matmul(x, w[0])[0], row0))
        if grid:
            r["grid"] = {}
            for cfg in GRID:
                try:
                    r["grid"][",".join(map(str, cfg))] = _time(
                        lambda i: matmul.matmul(x, w[i], config=cfg), copies)
                    invariant &= bool(torch.equal(matmul.matmul(x, w[0], config=cfg)[0], row0))
                except Exception as e:  # noqa: BLE001 - a config that fails is a result
                    print(f"{n}x{k} m={m} {cfg}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
            best = min(r["grid"].items(), key=lambda kv: kv[1])
            r["best"] = {"config": best[0], "us": best[1]}
        r["ratio_vs_cublas"] = r["cublas_us"] / r["strata_us"]
        r["strata_TBps"] = n * k * 2 / r["strata_us"] / 1e6
        out["by_m"][m] = r
    out["invariant"] = invariant
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,16,64,512")
    p.add_argument("--grid", action="store_true", help="also time every launch shape of GRID")
    p.add_argument("--only", default="", help="comma-separated names: qkv,o,gate_up,down,head")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if matmul is None or not torch.cuda.is_available():
        p.error("the sweep needs Triton and a CUDA device")
    rows = [int(v) for v in a.rows.split(",")]
    res: dict[str, Any] = {}
    for name, (n, k, _) in shapes(4096, 14336, 6144, 49152).items():
        if a.only and name not in a.only.split(","):
            continue
        res[name] = sweep_matrix(n, k, rows, a.grid)
        torch.cuda.empty_cache()
        brief = {m: (round(r["cublas_us"], 1), round(r["strata_us"], 1)) for m, r in res[name]["by_m"].items()}
        print(name, "invariant" if res[name]["invariant"] else "NOT INVARIANT", brief, file=sys.stderr, flush=True)
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
