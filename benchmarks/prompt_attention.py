"""Prompt attention alone on the GPU, per KV format (JSON): one layer, one lane, the last piece of
a long prompt read over its cached prefix.

The last piece of a 32,768-token prompt read in pieces of 2,048 costs the most of all its
pieces: its queries see the whole context. Its time is the `attend` of one layer (the write of
the piece's K/V and the prompt kernel), Llama-3.1-8B heads (32 query, 8 KV heads of 128),
bf16 compute, cells of random codes; the ratio to bf16 cells is the figure issue 20 sets
(quantized cells within 1.25x of bf16 in prompt reading).

    python -m benchmarks.prompt_attention --formats bf16,int8,q4_0,k8v4 --context 32768 --piece 2048
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from benchmarks.attention_sweep import random_pool
from strata.kv.step import SeqSpec


def prompt_attention_run(fmt_name: str, context: int, piece: int, device: torch.device,
                         heads: int = 32, kv_heads: int = 8, head_dim: int = 128, reps: int = 10) -> dict[str, Any]:
    """The time of one layer's `attend` for the last `piece` tokens of a `context`-token prompt."""
    from strata.attention.triton_pool import GpuTableAttention

    _, pool = random_pool(fmt_name, 1, context, device, kv_heads, head_dim)
    ctx = GpuTableAttention(pool, [SeqSpec(0, context - piece, piece, prompt=True)], head_dim**-0.5)
    q = torch.randn(piece, heads, head_dim, device=device, dtype=torch.bfloat16)
    kv = torch.randn(piece, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    for _ in range(2):  # compiles, then warms
        ctx.attend(0, q, kv, kv)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        ctx.attend(0, q, kv, kv)
    end.record()
    torch.cuda.synchronize(device)
    ms = start.elapsed_time(end) / reps
    # causal: query i of the piece reads context - piece + i + 1 keys
    pairs = piece * (context - piece) + piece * (piece + 1) // 2
    flops = 4 * pairs * heads * head_dim  # q.k and p.v, two flops a multiply-add
    return {"kv": fmt_name, "context": context, "piece": piece, "ms_per_layer": round(ms, 4),
            "TFLOPs": round(flops / ms / 1e9, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="bf16,int8,q4_0,k8v4")
    p.add_argument("--context", type=int, default=32768, help="the prompt's tokens")
    p.add_argument("--piece", type=int, default=2048, help="tokens of its last piece (--prefill-chunk)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("prompt_attention: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    runs = [prompt_attention_run(f, args.context, args.piece, device, reps=args.reps)
            for f in args.formats.split(",") if f]
    base = next((r["ms_per_layer"] for r in runs if r["kv"] == "bf16"), None)
    for r in runs:
        if base:
            r["against_bf16"] = round(r["ms_per_layer"] / base, 3)
    out = {"device": torch.cuda.get_device_name(device), "runs": runs}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
