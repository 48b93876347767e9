"""Launch shapes of the GGUF block kernels (`strata/kernels/triton/blocks.py`) on the GPU (JSON).

For each matrix of a decode step (the Llama-3.1-8B shapes by default) and
each block type it times:

- `block_gemv` (one lane, with the matrix's folds) under every config of a
  grid on packed blocks, the default config on the file's layout, and the
  dense bf16 `gemv.gemv` of the same shape;
- `block_mm` for M = 16, 64 and 512 under a grid, against torch's bf16
  matmul of the dequantized weight.

Each timing replays a CUDA graph over enough copies of the weights (2 GiB)
that none is in L2 (`gemv_sweep._time`). GB/s counts the bytes of the blocks
read (the file's bytes), TFLOP/s 2 M N K. The output ends with the best
configs as `GEMV_CONFIGS` / `MM_CONFIGS` entries, and `kquant_rows.CONFIGS` ones
(`KQ_CONFIGS`) for its group-sum kernel. Results are written after
every matrix, so a run cut short keeps what it measured. The candidates are
compiled first in `--workers` processes (about 200 kernels for the default
set); the timings then run in this one.

    python -m benchmarks.block_sweep --out block.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from benchmarks.gemv_sweep import EPS, shapes

try:  # the arguments parse without Triton (a CPU machine); the sweep itself needs it and CUDA
    from benchmarks.gemv_sweep import _time
    from strata.gguf.dequant import dequantize
    from strata.kernels.triton import blocks, gemv, kquant_rows
    from strata.kernels.triton.blocks_decode import TYPES
except ImportError:
    blocks = gemv = kquant_rows = None  # type: ignore[assignment]

# gemv: (rows a program, values of a part a step (G * E), warps); runs of 8 values a thread,
# so 1,024 values fill 4 warps and each thread then holds its inputs for all the rows
GEMV_GRID = [(4, 1024, 4), (2, 1024, 4), (8, 1024, 4), (1, 1024, 4), (4, 2048, 8), (8, 2048, 8),
             (4, 512, 2), (2, 512, 2)]
# mm: (BLOCK_M, BLOCK_N, values of a part a step, warps, stages) per `blocks.m_bucket`; the
# kernel's N is no constant, so the shapes of one K share their compiled candidates
MM_GRID = {
    16: [(16, 32, 128, 4, 2), (16, 64, 128, 4, 2), (16, 32, 256, 4, 1)],
    64: [(64, 64, 128, 4, 2), (64, 128, 128, 8, 2)],
    512: [(128, 128, 128, 8, 2), (128, 128, 128, 8, 3), (256, 128, 64, 8, 2)],
}
# kquant_rows (Q4_K, Q6_K, Q8_0; bf16): (rows a thread, threads a warp along rows, warps)
KQ_GRID = [(2, 1, 2), (2, 2, 2), (4, 1, 2), (2, 1, 4), (4, 1, 4), (2, 2, 4), (4, 2, 2), (2, 4, 2)]
_F16_FIELDS = ("d", "m")
DEV = "cuda"


def random_blocks(qtype: int, n: int, k: int, copies: int) -> torch.Tensor:
    """uint8 [copies, n, row bytes] of random quants with fp16 scales near 2**-10."""
    bt = TYPES[qtype]
    nb = k // bt.block
    b = torch.randint(0, 256, (copies, n, nb, bt.size), dtype=torch.uint8, device=DEV)
    for role in _F16_FIELDS:
        if role in bt.fields:
            a = bt.fields[role][0]
            d = torch.rand(copies, n, nb, device=DEV).add_(0.5).mul_(2.0**-10).half()
            b[..., a:a + 2] = d.view(torch.uint8).view(copies, n, nb, 2)
    return b.view(copies, n, nb * bt.size)


def _us(fn, copies: int, label: str) -> float:
    try:
        return _time(fn, copies)
    except Exception as e:  # noqa: BLE001 - a config that fails is a result
        print(f"{label}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
        return float("nan")


def _block_copies(qtype: int, n: int, k: int, gib: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Raw and packed copies of random blocks, `gib` GiB of each, and the bytes of one copy."""
    bt = TYPES[qtype]
    nbytes = n * k // bt.block * bt.size
    raw = random_blocks(qtype, n, k, max(2, math.ceil(gib * 2**30 / nbytes)))
    return raw, torch.stack([blocks.pack(r, qtype) for r in raw]), nbytes


