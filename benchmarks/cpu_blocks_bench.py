"""block_matmul (GGUF blocks in place) against torch's int4/int8 weight-only kernels, on the CPU (JSON).

For the default model's products (SmolLM2-135M: qkv, o, gate_up, down and
the 49152-row head) and each block type it times x @ W.T for one lane
(M = 1, a decode step: bound by reading the weights) and for prompt-sized
M, and reports GB/s of weight bytes and GFLOP/s. The baseline is what
`--weights int4/int8` run today: `torch._weight_int4pack_mm_for_cpu` (groups
of 32, bf16 scales) and `torch._weight_int8pack_mm` on the same shapes.
Each call uses the next of several copies of the weights (64 MiB or more in
all), so that no copy is in cache when it is read, as in a real step.
K-quants need K a multiple of 256, so of
this model's shapes only `down` takes them (llama.cpp's files use other
types there). Timings are medians; on a host whose cores other processes share they are
noisy, and best read as ratios against the baseline of the same run.

    python -m benchmarks.cpu_blocks_bench --out blocks.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata.kernels.cpu.loader import cpu_kernel

T = GGMLQuantizationType
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}
TYPES = ("Q4_1", "Q8_0", "Q4_K", "Q6_K")
# where each type keeps its fp16 scale fields: random bytes there could be NaN or inf
SCALE_OFFSETS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
                 T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
ROTATE_BYTES = 64 << 20


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int) -> torch.Tensor:
    """uint8 [n, bytes per row]: random codes, small finite fp16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        raw[:, off:off + 2] = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16).view(
            np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def _time(fn: Callable[[int], Any], copies: int, budget_s: float) -> tuple[float, float]:
    """Median wall seconds of one call fn(i), cycling over the copies, and median CPU seconds
    (all threads: on a shared host the wall time includes waits for a descheduled thread)."""
    fn(0)
    start = time.perf_counter()
    fn(1 % copies)
    once = time.perf_counter() - start
    reps = max(3, min(200, int(budget_s / max(once, 1e-7))))
    times, cpu = [], []
    for r in range(reps):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn(r % copies)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(times), statistics.median(cpu)


def _figures(t: tuple[float, float], weight_bytes: int, m: int, n: int, k: int) -> dict[str, float]:
    seconds, cpu = t
    return {"us": round(seconds * 1e6, 1), "cpu_us": round(cpu * 1e6, 1),
            "weight_GBps": round(weight_bytes / seconds / 1e9, 2),
            "GFLOPs": round(2 * m * n * k / seconds / 1e9, 2)}


def bench_blocks(kernel: Any, qtype: GGMLQuantizationType, n: int, k: int, ms: list[int],
                 budget_s: float) -> dict[str, Any]:
    if k % GGML_QUANT_SIZES[qtype][0]:
        return {"skipped": f"K = {k} is not a multiple of {qtype.name}'s block"}
    one = random_blocks(qtype, n, k, 0)
    copies = max(2, math.ceil(ROTATE_BYTES / one.numel()))
    ws = [one] + [random_blocks(qtype, n, k, c) for c in range(1, copies)]
    out: dict[str, Any] = {"weight_bytes": one.numel()}
    for m in ms:
        x = torch.randn(m, k).bfloat16()
        t = _time(lambda i: kernel.block_matmul(x, ws[i], int(qtype)), copies, budget_s)
        out[f"M{m}"] = _figures(t, one.numel(), m, n, k)
    return out


def bench_torch(n: int, k: int, ms: list[int], budget_s: float) -> dict[str, Any]:
    """torch's int4 (group 32) and int8 weight-only products, as strata.models.quantize uses them."""
    out: dict[str, Any] = {}
    int4_bytes = n * k // 2 + n * (k // 32) * 4  # codes and bf16 scale, zero per group
    copies4 = max(2, math.ceil(ROTATE_BYTES / int4_bytes))
    packed = [torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
              for _ in range(copies4)]
    sz = (torch.rand(k // 32, n, 2) * 0.01).bfloat16()
    int8_bytes = n * k + n * 2
    copies8 = max(2, math.ceil(ROTATE_BYTES / int8_bytes))
    codes = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(copies8)]
    scales = (torch.rand(n) * 0.01).bfloat16()
    for m in ms:
        x = torch.randn(m, k).bfloat16()
        t4 = _time(lambda i: torch._weight_int4pack_mm_for_cpu(x, packed[i], 32, sz), copies4, budget_s)
        t8 = _time(lambda i: torch._weight_int8pack_mm(x, codes[i], scales), copies8, budget_s)
        out[f"M{m}"] = {"int4": _figures(t4, int4_bytes, m, n, k), "int8": _figures(t8, int8_bytes, m, n, k)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=list(TYPES))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--m", nargs="+", type=int, default=[1, 64, 512])
    ap.add_argument("--budget", type=float, default=0.5, help="seconds of timing per case")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = cpu_kernel()
    if kernel is None:
        raise SystemExit("the CPU kernels did not build")
    result: dict[str, Any] = {"threads": args.threads, "load_avg": os.getloadavg()[0], "x_dtype": "bfloat16",
                              "blocks": {}, "torch": {}}
    for name in args.shapes:
        n, k = SHAPES[name]
        result["blocks"][name] = {t: bench_blocks(kernel, T[t], n, k, args.m, args.budget) for t in args.types}
        result["torch"][name] = bench_torch(n, k, args.m, args.budget)
    # one decode step of the default model: 30 layers of Q4_1 products and the Q8_0 head
    if {"qkv", "o", "gate_up", "down", "head"} <= set(args.shapes) and 1 in args.m and {"Q4_1", "Q8_0"} <= set(
            args.types):
        layer = sum(result["blocks"][s]["Q4_1"]["M1"]["us"] for s in ("qkv", "o", "gate_up", "down"))
        result["decode_step_ms"] = round((30 * layer + result["blocks"]["head"]["Q8_0"]["M1"]["us"]) / 1e3, 3)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
