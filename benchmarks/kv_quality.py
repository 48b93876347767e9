"""What each `--kv` format costs in quality, measured on the default model (JSON).

    python -m benchmarks.kv_quality [--tokens 2048] [--chunk 256] [--greedy 200] [--threads 1]

- perplexity on a real English text (GPL-3, read in chunks the way prompts are
  read) for every format, fp32 cells as the base;
- greedy agreement: bf16 decodes `--greedy` tokens step by step; every format
  then reads that text and its top-1 choices are compared with bf16's;
- K and V error of one write/read round trip on the model's own K/V
  activations, which is where k8v4's rotation has to earn its place against
  the same layout without it (`k8v4_norot`).

The model computes in bfloat16, so the fp32 and bf16 formats hold its K/V
exactly and must give identical figures: a built-in check of the harness.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.quality import format_error
from strata.attention.reference import TableAttention
from strata.bench.report import emit
from strata.kv.formats import FORMAT_NAMES, K8V4Format, KvFormat, make_format
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec

TEXT = "/usr/share/common-licenses/GPL-3"
NAMES = FORMAT_NAMES + ("k8v4_norot",)


def kv_format(name: str, n_kv_heads: int, head_dim: int) -> KvFormat:
    """A `--kv` format, or k8v4 without its rotation (a measurement-only twin)."""
    if name == "k8v4_norot":
        return K8V4Format(n_kv_heads, head_dim, rotate=False)
    return make_format(name, n_kv_heads, head_dim)


def load() -> Any:
    """The default model in bfloat16 on the CPU, with its tokenizer."""
    from strata.gguf import GGUFFile
    from strata.models import load_model
    from strata.tokenizer import Tokenizer

    loaded = load_model(None, device="cpu", dtype="bfloat16", progress=False)
    if loaded.tokenizer is None:
        loaded.tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(loaded.path).metadata, loaded.path)
    return loaded


class _Recorder:
    """An attention context that keeps each layer's k, v on their way to the pool."""

    def __init__(self, inner: TableAttention) -> None:
        self.inner = inner
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k[layer], self.v[layer] = k.clone(), v.clone()
        return self.inner.attend(layer, q, k, v)


class Session:
    """One conversation of the model over its own pool in one format."""

    def __init__(self, loaded: Any, fmt: KvFormat, max_context: int, chunk: int) -> None:
        self.loaded = loaded
        cfg = loaded.config
        self.pool = KvPool(fmt, cfg.num_layers, 1, max_context, chunk, None)
        self.pos = 0

    @torch.inference_mode()
    def feed(self, tokens: list[int], record: bool = False) -> tuple[torch.Tensor, Any]:
        """Logits (float32) of every fed token, and the context used (a recorder if asked)."""
        cfg, model = self.loaded.config, self.loaded.model
        n = len(tokens)
        ctx: Any = TableAttention(self.pool, [SeqSpec(0, self.pos, n)], cfg.attn_scale)
        if record:
            ctx = _Recorder(ctx)
        ids = torch.tensor(tokens, dtype=torch.int64)
        hidden = model(ids, torch.arange(self.pos, self.pos + n), ctx)
        self.pos += n
        return model.compute_logits(hidden), ctx


