"""Where a one-lane CPU decode step goes: time per kind of product, attention and the rest (JSON).

    python -m benchmarks.cpu_decode_profile [--weights gguf] [--threads 2] [--steps 64]
        [--prompt-tokens 16]

Each projection of the model (q/k/v, o, gate/up, down, the output head) is
timed around its own call, so the figures are wall time per token of each
kind, beside its weight bytes and the bandwidth those bytes take; the step's
total comes from the same steps, and what is not a product (attention, norms,
RoPE, sampling, Python) is the difference. Timing the calls costs a few
microseconds each, so the total runs a little slower than an untimed step.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

import torch

from benchmarks.kv_quality import Session
from strata.bench.report import emit
from strata.kv.formats import make_format
from strata.models import load_model
from strata.models.blocks import weight_bytes

KINDS = (("self_attn", "qkv_proj", "qkv"), ("self_attn", "o_proj", "o"), ("mlp", "gate_up_proj", "gate_up"),
         ("mlp", "down_proj", "down"))


class Timed(torch.nn.Module):
    """A module whose forward is timed into `spent[kind]` (the wrapped module computes)."""

    def __init__(self, inner: torch.nn.Module, kind: str, spent: dict[str, float]) -> None:
        super().__init__()
        self.inner, self.kind, self.spent = inner, kind, spent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        y = self.inner.forward(x)
        self.spent[self.kind] += time.perf_counter() - t0
        return y


def _bytes(m: torch.nn.Module) -> int:
    return sum(weight_bytes(m).values())


def run(args: argparse.Namespace) -> dict[str, Any]:
    loaded = load_model(args.model, device="cpu", dtype="bfloat16", weights=args.weights, progress=False)
    model, cfg = loaded.model, loaded.config
    spent: dict[str, float] = defaultdict(float)
    nbytes: dict[str, int] = defaultdict(int)
    for layer in model.layers:
        for owner_name, name, kind in KINDS:
            owner = getattr(layer, owner_name)
            inner = getattr(owner, name)
            nbytes[kind] += _bytes(inner)
            setattr(owner, name, Timed(inner, kind, spent))
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    nbytes["head"] = _bytes(head)
    fmt = make_format("bf16", cfg.num_kv_heads, cfg.head_dim)
    s = Session(loaded, fmt, args.prompt_tokens + args.steps + 8, 256)
    logits, _ = s.feed(list(range(1000, 1000 + args.prompt_tokens)))
    tok = int(logits[-1].argmax())
    for _ in range(4):  # warm-up
        logits, _ = s.feed([tok])
        tok = int(logits[-1].argmax())
    spent.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        hidden_logits, _ = s.feed([tok])
        tok = int(hidden_logits[-1].argmax())
    total = time.perf_counter() - t0
    # the head is inside feed's compute_logits: time it alone over the same hidden row
    h = torch.randn(1, cfg.hidden_size).bfloat16()
    t1 = time.perf_counter()
    for _ in range(args.steps):
        model.compute_logits(h)
    head_spent = time.perf_counter() - t1
    per = {k: v / args.steps * 1e3 for k, v in spent.items()}
    per["head"] = head_spent / args.steps * 1e3
    products = sum(per.values())
    step_ms = total / args.steps * 1e3
    return {
        "model": loaded.name, "weights": loaded.weights, "threads": torch.get_num_threads(),
        "steps": args.steps, "step_ms": step_ms, "tokens_per_s": 1e3 / step_ms,
        "ms_per_token": per, "products_ms": products,
        "rest_ms": step_ms - products,  # attention, norms, RoPE, embedding, Python
        "weight_bytes": dict(nbytes),
        "GBps": {k: nbytes[k] / (per[k] * 1e-3) / 1e9 for k in per if per[k] > 0},
        "bytes_per_token": sum(nbytes.values()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu_decode_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--weights", default="gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    emit(run(args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
