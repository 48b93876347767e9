"""Decode speed with KV streaming (`--kv-resident`) against everything resident (JSON).

    python -m benchmarks.stream_bench [--contexts 512,2048,8000] [--resident 2048]
        [--block 64] [--kv bf16] [--steps 16] [--threads 1] [--attention-only] [--device cpu]

For each context length one lane decodes with its first `context` positions
holding random K/V (speed does not depend on their values, and filling them
directly skips a long prompt read), once with a plain pool and once with the
same pool streamed through a block cache of `--resident` cells per layer.
Reported per token: time, block hit rate, bytes copied into the cache and
bytes copied straight from the host store for reads the cache cannot hold.

By default the default model decodes (CPU). `--attention-only` times just the
attention of every layer at the default model's shape with random q/k/v: no
weights needed, so it runs on a GPU machine too (`--device cuda`), where the
host store is pinned and the copies cross PCIe. On the CPU both buffers are
host memory, so the figures show the bookkeeping and copy cost of streaming.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from strata.attention.reference import TableAttention
from strata.bench.report import emit
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec
from strata.kv.stream import StreamedPool, StreamStore

FILL_PIECE = 1024  # cells written per call while filling
CHUNK = 4096  # the engine's default --kv-chunk (a multiple of the block, so blocks keep their size)


@dataclass(frozen=True)
class Shape:
    layers: int = 30  # the default model, SmolLM2-135M
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    max_positions: int = 8192


Step = Callable[[KvPool, int], None]  # one decode step at a position


def _fill(pool: KvPool, context: int, shape: Shape, device: torch.device) -> None:
    """Random K/V at positions [0, context) of lane 0."""
    gen = torch.Generator().manual_seed(context)
    assert pool.reserve(0, context + 1)
    for start in range(0, context, FILL_PIECE):
        end = min(context, start + FILL_PIECE)
        cells = pool.cells_of_range(0, start, end).to(device)
        for layer in range(shape.layers):
            k, v = (torch.randn(end - start, shape.kv_heads, shape.head_dim, generator=gen)
                    .to(device, torch.bfloat16) for _ in range(2))
            pool.write(layer, cells, k, v)


def model_step(loaded: Any) -> Step:
    """A decode step of the model (greedy, feeding its own tokens)."""
    cfg, model = loaded.config, loaded.model
    state = {"tok": 100}

    def step(pool: KvPool, pos: int) -> None:
        seqs = [SeqSpec(0, pos, 1)]
        ctx = TableAttention(pool, seqs, cfg.attn_scale)
        hidden = model(torch.tensor([state["tok"]]), torch.tensor([pos]), ctx)
        state["tok"] = int(model.compute_logits(hidden)[-1].argmax())

    return step


def attention_step(shape: Shape, device: torch.device) -> Step:
    """A decode step of attention alone: every layer writes one cell and reads the lane's cells."""
    gen = torch.Generator().manual_seed(0)

    def rand(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=gen).to(device, torch.bfloat16)

    def step(pool: KvPool, pos: int) -> None:
        ctx = TableAttention(pool, [SeqSpec(0, pos, 1)], shape.head_dim**-0.5)
        for layer in range(shape.layers):
            q = rand(1, shape.heads, shape.head_dim)
            k, v = rand(1, shape.kv_heads, shape.head_dim), rand(1, shape.kv_heads, shape.head_dim)
            ctx.attend(layer, q, k, v)

    return step


@torch.inference_mode()
def _decode(step: Step, pool: KvPool, context: int, warm: int, steps: int,
            device: torch.device) -> dict[str, Any]:
    """Time per token of `steps` decode steps after `warm` untimed ones; streaming figures."""
    store = pool.store if isinstance(pool, StreamedPool) else None
    before: dict[str, Any] = {}
    elapsed = 0.0
    for i in range(warm + steps):
        if i == warm and isinstance(store, StreamStore):
            before = store.stats.as_dict()
        assert pool.reserve(0, context + i + 1)
        t0 = time.perf_counter()
        step(pool, context + i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warm:
            elapsed += time.perf_counter() - t0
    out: dict[str, Any] = {"ms_per_token": 1e3 * elapsed / steps}
    if isinstance(store, StreamStore):
        after = store.stats.as_dict()
        d = {k: after[k] - before[k] for k in ("lookups", "hits", "bytes_copied", "overflow_bytes")}
        out.update(
            hit_rate=d["hits"] / d["lookups"] if d["lookups"] else 1.0,
            block_lookups_per_token=d["lookups"] / steps,
            bytes_copied_per_token=d["bytes_copied"] / steps,
            overflow_bytes_per_token=d["overflow_bytes"] / steps,
            host_to_device_bytes_per_token=(d["bytes_copied"] + d["overflow_bytes"]) / steps,
            host_bytes=store.host_bytes(),
            pinned_bytes=store.figures()["pinned_bytes"],
            device_bytes=store.cache_bytes(),
        )
    return out


def run(contexts: list[int], resident: int, block: int, kv: str, warm: int, steps: int,
        attention_only: bool, device: torch.device) -> dict[str, Any]:
    t0 = time.perf_counter()
    result: dict[str, Any] = {"device": str(device), "kv": kv, "resident_cells": resident,
                              "block_cells": block, "threads": torch.get_num_threads(),
                              "torch": torch.__version__, "steps": steps}
    if attention_only:
        shape = Shape(max_positions=1 << 20)  # no RoPE table here: any context
        step = attention_step(shape, device)
        result["what"] = "attention only, default model's shape, random q/k/v"
    else:
        from benchmarks.kv_quality import load

        loaded = load()
        cfg = loaded.config
        shape = Shape(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.max_position_embeddings)
        step = model_step(loaded)
        result.update(what="model decode", model=loaded.name, dtype=str(loaded.dtype))
    fmt = make_format(kv, shape.kv_heads, shape.head_dim)
    rows = []
    for context in contexts:
        max_context = context + warm + steps + 1
        if max_context > shape.max_positions:
            raise ValueError(f"context {context} + {warm + steps} steps is past the model's "
                             f"{shape.max_positions} positions")
        args = (fmt, shape.layers, 1, max_context, CHUNK, None)
        row: dict[str, Any] = {"context": context}
        for mode in ("resident", "streamed"):
            if mode == "resident":
                pool = KvPool(*args, device=device)
            else:
                pool = StreamedPool(*args, device=device, resident_cells=resident,
                                    block_cells=block)
            _fill(pool, context, shape, device)
            row[mode] = _decode(step, pool, context, warm, steps, device)
            del pool
        ratio = row["streamed"]["ms_per_token"] / row["resident"]["ms_per_token"]
        row["streamed_over_resident_time"] = ratio
        rows.append(row)
    result["rows"] = rows
    result["seconds"] = time.perf_counter() - t0
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.stream_bench",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,2048,8000", help="comma-separated context lengths")
    ap.add_argument("--resident", type=int, default=2048,
                    help="--kv-resident: cells per layer cached")
    ap.add_argument("--block", type=int, default=64, help="cells per streamed block")
    ap.add_argument("--kv", default="bf16", help="cell format")
    ap.add_argument("--warm", type=int, default=3, help="untimed decode steps first")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--attention-only", action="store_true",
                    help="time attention alone at the default model's shape (no weights needed)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (cuda needs --attention-only)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cpu" and not args.attention_only:
        ap.error("the model decode runs on the CPU; use --attention-only on a GPU")
    torch.set_num_threads(args.threads)
    contexts = [int(x) for x in args.contexts.split(",")]
    result = run(contexts, args.resident, args.block, args.kv, args.warm, args.steps,
                 args.attention_only, device)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