def _dense_us(fn, w0: torch.Tensor, gib: float, label: str) -> float:
    """fn(weight) over copies of the dense weight w0 [n, k] (freed on return)."""
    copies = max(2, math.ceil(gib * 2**30 / (w0.numel() * w0.element_size())))
    w = w0.expand(copies, *w0.shape).contiguous()
    return _us(lambda i: fn(w[i]), copies, label)


def _per(qtype: int, values: int, k: int) -> int:
    """Blocks a step for `values` values of each part, at most the row's (a power of 2)."""
    bt = TYPES[qtype]
    return max(1, min(values // (bt.groups * bt.group), 1 << (k // bt.block - 1).bit_length()))


def _best(configs: list[dict[str, Any]]) -> dict[str, Any] | None:
    good = [c for c in configs if c["us"] == c["us"]]
    return min(good, key=lambda c: c["us"]) if good else None


def sweep_gemv(name: str, n: int, k: int, ops: str, qtype: int, gib: float) -> dict[str, Any]:
    dev, dt = torch.device(DEV), torch.bfloat16
    raw, packed, raw_bytes = _block_copies(qtype, n, k, gib)
    copies = raw.shape[0]
    x = torch.randn(1, k, device=dev, dtype=dt)
    silu = "silu" in ops
    res = torch.randn(1, n // 2 if silu else n, device=dev, dtype=dt)
    kw: dict[str, Any] = {"norm_weight": torch.ones(k, device=dev, dtype=dt) if "norm" in ops else None,
                          "eps": EPS, "silu": silu, "residual": res if "residual" in ops else None,
                          "out_dtype": torch.float32 if "f32" in ops else None}
    row: dict[str, Any] = {"rows": n, "cols": k, "ops": ops, "type": T(qtype).name,
                           "copies": copies, "bytes": raw_bytes}
    row["raw_default_us"] = _us(lambda i: blocks.block_gemv(x, raw[i], qtype, **kw), copies, name)
    configs = []
    for bn, values, warps in GEMV_GRID:
        per = _per(qtype, values, k)
        cfg = (bn, per, warps, 1)
        if any(c["config"] == list(cfg) for c in configs):
            continue
        us = _us(lambda i: blocks.block_gemv(x, packed[i], qtype, packed=True, config=cfg, **kw),
                 copies, f"{name} {T(qtype).name} {cfg}")
        configs.append({"config": list(cfg), "us": us, "GBps": raw_bytes / us / 1e3})
    if kquant_rows.gl is not None and qtype in kquant_rows.KERNELS:
        row.update(_sweep_kq(name, x, packed, qtype, kw, raw_bytes))
    raw = packed = None
    torch.cuda.empty_cache()
    w0 = torch.randn(n, k, device=dev, dtype=dt) * k**-0.5
    row["dense_bf16_gemv_us"] = _dense_us(lambda w: gemv.gemv(x, w, **kw), w0, gib, name)
    row["configs"] = configs
    row["best"] = _best(configs)
    row["raw_default_GBps"] = raw_bytes / row["raw_default_us"] / 1e3
    if row["best"]:
        row["best_GBps"] = row["best"]["GBps"]
        row["speedup_vs_dense"] = row["dense_bf16_gemv_us"] / row["best"]["us"]
    return row


def _sweep_kq(name: str, x: torch.Tensor, packed: torch.Tensor, qtype: int, kw: dict[str, Any],
              raw_bytes: int) -> dict[str, Any]:
    """kquant_rows' group-sum kernel (a norm: its RMSNorm launch included) under KQ_GRID, and
    how far its products are from the decode-then-multiply kernel's."""
    copies = packed.shape[0]
    silu = kw["silu"]
    n = packed.shape[1] // (2 if silu else 1)
    out = torch.empty((1, n), dtype=kw["out_dtype"] or x.dtype, device=x.device)
    args = {key: kw[key] for key in ("norm_weight", "eps", "silu", "residual")}
    configs = []
    for cfg in KQ_GRID:
        us = _us(lambda i: kquant_rows.kq_gemv(x, packed[i], qtype, out=out, config=cfg, **args),
                 copies, f"{name} kq {cfg}")
        configs.append({"config": list(cfg), "us": us, "GBps": raw_bytes / us / 1e3})
    res: dict[str, Any] = {"kq_configs": configs, "kq_best": _best(configs)}
    ref = blocks.block_gemv(x, packed[0], qtype, packed=True, config=(2, 4, 4, 1), **kw).double()
    new = kquant_rows.kq_gemv(x, packed[0], qtype, out=out, **args).double()
    res["kq_max_rel_diff"] = float(((new - ref).abs() / ref.abs().clamp_min(1e-3)).max())
    res["kq_bits_equal"] = float((new == ref).double().mean())
    return res


def sweep_mm(name: str, n: int, k: int, qtype: int, m: int, gib: float) -> dict[str, Any]:
    dev, dt = torch.device(DEV), torch.bfloat16
    raw, packed, raw_bytes = _block_copies(qtype, n, k, gib)
    copies = raw.shape[0]
    x = torch.randn(m, k, device=dev, dtype=dt)
    flops = 2 * m * n * k
    row: dict[str, Any] = {"rows": n, "cols": k, "m": m, "type": T(qtype).name, "copies": copies,
                           "bytes": raw_bytes}
    row["raw_default_us"] = _us(lambda i: blocks.block_mm(x, raw[i], qtype), copies, name)
    configs = []
    for bm, bn, values, warps, stages in MM_GRID[blocks.m_bucket(m)]:
        per = _per(qtype, values, k)
        cfg = (bm, bn, per, warps, stages)
        us = _us(lambda i: blocks.block_mm(x, packed[i], qtype, packed=True, config=cfg), copies,
                 f"{name} {T(qtype).name} M={m} {cfg}")
        configs.append({"config": list(cfg), "us": us, "GBps": raw_bytes / us / 1e3,
                        "TFLOPs": flops / us / 1e6})
    w0 = dequantize(raw[0].reshape(-1), qtype, (n, k), dt)
    raw = packed = None
    torch.cuda.empty_cache()
    row["dense_bf16_matmul_us"] = _dense_us(lambda w: F.linear(x, w), w0, gib, name)
    row["configs"] = configs
    row["best"] = _best(configs)
    if row["best"]:
        row["best_TFLOPs"] = row["best"]["TFLOPs"]
        row["speedup_vs_dense"] = row["dense_bf16_matmul_us"] / row["best"]["us"]
    return row


def _launches(n: int, k: int, ops: str, qtype: int, ms: list[int]) -> list[tuple]:
    """The distinct kernels the sweep of one matrix launches, as `_compile` jobs."""
    silu = "silu" in ops
    rows = n // 2 if silu else n
    jobs = [("gemv", qtype, k, ops, blocks.default_gemv_config(rows, k, qtype, silu), False)]
    jobs += [("gemv", qtype, k, ops, (bn, _per(qtype, v, k), w, 1), True) for bn, v, w in GEMV_GRID]
    for m in [m for m in ms if m]:
        jobs.append(("mm", qtype, k, m, blocks.default_mm_config(m, n, k, qtype), False))
        jobs += [("mm", qtype, k, m, (bm, bn, _per(qtype, v, k), w, st), True)
                 for bm, bn, v, w, st in MM_GRID[blocks.m_bucket(m)]]
    return jobs


def _compile(job: tuple) -> str:
    """Launch one kernel on small operands of the same specialization (sizes that are
    multiples of 16), which puts it in Triton's cache on disk for the timing process."""
    global DEV
    kind, qtype, k, arg, cfg, packed, DEV = job
    dev, dt = DEV, torch.bfloat16
    try:
        b = random_blocks(qtype, 32, k, 1)[0]
        b = blocks.pack(b, qtype) if packed else b
        if kind == "mm":
            blocks.block_mm(torch.randn(16, k, device=dev, dtype=dt), b, qtype, packed=packed,
                            config=cfg)
        else:
            silu = "silu" in arg
            rows = 16 if silu else 32
            blocks.block_gemv(
                torch.randn(1, k, device=dev, dtype=dt), b, qtype, packed=packed, config=cfg,
                norm_weight=torch.ones(k, device=dev, dtype=dt) if "norm" in arg else None,
                eps=EPS, silu=silu, out_dtype=torch.float32 if "f32" in arg else None,
                residual=torch.zeros(1, rows, device=dev, dtype=dt) if "residual" in arg else None)
        return ""
    except Exception as e:  # noqa: BLE001 - the timing run reports it again
        return f"{job[:5]}: {type(e).__name__}: {str(e)[:120]}"


def compile_all(jobs: list[tuple], workers: int) -> None:
    """Compile the candidates in parallel processes (compiling, not timing, is what takes a
    sweep's minutes); the timings then load them from the cache, one process on the GPU."""
    import multiprocessing

    jobs = sorted(set(jobs), key=str)
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for msg in pool.imap_unordered(_compile, [j + (DEV,) for j in jobs]):
            if msg:
                print(f"compile {msg}", file=sys.stderr, flush=True)
    print(f"compiled {len(jobs)} kernels", file=sys.stderr, flush=True)


def sweep(types: list[int], ms: list[int], only: str, gib: float, out: str | None,
          hidden: int = 4096, inter: int = 14336, qkv: int = 6144, vocab: int = 49152,
          workers: int = 0) -> dict[str, Any]:
    mats = {name: v for name, v in shapes(hidden, inter, qkv, vocab).items()
            if not only or name in only.split(",")}
    if workers:
        compile_all([j for n, k, ops in mats.values() for q in types
                     for j in _launches(n, k, ops, q, ms)], workers)
    res: dict[str, Any] = {"gemv": [], "mm": []}
    gemv_cfgs: dict[str, list[int]] = {}
    mm_cfgs: dict[str, list[int]] = {}
    kq_cfgs: dict[str, list[int]] = {}
    for name, (n, k, ops) in mats.items():
        for qtype in types:
            tname = T(qtype).name
            for m in [m for m in ms if m]:
                r = sweep_mm(name, n, k, qtype, m, gib)
                res["mm"].append(r)
                if r["best"]:
                    mm_cfgs[f"({blocks.m_bucket(m)}, {n}, {k}, T.{tname})"] = r["best"]["config"]
                print(json.dumps({key: v for key, v in r.items() if key != "configs"}),
                      file=sys.stderr, flush=True)
            r = sweep_gemv(name, n, k, ops, qtype, gib)
            res["gemv"].append(r)
            key = f"({n // (2 if 'silu' in ops else 1)}, {k}, T.{tname})"
            if r["best"]:
                gemv_cfgs[key] = r["best"]["config"]
            if r.get("kq_best"):
                kq_cfgs[key] = r["kq_best"]["config"]
            print(json.dumps({key: v for key, v in r.items() if key != "configs"}), file=sys.stderr,
                  flush=True)
            res["GEMV_CONFIGS"], res["MM_CONFIGS"], res["KQ_CONFIGS"] = gemv_cfgs, mm_cfgs, kq_cfgs
            if out:
                with open(out, "w") as f:
                    f.write(json.dumps(res, indent=1) + "\n")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--types", default="Q4_K,Q6_K,Q8_0", help="comma-separated block types")
    p.add_argument("--m", default="16,64,512", help="block_mm row counts (0: none)")
    p.add_argument("--only", default="", help="comma-separated names: qkv,o,gate_up,down,head")
    p.add_argument("--gib", type=float, default=2.0, help="weight copies rotated per timing")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--qkv", type=int, default=6144)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--out", default=None)
    p.add_argument("--workers", type=int, default=12, help="processes compiling first (0: none)")
    a = p.parse_args(argv)
    if blocks is None or not torch.cuda.is_available():
        p.error("the sweep needs Triton and a CUDA device")
    types = [int(T[t]) for t in a.types.split(",")]
    res = sweep(types, [int(m) for m in a.m.split(",")], a.only, a.gib, a.out, a.hidden,
                a.intermediate, a.qkv, a.vocab, a.workers)
    print(json.dumps({key: res[key] for key in ("GEMV_CONFIGS", "MM_CONFIGS", "KQ_CONFIGS")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
