"""Decode with streamed K/V (`--kv-resident`) on the GPU: overlap on, overlap off, fully resident (JSON).

    python -m strata.bench.gpu_stream_bench MODEL.gguf [--lanes 1,4] [--contexts 8192,32768]
        [--resident 4096] [--warm 2] [--steps 8] [--kv auto] [--out result.json]

Through `strata.engine.Engine` on one GGUF file (the 8B-shaped random file of
`strata.bench.synth`): for each lane count and context, the lanes' first
`context` positions hold random K/V (written straight into the pool, so no
long prompt is read: decode speed does not depend on the values), then
`steps` decode steps of all lanes are timed through the engine's runner
(the model's forward with its attention context, synchronized after each
step), after `warm` untimed ones. Three pools:

- `resident`: everything on the device (Triton kernels over the pool, eager);
- `overlap`: `--kv-resident N`, misses copied on the copy stream while earlier
  layers compute (kv/gpu_stream.py);
- `no_overlap`: the same pool, each layer's misses copied, then waited for.

Per row: ms per step, decode tokens/s, block hit rate, host -> device bytes per
step, and the overlap's gain over no overlap.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.kv.attention import SeqSpec
from strata.kv.pool import KvPool
from strata.kv.stream import StreamStore

TILE = 4096  # cells of random K/V repeated through the pool


def fill(pool: KvPool, seed: int = 0) -> None:
    """Every cell of every layer: a tile of valid random cells (the format's own write), repeated."""
    fmt = pool.fmt
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(TILE, fmt.n_kv_heads, fmt.head_dim, generator=gen)
    v = torch.randn(TILE, fmt.n_kv_heads, fmt.head_dim, generator=gen)
    tile = fmt.allocate(TILE, "cpu")
    fmt.write(tile, torch.arange(TILE), k, v)
    for st in pool.layers:
        for name, t in st.items():
            src = tile[name].to(t.device)
            n = t.shape[0]
            full = n // TILE * TILE
            t[:full].view(n // TILE, TILE, *t.shape[1:]).copy_(src.expand(n // TILE, *src.shape))
            t[full:].copy_(src[: n - full])
    if isinstance(pool.store, StreamStore):
        pool.store.invalidate()
    _sync(pool.device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_decode(engine: Engine, lanes: int, context: int, warm: int, steps: int) -> dict[str, Any]:
    """Synchronized wall time of `steps` decode steps of `lanes` lanes from position `context`."""
    pool, runner = engine.pool, engine.runner
    store = pool.store if isinstance(pool.store, StreamStore) else None
    dev = engine.device
    before: dict[str, Any] = {}
    elapsed: list[float] = []
    for j in range(warm + steps):
        pos = context + j
        for i in range(lanes):
            assert pool.reserve(i, pos + 1), "pool too small"
        seqs = [SeqSpec(i, pos, 1) for i in range(lanes)]
        if j == warm and store is not None:
            before = store.stats.as_dict()
        _sync(dev)
        t0 = time.perf_counter()
        logits = runner.forward(seqs, [100 + i for i in range(lanes)], [True] * lanes)
        logits.argmax(-1).tolist()  # as the engine's sampler: the step's result on the host
        if j >= warm:
            elapsed.append(time.perf_counter() - t0)
    ms = 1e3 * sum(elapsed) / len(elapsed)
    out: dict[str, Any] = {"ms_per_step": ms, "decode_tokens_per_s": lanes / ms * 1e3,
                           "ms_per_step_min": 1e3 * min(elapsed), "ms_per_step_max": 1e3 * max(elapsed)}
    if store is not None:
        after = store.stats.as_dict()
        d = {k: after[k] - before[k] for k in ("lookups", "hits", "bytes_copied", "overflow_bytes")}
        out.update(hit_rate=d["hits"] / d["lookups"] if d["lookups"] else 1.0,
                   host_to_device_bytes_per_step=(d["bytes_copied"] + d["overflow_bytes"]) / steps,
                   host_to_device_GBps=(d["bytes_copied"] + d["overflow_bytes"]) / steps / ms / 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--lanes", default="1,4")
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--resident", type=int, default=4096, help="--kv-resident: cells per layer cached")
    p.add_argument("--kv", default="auto")
    p.add_argument("--kv-chunk", type=int, default=4096)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--modes", default="resident,overlap,no_overlap")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    lanes = [int(x) for x in args.lanes.split(",") if x]
    contexts = [int(x) for x in args.contexts.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    from strata.bench.gpu_bench import attach_tokenizer
    from strata.models import load_model

    t_start = time.perf_counter()
    out: dict[str, Any] = {"model": args.model, "resident_cells": args.resident, "lanes": lanes,
                           "contexts": contexts, "warm": args.warm, "steps": args.steps, "rows": []}

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps(out, indent=1) + "\n")

    t0 = time.perf_counter()
    loaded = load_model(args.model, args.device, "auto", progress=False)
    attach_tokenizer(loaded)
    out["load_seconds"] = time.perf_counter() - t0
    if torch.cuda.is_available():
        out["device_name"] = torch.cuda.get_device_name(0)
    max_context = max(contexts) + args.warm + args.steps + 16
    results: dict[tuple[int, int], dict[str, Any]] = {}
    groups = [("resident", ["resident"])] if "resident" in modes else []
    streamed = [m for m in modes if m != "resident"]
    if streamed:
        groups.append(("streamed", streamed))
    for kind, group in groups:
        cfg = EngineConfig(model=args.model, device=args.device, parallel=max(lanes),
                           max_context=max_context, kv_chunk=args.kv_chunk, kv=args.kv,
                           kv_resident=args.resident if kind == "streamed" else None,
                           max_queued=4, pipeline="off")
        t0 = time.perf_counter()
        with Engine(cfg, loaded=loaded) as engine:
            engine.runner.graphs = None  # eager in all three: the streamed path has no graphs
            out[f"{kind}_setup_seconds"] = time.perf_counter() - t0
            out[f"{kind}_attention"] = engine.runner.context.__name__
            out["kv_format"] = engine.pool.fmt.name
            t0 = time.perf_counter()
            fill(engine.pool)
            out[f"{kind}_fill_seconds"] = time.perf_counter() - t0
            if isinstance(engine.pool.store, StreamStore):
                f = engine.pool.store.figures()
                out["streamed_pool"] = {k: f[k] for k in ("resident_cells", "block_cells",
                                                          "host_bytes", "pinned_bytes")}
            for n in lanes:
                for c in contexts:
                    for mode in group:
                        if isinstance(engine.pool.store, StreamStore):
                            engine.pool.store.overlap = mode == "overlap"
                        for i in range(n):  # every mode starts from the same positions
                            engine.pool.release(i)
                        t0 = time.perf_counter()
                        try:
                            r = time_decode(engine, n, c, args.warm, args.steps)
                        except Exception as e:  # noqa: BLE001 - a benchmark reports, it does not stop
                            r = {"error": f"{type(e).__name__}: {e}"}
                        r["seconds"] = time.perf_counter() - t0
                        results.setdefault((n, c), {"lanes": n, "context": c})[mode] = r
                        print(json.dumps({"lanes": n, "context": c, "mode": mode, **r}),
                              file=sys.stderr, flush=True)
                        out["rows"] = list(results.values())
                        save()
            if isinstance(engine.pool.store, StreamStore):
                out["streamed_figures"] = engine.pool.store.figures()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for row in results.values():
        on, off, res = (row.get(m, {}).get("ms_per_step") for m in ("overlap", "no_overlap", "resident"))
        if on and off:
            row["overlap_speedup"] = off / on
            row["overlap_saves_ms_per_step"] = off - on
        if on and res:
            row["overlap_over_resident_time"] = on / res
    out["rows"] = list(results.values())
    out["seconds"] = time.perf_counter() - t_start
    save()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
