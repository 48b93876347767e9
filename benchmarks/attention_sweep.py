"""Decode attention alone on the GPU, for `benchmarks.gpu_bench`: one layer per KV format, and a
sweep of the decode kernel's launch configs (`--attention`, `--sweep-decode`)."""

from __future__ import annotations

import itertools
import json
import sys
from typing import TYPE_CHECKING, Any

import torch

from strata.kv.step import SeqSpec

if TYPE_CHECKING:
    from strata.kv.formats import KvFormat
    from strata.kv.pool import KvPool


def random_pool(fmt_name: str, lanes: int, context: int, device: torch.device, kv_heads: int,
                head_dim: int) -> tuple[KvFormat, KvPool]:
    """(format, a one-layer pool of `lanes` lanes of `context` cells) with random cells: a timing
    never reads zeros."""
    from strata.kv.formats import make_format
    from strata.kv.pool import KvPool

    fmt = make_format(fmt_name, kv_heads, head_dim)
    pool = KvPool(fmt, 1, lanes, context + 1, 4096, None, device)
    for t in pool.layers[0].values():
        if t.is_floating_point():
            t.copy_(torch.rand_like(t))
        else:
            t.copy_(torch.randint_like(t, 0, 100))
    return fmt, pool


def attention_run(fmt_name: str, lanes: int, context: int, device: torch.device,
                  heads: int = 32, kv_heads: int = 8, head_dim: int = 128, reps: int = 20) -> dict:
    """Decode attention alone (one layer, Llama-3.1-8B heads) over full contexts: time and bytes/s.

    The time covers the whole `attend` (write, attention, output rotation),
    replayed from a CUDA graph so that it is device time, not launch cost.
    """
    from strata.attention.triton_pool import GpuTableAttention

    fmt, pool = random_pool(fmt_name, lanes, context, device, kv_heads, head_dim)
    seqs = [SeqSpec(i, context - 1, 1) for i in range(lanes)]
    ctx = GpuTableAttention(pool, seqs, head_dim**-0.5)
    q = torch.randn(lanes, heads, head_dim, device=device, dtype=torch.bfloat16)
    kv = torch.randn(lanes, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        ctx.attend(0, q, kv, kv)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()  # replayed: launch costs out of the figure, as in a decode graph
    with torch.cuda.graph(graph):
        for _ in range(reps):
            ctx.attend(0, q, kv, kv)
    graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    us = start.elapsed_time(end) / (3 * reps) * 1e3
    read = lanes * context * fmt.cell_bytes()
    return {"kv": fmt_name, "lanes": lanes, "context": context, "us_per_layer": us,
            "cell_bytes_read": read, "TBps": read / us / 1e6}


def _kinds(fmt_name: str) -> tuple[int, int]:
    """The (K kind, V kind) key of `decode.CONFIGS` for a format."""
    from strata.attention.layout import halves
    from strata.kv.formats import make_format

    fmt = make_format(fmt_name, 1, 128)
    k, v = halves(fmt, fmt.allocate(1, "cpu"))
    return k.kind, v.kind


def sweep_decode(fmt_name: str, device: torch.device, shapes: tuple[tuple[int, int], ...] = (
        (1, 32768), (64, 4096)), reps: int = 20) -> list[dict]:
    """Decode attention alone under every launch config of `decode.CONFIGS`' search space."""
    from strata.kernels.triton import decode

    rows = []
    key = _kinds(fmt_name)
    saved = dict(decode.CONFIGS)
    try:
        for block_n, warps, stages in itertools.product((64, 128), (4, 8), (1, 2)):
            decode.CONFIGS[key] = decode.DecodeConfig(block_n, warps, stages)
            row: dict[str, Any] = {"kv": fmt_name, "block_n": block_n, "num_warps": warps,
                                   "num_stages": stages}
            for lanes, context in shapes:
                try:
                    row[f"us_{lanes}x{context}"] = attention_run(fmt_name, lanes, context, device,
                                                                 reps=reps)["us_per_layer"]
                except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result
                    row[f"us_{lanes}x{context}"] = f"{type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        decode.CONFIGS.clear()
        decode.CONFIGS.update(saved)
    return rows