def _chunks(s: Session, tokens: list[int], chunk: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, logits) of `tokens` read `chunk` tokens per step, the way prompts are read."""
    for start in range(0, len(tokens), chunk):
        logits, _ = s.feed(tokens[start : start + chunk])
        yield start, logits


def perplexity(loaded: Any, fmt: KvFormat, tokens: list[int], chunk: int) -> dict[str, Any]:
    """exp(mean NLL) of tokens[1:]; also the top-1 ids, for agreement between formats."""
    s = Session(loaded, fmt, len(tokens), chunk)
    nll, count, top1 = 0.0, 0, []
    for start, logits in _chunks(s, tokens, chunk):
        logp = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(tokens[start + 1 : start + 1 + logits.shape[0]])
        m = targets.numel()
        nll -= float(logp[torch.arange(m), targets].double().sum())
        count += m
        top1.extend(logits.argmax(dim=-1).tolist())
    return {"ppl": math.exp(nll / count), "nll": nll / count, "scored": count, "top1": top1}


def greedy(loaded: Any, fmt: KvFormat, prompt: list[int], n_new: int, chunk: int) -> list[int]:
    """`n_new` greedy tokens after `prompt`, decoded one per step (the decode path)."""
    s = Session(loaded, fmt, len(prompt) + n_new, chunk)
    logits, _ = s.feed(prompt)
    out = [int(logits[-1].argmax())]
    while len(out) < n_new:
        logits, _ = s.feed(out[-1:])
        out.append(int(logits[-1].argmax()))
    return out


def greedy_agreement(loaded: Any, fmt: KvFormat, prompt: list[int], ref: list[int],
                     chunk: int) -> dict[str, Any]:
    """How a format's greedy choices compare with `ref` (the reference format's greedy tokens).

    Teacher-forced: the format reads prompt + ref in chunks and its top-1 token
    at every position of ref is compared with ref's. Reported: the fraction
    that agree and the first position that does not (where the format's own
    greedy text would start to differ, up to near-ties decided by low bits).
    """
    seq = prompt + ref
    s = Session(loaded, fmt, len(seq), chunk)
    top1 = torch.cat([lg.argmax(dim=-1) for _, lg in _chunks(s, seq, chunk)])
    pred = top1[len(prompt) - 1 : len(seq) - 1]
    same = pred == torch.tensor(ref)
    first = int((~same).nonzero()[0]) if not bool(same.all()) else None
    return {"top1_agree": float(same.float().mean()), "first_divergence": first}


def activation_errors(loaded: Any, tokens: list[int]) -> dict[str, dict[str, float]]:
    """Round-trip K/V error of each format on the model's K/V for `tokens` (one chunk).

    `k`/`v`: ||x' - x|| / ||x|| over all layers together; `*_layer_mean`: the
    mean of the per-layer figures, so small-norm layers count as much as large ones.
    """
    cfg = loaded.config
    exact = make_format("fp32", cfg.num_kv_heads, cfg.head_dim)
    s = Session(loaded, exact, len(tokens), len(tokens))
    _, rec = s.feed(tokens, record=True)
    layers = range(cfg.num_layers)
    k_all = torch.cat([rec.k[i].float() for i in layers])
    v_all = torch.cat([rec.v[i].float() for i in layers])
    out = {}
    for name in NAMES:
        if name == "fp32":
            continue
        whole = format_error(name, k_all, v_all)
        per = [format_error(name, rec.k[i].float(), rec.v[i].float()) for i in layers]
        out[name] = {
            "k": whole["k"],
            "v": whole["v"],
            "k_layer_mean": sum(p["k"] for p in per) / len(per),
            "v_layer_mean": sum(p["v"] for p in per) / len(per),
        }
        if name.startswith("k8v4"):  # where the rotation has to show, layer by layer
            out[name]["v_per_layer"] = [round(p["v"], 5) for p in per]
    return out


def _agree(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def run(n_tokens: int, chunk: int, n_greedy: int, prompt_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    loaded = load()
    cfg = loaded.config
    with open(TEXT, encoding="utf-8") as f:
        ids = loaded.tokenizer.encode(f.read())
    tokens = ids[:n_tokens]
    fmts = {name: kv_format(name, cfg.num_kv_heads, cfg.head_dim) for name in NAMES}
    result: dict[str, Any] = {
        "model": loaded.name, "dtype": str(loaded.dtype), "text": TEXT, "tokens": len(tokens),
        "chunk": chunk, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "cell_bytes_per_layer": {n: f.cell_bytes() for n, f in fmts.items()},
    }
    ppl = {name: perplexity(loaded, f, tokens, chunk) for name, f in fmts.items()}
    base = ppl["fp32"]
    result["perplexity"] = {
        name: {
            "ppl": p["ppl"],
            "delta_vs_fp32": p["ppl"] - base["ppl"],
            "top1_agree_vs_fp32": _agree(p["top1"], base["top1"]),
        }
        for name, p in ppl.items()
    }
    prompt = ids[:prompt_tokens]
    ref = greedy(loaded, fmts["bf16"], prompt, n_greedy, chunk)
    result["greedy"] = {
        "prompt_tokens": len(prompt), "new_tokens": n_greedy, "vs": "bf16 (decoded step by step)",
        "text": loaded.tokenizer.decode(ref),
        "formats": {n: greedy_agreement(loaded, f, prompt, ref, chunk) for n, f in fmts.items()},
    }
    result["kv_error"] = activation_errors(loaded, ids[:512])
    ke, kn = result["kv_error"]["k8v4"], result["kv_error"]["k8v4_norot"]
    ratios = [b / a for a, b in zip(ke["v_per_layer"], kn["v_per_layer"])]
    result["rotation_gain"] = {
        "v_error_ratio_norot_over_rot": kn["v"] / ke["v"],
        "v_layer_mean_ratio_norot_over_rot": kn["v_layer_mean"] / ke["v_layer_mean"],
        "v_layer_ratio_min_max": [min(ratios), max(ratios)],
        "ppl_k8v4": ppl["k8v4"]["ppl"],
        "ppl_k8v4_norot": ppl["k8v4_norot"]["ppl"],
    }
    result["seconds"] = time.perf_counter() - t0
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kv_quality",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the text scored")
    ap.add_argument("--chunk", type=int, default=256, help="tokens read per step")
    ap.add_argument("--greedy", type=int, default=200, help="greedy tokens compared")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens before greedy decoding")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: small steps run fastest and steadiest on a busy CPU)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    emit(run(args.tokens, args.chunk, args.greedy, args.prompt), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
