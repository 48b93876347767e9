"""Strata against llama-server on one qwen3next GGUF: greedy tokens of fresh prompts, as JSON.

The Qwen3-Next-shaped random model of `hybrid_replay` is written once as a
GGUF (llama.cpp's converter layout, the default model's tokenizer); both
engines read the same prompts from token 0, one lane each, and the first
position where their 16 greedy tokens differ is reported (null: equal).

    python -m benchmarks.hybrid_agreement --llama-server PATH [--hidden 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.hybrid_replay import ANSWER, engine_sender, write_model
from benchmarks.llama_server import LlamaServer
from strata.engine.config import EngineConfig
from strata.engine.engine import Engine

LENGTHS = (40, 90, 200, 333, 600, 1200)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-server", required=True, metavar="PATH")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokenizer", default=".bench/tokenizer.gguf")
    args = p.parse_args(argv)
    prompts = [torch.randint(3, 255, (n,), generator=torch.Generator().manual_seed(i)).tolist()
               for i, n in enumerate(LENGTHS)]
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp), args.hidden, args.layers, args.tokenizer)
        cfg = EngineConfig(model=model, device="cpu", dtype="float32", weights="dense", parallel=1,
                           max_context=2048, prefill_chunk=512, prefix_reuse=False, ctx_checkpoints=0)
        with Engine(cfg) as eng:
            ours = [engine_sender(eng)(prompt, [])[2] for prompt in prompts]
        with LlamaServer(args.llama_server, model, 2048, [], lanes=1) as server:
            theirs = [server.sender(ANSWER, False)(prompt, [])[2] for prompt in prompts]
    rows = [{"prompt_tokens": len(prompt),
             "first_difference": next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)}
            for prompt, x, y in zip(prompts, ours, theirs)]
    json.dump({"hidden": args.hidden, "layers": args.layers, "answer_tokens": ANSWER, "prompts": rows,
               "equal": sum(r["first_difference"] is None for r in rows)}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
