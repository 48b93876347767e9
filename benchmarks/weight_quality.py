"""What each `--weights` mode costs in quality on the default model, beside llama.cpp (JSON).

    python -m benchmarks.weight_quality [--modes dense,gguf,int4] [--tokens 2048]
        [--llama-completion PATH] [--llama-perplexity PATH] [--threads 2]

- perplexity on a real English text (GPL-3, the first `--tokens` tokens read
  in chunks of 256, the way prompts are read) for every mode, in bfloat16;
  `--llama-perplexity` adds llama.cpp's own figure on the same file
  (`llama-perplexity -f GPL-3 -c 2048`: windows of its own, so compare it
  loosely);
- greedy agreement with llama.cpp: five prompts, `--new` greedy tokens each
  through Strata (decoded one per step) and through `llama-completion
  --temp 0`; the score of a prompt is the length of the common prefix of
  the two texts over the length of llama.cpp's text, averaged over prompts.
  Also the same score between each mode and the dense one.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import time
from typing import Any

import torch

from benchmarks.kv_quality import TEXT, greedy, perplexity
from strata.bench.report import emit
from strata.kv.formats import make_format
from strata.models import load_model

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "Photosynthesis is the process by which",
)


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(texts: list[str], refs: list[str]) -> float:
    """Mean over prompts of common prefix / the reference's length."""
    return sum(common_prefix(t, r) / max(1, len(r)) for t, r in zip(texts, refs)) / len(refs)


def llama_texts(binary: str, model: str, n_new: int, threads: int) -> list[str]:
    """llama.cpp's greedy continuation of each prompt (its text after the prompt)."""
    out = []
    for prompt in PROMPTS:
        cmd = [binary, "-m", model, "-p", prompt, "-n", str(n_new), "--temp", "0", "-t", str(threads),
               "--no-warmup", "-no-cnv", "--no-display-prompt", "-c", "512"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
        out.append(proc.stdout.strip("\n"))
    return out


def llama_perplexity(binary: str, model: str, threads: int) -> float | None:
    proc = subprocess.run([binary, "-m", model, "-f", TEXT, "-c", "2048", "-t", str(threads)],
                          capture_output=True, text=True, timeout=1800)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stdout + proc.stderr)
    return float(m.group(1)) if m else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    result: dict[str, Any] = {"text": TEXT, "tokens": args.tokens, "new_tokens": args.new, "modes": {},
                              "threads": torch.get_num_threads(), "torch": torch.__version__}
    refs = llama_texts(args.llama_completion, args.model, args.new, args.threads) if args.llama_completion else None
    if refs is not None:
        result["llama_cpp_texts"] = refs
    dense_texts: list[str] | None = None
    for mode in args.modes.split(","):
        loaded = load_model(args.model, device="cpu", dtype="bfloat16", weights=mode, progress=False)
        tok, cfg = loaded.tokenizer, loaded.config
        fmt = make_format("bf16", cfg.num_kv_heads, cfg.head_dim)
        with open(TEXT, encoding="utf-8") as f:
            ids = tok.encode(f.read())[: args.tokens]
        ppl = perplexity(loaded, fmt, ids, 256)
        texts = [tok.decode(greedy(loaded, fmt, tok.encode(p), args.new, 256)) for p in PROMPTS]
        row: dict[str, Any] = {"weights": loaded.weights, "ppl": ppl["ppl"], "texts": texts}
        if refs is not None:
            row["agreement_with_llama_cpp"] = agreement(texts, refs)
        if mode == "dense":
            dense_texts = texts
        elif dense_texts is not None:
            row["agreement_with_dense"] = agreement(texts, dense_texts)
        result["modes"][mode] = row
    if "dense" in result["modes"]:
        base = result["modes"]["dense"]["ppl"]
        for row in result["modes"].values():
            row["ppl_vs_dense"] = row["ppl"] / base - 1
    if args.llama_perplexity:
        result["llama_cpp_ppl_c2048"] = llama_perplexity(args.llama_perplexity, args.model, args.threads)
    result["seconds"] = time.perf_counter() - t0
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.weight_quality", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--modes", default="dense,gguf,int4")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--new", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-completion", default=None, help="llama.cpp's llama-completion")
    ap.add_argument("--llama-perplexity", default=None, help="llama.cpp's llama-perplexity")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.model is None:
        from strata.default_model import default_model_path

        args.model = str(default_model_path())
    torch.set_num_threads(args.threads)
    emit(run(args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
