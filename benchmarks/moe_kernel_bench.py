"""Time of the fused MoE kernels (`strata/kernels/triton/moe.py`, `moe_blocks.py`) per layer (JSON).

For the Qwen3-30B-A3B layer (H 2048, I 768, 128 experts, 8 a token) and T = 1,
16, 64 and 512 tokens of random routing, it times `moe` on bf16 experts and
`moe_blocks` on Q4_K gate/up with Q6_K down (packed, as llama.cpp's Q4_K_M
files hold them), the whole call and each of its four launches, each replayed
from a CUDA graph over enough copies of the weights that none is in L2
(`gemv_sweep._time`). GB/s counts the bytes of the experts the routing chose
(each read once), over the whole call's time.

    python -m benchmarks.moe_kernel_bench --out moe.json

`--mapped` adds, for T = 1 and 16, the same call with every expert read in place from
pinned host memory (`--expert-misses mapped` with no expert in a slot: `moe.Mapped`), over
host copies of about `--gib` too, so its GB/s is what the kernels read across the bus.

`--shape tiny` (H 256, I 256, 8 experts, 2 a token, T = 1 and 4) runs anywhere the kernels
do, the CPU under TRITON_INTERPRET=1 too (wall-clock time of one call, no graphs): a smoke run.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any, Callable

import torch
from gguf import GGMLQuantizationType as T

from strata.kernels.triton import moe, moe_blocks
from strata.kernels.triton.blocks_decode import TYPES, pack
from strata.kernels.triton.gemv import INTERPRET

SHAPES = {"qwen3-30b-a3b": dict(h=2048, i=768, e=128, k=8, tokens=(1, 16, 64, 512)),
          "tiny": dict(h=256, i=256, e=8, k=2, tokens=(1, 4))}
GATE_UP_TYPE, DOWN_TYPE = T.Q4_K, T.Q6_K


def _time(fn: Callable[[int], Any], copies: int, graphs: bool) -> float:
    """Milliseconds per call of fn(i) over the weight copies i."""
    if graphs:
        from benchmarks.gemv_sweep import _time as graph_time

        return graph_time(fn, copies) / 1e3
    fn(0)
    start = time.perf_counter()
    fn(0)
    return (time.perf_counter() - start) * 1e3


def random_blocks(qtype: int, rows: int, k: int, dev: str) -> torch.Tensor:
    """Packed uint8 rows of random quants with fp16 scales near 2**-10."""
    bt = TYPES[qtype]
    nb = k // bt.block
    b = torch.randint(0, 256, (rows, nb, bt.size), dtype=torch.uint8, device=dev)
    for role in ("d", "m"):
        if role in bt.fields:
            a = bt.fields[role][0]
            d = (torch.rand(rows, nb, device=dev) + 0.5) * 2.0**-10
            b[..., a:a + 2] = d.half().view(torch.uint8).view(rows, nb, 2)
    return pack(b.view(rows, nb * bt.size), qtype)


def routing(t: int, e: int, k: int, dev: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(t, e, generator=g)
    w, ids = scores.topk(k, dim=1)
    return ids.to(dev, torch.int32), torch.softmax(w, dim=1).to(dev, torch.bfloat16)


def mapped_row(kind: str, ws: list[tuple], t: int, h: int, i: int, e: int, k: int, per_expert: int,
               dev: str, graphs: bool) -> dict[str, Any]:
    """One call with every expert read from a pinned host copy (no slot holds one)."""
    from strata.models.block_experts import BlockMath
    from strata.models.moe import DenseMath

    pin = dev == "cuda"
    hosts = [tuple(w.cpu().pin_memory() if pin else w.cpu() for w in c) for c in ws]
    if kind == "bf16":
        math, views = DenseMath(), hosts
    else:
        math = BlockMath((GATE_UP_TYPE, GATE_UP_TYPE, DOWN_TYPE), True)
        views = [tuple(w.view(e, -1, w.shape[1]) for w in c) for c in hosts]
    slots = [w[:1].to(dev) for w in views[0]]  # one slot, never used: the table maps none
    table = torch.full((e,), -1, dtype=torch.int64, device=dev)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    ids, w = routing(t, e, k, dev, seed=t)
    cfg = moe.default_config(t, e, h, i, k, x.dtype)
    ms = _time(lambda c: math.mapped(x, slots, views[c], table, ids, w, cfg), len(views), graphs)
    read = int(torch.unique(ids).numel()) * per_expert
    return {"weights": kind, "reads": "host", "T": t, "H": h, "I": i, "E": e, "k": k, "config": list(cfg),
            "ms": ms, "weight_bytes": read, "GB/s": read / (ms * 1e-3) / 1e9, "graphs": graphs}


def bench(shape: str, gib: float, mapped: bool = False) -> list[dict[str, Any]]:
    s = SHAPES[shape]
    h, i, e, k = s["h"], s["i"], s["e"], s["k"]
    dev = "cpu" if INTERPRET else "cuda"
    graphs = not INTERPRET
    dense_bytes = 3 * i * h * 2  # one expert's gate, up and down in bf16
    block_bytes = (2 * i * (h // TYPES[GATE_UP_TYPE].block) * TYPES[GATE_UP_TYPE].size
                   + h * (i // TYPES[DOWN_TYPE].block) * TYPES[DOWN_TYPE].size)
    results: list[dict[str, Any]] = []
    for kind, per_expert in (("bf16", dense_bytes), ("Q4_K/Q6_K", block_bytes)):
        copies = 1 if not graphs else max(2, math.ceil(gib * 2**30 / (e * per_expert)))
        if kind == "bf16":
            ws = [tuple(torch.randn(e, n, c, device=dev, dtype=torch.bfloat16) * c**-0.5
                        for n, c in ((i, h), (i, h), (h, i))) for _ in range(copies)]
        else:
            ws = [(random_blocks(GATE_UP_TYPE, e * i, h, dev),
                   random_blocks(GATE_UP_TYPE, e * i, h, dev),
                   random_blocks(DOWN_TYPE, e * h, i, dev)) for _ in range(copies)]
        for t in s["tokens"]:
            x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
            ids, w = routing(t, e, k, dev, seed=t)
            cfg = moe.default_config(t, e, h, i, k, x.dtype)
            bm, bn_gu, bn_d, warps, stages = cfg
            aligned = moe.align(ids, e, bm)
            kw = dict(warps=warps, stages=stages)
            if kind == "bf16":
                def call(c: int) -> Any:
                    return moe.moe(x, *ws[c], ids, w, config=cfg)

                def gate_up(c: int) -> Any:
                    return moe.expert_gate_up(x, ws[c][0], ws[c][1], aligned, k, block_n=bn_gu,
                                              **kw)

                act = gate_up(0)

                def down(c: int) -> Any:
                    return moe.expert_down(act, ws[c][2], aligned, k, block_n=bn_d, **kw)
            else:
                def call(c: int) -> Any:
                    return moe_blocks.moe_blocks(x, *ws[c], GATE_UP_TYPE, DOWN_TYPE, ids, w, True,
                                                 config=cfg)

                def gate_up(c: int) -> Any:
                    return moe_blocks.expert_gate_up_blocks(x, ws[c][0], ws[c][1], GATE_UP_TYPE, i,
                                                            aligned, k, True, block_n=bn_gu, **kw)

                act = gate_up(0)

                def down(c: int) -> Any:
                    return moe_blocks.expert_down_blocks(act, ws[c][2], DOWN_TYPE, h, aligned, k,
                                                         True, block_n=bn_d, **kw)
            y = down(0)
            ms = _time(call, copies, graphs)
            stages_ms = {
                "align": _time(lambda c: moe.align(ids, e, bm), copies, graphs),
                "gate_up": _time(gate_up, copies, graphs),
                "down": _time(down, copies, graphs),
                "combine": _time(lambda c: moe.combine(y, ids, w), copies, graphs),
            }
            experts = int(torch.unique(ids).numel())
            read = experts * per_expert
            results.append({"weights": kind, "T": t, "H": h, "I": i, "E": e, "k": k,
                            "config": list(cfg), "ms": ms, "stage_ms": stages_ms,
                            "experts_read": experts, "weight_bytes": read,
                            "GB/s": read / (ms * 1e-3) / 1e9, "graphs": graphs})
            print(json.dumps(results[-1]), flush=True)
            if mapped and t <= 16:
                results.append(mapped_row(kind, ws, t, h, i, e, k, per_expert, dev, graphs))
                print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--gib", type=float, default=2.0, help="weight copies of about this size")
    ap.add_argument("--mapped", action="store_true",
                    help="also every expert read in place from pinned host memory (T <= 16)")
    ap.add_argument("--out", help="write the JSON list here too")
    a = ap.parse_args()
    results = bench(a.shape, a.gib, a.mapped)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
