"""Decode with streamed K/V (`--kv-resident`) on the GPU: overlap on, overlap off, fully resident (JSON).

    python -m benchmarks.gpu_stream_bench MODEL.gguf [--lanes 1,4] [--contexts 8192,32768]
        [--resident 4096] [--warm 2] [--steps 8] [--kv auto] [--modes ...] [--out result.json]

Through `strata.engine.Engine` on one GGUF file (the 8B-shaped random file of
`tools.synth`): for each lane count and context, the lanes' first
`context` positions hold random K/V (written straight into the pool, so no
long prompt is read: decode speed does not depend on the values), then
`steps` decode steps of all lanes are timed through the engine's runner
(the model's forward with its attention context, synchronized after each
step), after `warm` untimed ones. Modes (`--modes`), over three pools:

- `resident`: everything on the device (Triton kernels over the pool), eager:
  the same host launch cost as the streamed modes, so the fair comparison;
- `resident_graphs`: the same pool through the engine's CUDA graphs (what a
  resident engine really does; the streamed path has no graphs);
- `overlap`: `--kv-resident N`, each layer's misses copied by one gather launch
  (kernels/triton/gather.py) on the copy stream while earlier layers compute;
- `no_overlap`: the same pool and launches, each layer's misses copied, then
  waited for (same host cost as `overlap`: only the device-side waits differ);
- `overlap_copy`, `no_overlap_copy`: the same with the `copy_` fallback (one
  `copy_` per run of blocks: the path before the gather kernel);
- `all_resident`: a streamed pool whose cache holds every lane's context
  (hit rate 1.0 after the warm-up steps): the streamed path's own overhead.

Per mode: ms per step (synchronized wall time), decode tokens/s, host ms (until
the forward returned: launch time), tail ms (wall - host: the device's work
left when the host was done; near 0 means host-bound), and for streamed pools
the block hit rate, host -> device bytes per step and GB/s over the wall time,
the copy stream's busy ms per step (CUDA events around each layer's copies)
and GB/s over that. Per row: the overlap's gain over no overlap, and streamed
over resident time.
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
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec
from strata.kv.stream import StreamedPool

MODES = ("resident", "resident_graphs", "overlap", "no_overlap", "overlap_copy", "no_overlap_copy",
         "all_resident")
STREAMED = {  # mode -> (overlap, gather: None = the kernel where it runs, False = copy_)
    "overlap": (True, None), "no_overlap": (False, None),
    "overlap_copy": (True, False), "no_overlap_copy": (False, False),
    "all_resident": (True, None),
}

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
    if isinstance(pool, StreamedPool):
        pool.store.invalidate()
    _sync(pool.device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_decode(engine: Engine, lanes: int, context: int, warm: int, steps: int) -> dict[str, Any]:
    """Synchronized wall time of `steps` decode steps of `lanes` lanes from position `context`,
    with the host's share (until the forward returned) and the copy stream's busy time."""
    pool, runner = engine.pool, engine.runner
    store = pool.store if isinstance(pool, StreamedPool) else None
    state = store.copies if store is not None and engine.device.type == "cuda" else None
    dev = engine.device
    before: dict[str, Any] = {}
    elapsed: list[float] = []
    host: list[float] = []
    copy_ms: list[float] = []
    if state is not None:
        state.timing = True
        state.copy_ms()
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
        t1 = time.perf_counter()
        logits.argmax(-1).tolist()  # as the engine's sampler: the step's result on the host
        t2 = time.perf_counter()
        copied = state.copy_ms() if state is not None else 0.0  # (the step's copies are done)
        if j >= warm:
            elapsed.append(t2 - t0)
            host.append(t1 - t0)
            copy_ms.append(copied)
    if state is not None:
        state.timing = False
    n = len(elapsed)
    ms = 1e3 * sum(elapsed) / n
    host_ms = 1e3 * sum(host) / n
    out: dict[str, Any] = {"ms_per_step": ms, "decode_tokens_per_s": lanes / ms * 1e3,
                           "ms_per_step_min": 1e3 * min(elapsed), "ms_per_step_max": 1e3 * max(elapsed),
                           "host_ms_per_step": host_ms, "tail_ms_per_step": ms - host_ms}
    if store is not None:
        after = store.stats.as_dict()
        d = {k: after[k] - before[k] for k in ("lookups", "hits", "bytes_copied", "overflow_bytes")}
        moved = (d["bytes_copied"] + d["overflow_bytes"]) / steps
        out.update(hit_rate=d["hits"] / d["lookups"] if d["lookups"] else 1.0,
                   host_to_device_bytes_per_step=moved,
                   host_to_device_GBps=moved / ms / 1e6,
                   gather=bool(state.use_gather()) if state is not None else False)
        if state is not None:
            cms = sum(copy_ms) / n
            out.update(copy_stream_ms_per_step=cms,
                       copy_stream_GBps=moved / cms / 1e6 if cms > 0 else None)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_stream_bench",
                                description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--lanes", default="1,4")
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--resident", type=int, default=4096, help="--kv-resident: cells per layer cached")
    p.add_argument("--kv", default="auto")
    p.add_argument("--kv-chunk", type=int, default=4096)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--modes", default=",".join(MODES), help=f"some of {','.join(MODES)}")
    p.add_argument("--gather-programs", type=int, default=0,
                   help="programs of a gather launch (0: STRATA_GATHER_PROGRAMS or the SM count)")
    p.add_argument("--out", default=None)
    return p


def engine_rows(args: Any, loaded: Any, kind: str, group: list[str], resident: int | None,
                max_context: int, out: dict[str, Any], results: dict[tuple[int, int], dict[str, Any]],
                save: Any) -> None:
    """One engine (`kind`: its pool) and every mode of `group` on it, per lane count and context."""
    lanes = [int(x) for x in args.lanes.split(",") if x]
    contexts = [int(x) for x in args.contexts.split(",") if x]
    cfg = EngineConfig(model=args.model, device=args.device, parallel=max(lanes),
                       max_context=max_context, kv_chunk=args.kv_chunk, kv=args.kv,
                       kv_resident=resident, max_queued=4, pipeline="off")
    t0 = time.perf_counter()
    with Engine(cfg, loaded=loaded) as engine:
        graphs = engine.runner.graphs  # the streamed path has none
        out[f"{kind}_setup_seconds"] = time.perf_counter() - t0
        out[f"{kind}_attention"] = engine.runner.context.__name__
        out["kv_format"] = engine.pool.fmt.name
        t0 = time.perf_counter()
        fill(engine.pool)
        out[f"{kind}_fill_seconds"] = time.perf_counter() - t0
        store = engine.pool.store if isinstance(engine.pool, StreamedPool) else None
        if store is not None:
            f = store.figures()
            out[f"{kind}_pool"] = {k: f[k] for k in ("resident_cells", "block_cells",
                                                     "host_bytes", "pinned_bytes")}
            if args.gather_programs:
                store.copies.programs = args.gather_programs
        for n in lanes:
            for c in contexts:
                for mode in group:
                    engine.runner.graphs = graphs if mode == "resident_graphs" else None
                    if store is not None:
                        store.overlap, store.gather = STREAMED[mode]
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
        engine.runner.graphs = graphs
        if store is not None:
            out[f"{kind}_figures"] = store.figures()


def compare(row: dict[str, Any]) -> None:
    """A row's ratios: the overlap's gain, the gather kernel's over `copy_`, streamed over resident."""
    ms = {m: row[m]["ms_per_step"] for m in MODES if row.get(m, {}).get("ms_per_step")}
    for on, off, key in (("overlap", "no_overlap", ""), ("overlap_copy", "no_overlap_copy", "_copy")):
        if on in ms and off in ms:
            row[f"overlap_speedup{key}"] = ms[off] / ms[on]
            row[f"overlap_saves_ms_per_step{key}"] = ms[off] - ms[on]
    for m in ("overlap", "no_overlap"):
        if m in ms and f"{m}_copy" in ms:
            row[f"gather_speedup_{m}"] = ms[f"{m}_copy"] / ms[m]
    for base in ("resident", "resident_graphs"):
        if base in ms:
            for m in ("overlap", "overlap_copy", "all_resident"):
                if m in ms:
                    row[f"{m}_over_{base}_time"] = ms[m] / ms[base]


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    lanes = [int(x) for x in args.lanes.split(",") if x]
    contexts = [int(x) for x in args.contexts.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown modes {bad}: pick from {MODES}")
    from benchmarks.engine_runs import attach_tokenizer
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
    # a cache holding every lane's whole context (rounded up to whole chunks)
    all_cells = max(lanes) * -(-max_context // args.kv_chunk) * args.kv_chunk
    groups = [(kind, [m for m in group if m in modes]) for kind, group in (
        ("resident", ["resident", "resident_graphs"]),
        ("streamed", ["overlap", "no_overlap", "overlap_copy", "no_overlap_copy"]),
        ("all_resident", ["all_resident"]))]
    for kind, group in groups:
        if not group:
            continue
        resident = {"resident": None, "streamed": args.resident, "all_resident": all_cells}[kind]
        engine_rows(args, loaded, kind, group, resident, max_context, out, results, save)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for row in results.values():
        compare(row)
    out["rows"] = list(results.values())
    out["seconds"] = time.perf_counter() - t_start
    save()
    print(json.dumps(out, indent=1))
    return 0

if __name__ == "__main__":
    sys.exit(main())
