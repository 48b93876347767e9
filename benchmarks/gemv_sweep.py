"""Launch shapes of the one-row kernels (`strata/kernels/triton/gemv.py`) against cuBLAS, on the GPU (JSON).

For each matrix of a one-lane decode step (the Llama-3.1-8B shape by
default) it times the fused kernel under every config of a grid, and the
unfused ops it replaces (cuBLAS through F.linear plus the norm, SwiGLU or
residual kernels), and cuBLAS's product alone. Each timing replays a CUDA
graph that runs the op over enough copies of the weight (2 GiB) that none
of them is in L2, as in a real step; the time per op includes the gaps
between kernels a decode graph also has.

    python -m benchmarks.gemv_sweep --out gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

try:  # the arguments parse without Triton (a CPU machine); the sweep itself needs it and CUDA
    from strata.kernels.triton import fused, gemv
except ImportError:
    fused = gemv = None  # type: ignore[assignment]

EPS = 1e-5
GRID = {"block_n": (1, 2, 4, 8), "block_k": (512, 1024), "warps": (4, 8), "stages": (1,)}  # stages 3: no change


def shapes(hidden: int, inter: int, qkv: int, vocab: int) -> dict[str, tuple[int, int, str]]:
    """name -> (weight rows, columns, folded ops) of one layer's products and the head."""
    return {"qkv": (qkv, hidden, "norm"), "o": (hidden, hidden, "residual"),
            "gate_up": (2 * inter, hidden, "norm,silu"), "down": (hidden, inter, "residual"),
            "head": (vocab, hidden, "f32")}


def _time(fn: Callable[[int], Any], copies: int, reps: int = 5) -> float:
    """Microseconds per call of fn(i) for i over the copies, replayed from a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(copies):
            fn(i)  # compiles, allocations
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * copies)


def sweep_matrix(name: str, n: int, k: int, ops: str, gib: float = 2.0) -> dict[str, Any]:
    """One matrix: cuBLAS alone, cuBLAS with the small kernels, the one-row kernel per config."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    copies = max(2, math.ceil(gib * 2**30 / (n * k * 2)))
    w = torch.randn(copies, n, k, device=dev, dtype=dt) * k**-0.5
    x = torch.randn(1, k, device=dev, dtype=dt)
    nw = torch.ones(k, device=dev, dtype=dt)
    silu = "silu" in ops
    res = torch.randn(1, n // 2 if silu else n, device=dev, dtype=dt)
    kw: dict[str, Any] = {"norm_weight": nw if "norm" in ops else None, "eps": EPS, "silu": silu,
                          "residual": res if "residual" in ops else None,
                          "out_dtype": torch.float32 if "f32" in ops else None}

    def unfused(i: int) -> Any:
        xi = fused.rms_norm(x, nw, EPS) if "norm" in ops else x
        y = F.linear(xi, w[i])
        if silu:
            y = fused.silu_mul(y)
        if "residual" in ops:
            y = res + y
        return y.float() if "f32" in ops else y

    row: dict[str, Any] = {"rows": n, "cols": k, "ops": ops, "copies": copies,
                           "weight_bytes": n * k * 2}
    row["cublas_us"] = _time(lambda i: F.linear(x, w[i]), copies)
    row["unfused_us"] = _time(unfused, copies)
    configs = []
    for cfg in itertools.product(*GRID.values()):
        if k % cfg[1]:
            continue
        try:
            us = _time(lambda i: gemv.gemv(x, w[i], config=cfg, **kw), copies)
        except Exception as e:  # noqa: BLE001 - a config that fails is a result
            us = float("nan")
            print(f"{name} {','.join(map(str, cfg))}: {type(e).__name__}: {str(e)[:100]}",
                  file=sys.stderr)
        configs.append({"config": list(cfg), "us": us})
    good = [c for c in configs if c["us"] == c["us"]]
    best = min(good, key=lambda c: c["us"]) if good else None
    row["configs"] = configs
    row["best"] = best
    for key in ("cublas_us", "unfused_us"):
        row[key.replace("_us", "_TBps")] = n * k * 2 / row[key] / 1e6
    if best:
        row["best_TBps"] = n * k * 2 / best["us"] / 1e6
    return row


def sweep(hidden: int = 4096, inter: int = 14336, qkv: int = 6144, vocab: int = 49152,
          gib: float = 2.0, only: str = "") -> dict[str, Any]:
    """Every matrix of `shapes` (or those named in `only`), and the best configs as CONFIGS keys."""
    out: dict[str, Any] = {}
    for name, (n, k, ops) in shapes(hidden, inter, qkv, vocab).items():
        if only and name not in only.split(","):
            continue
        row = sweep_matrix(name, n, k, ops, gib)  # its weight copies are freed on return
        torch.cuda.empty_cache()
        out[name] = row
        print(json.dumps({key: v for key, v in row.items() if key != "configs"}), file=sys.stderr,
              flush=True)
    out["CONFIGS"] = {f"({r['rows'] // (2 if 'silu' in r['ops'] else 1)}, {r['cols']})": r["best"]["config"]
                      for r in out.values() if isinstance(r, dict) and r.get("best")}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--qkv", type=int, default=6144)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--only", default="", help="comma-separated names: qkv,o,gate_up,down,head")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if gemv is None or not torch.cuda.is_available():
        p.error("the sweep needs Triton and a CUDA device")
    res = sweep(a.hidden, a.intermediate, a.qkv, a.vocab, only=a.only)
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(json.dumps(res["CONFIGS"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
