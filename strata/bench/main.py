"""`strata bench`: throughput and pool figures as JSON, beside llama.cpp when it is installed."""

from __future__ import annotations

import argparse
import time
from typing import Any

from strata.bench.peers import run_llama_bench, run_llama_cpp_python
from strata.bench.report import emit
from strata.engine.config import config_from_args
from strata.engine.types import SamplingParams


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("bench")
    g.add_argument("--suite", default="decode", choices=["decode", "pool", "all"],
                   help="decode: prompt and decode tokens/s; pool: pool memory and move time "
                        "(the GPU harness: python -m benchmarks.gpu_bench, docs/GPU.md)")
    g.add_argument("--prompt-tokens", type=int, default=512)
    g.add_argument("--gen-tokens", type=int, default=128)
    g.add_argument("--lanes", default="1", help="comma-separated lane counts for decode, e.g. 1,4,16")
    g.add_argument("--llama-cpp", action="store_true",
                   help="also run llama.cpp on the same GGUF: --llama-bench if given, else "
                        "llama-cpp-python (must be installed)")
    g.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="a llama-bench binary (built from llama.cpp's source): the fair peer")
    g.add_argument("--out", default=None, help="also write the JSON here")


def synthetic_prompt(vocab: int, n: int, salt: int) -> list[int]:
    """Deterministic pseudo-random token ids (distinct per salt, so no prefix is shared)."""
    x = 12345 + salt * 7919
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(100 + x % (vocab - 200))
    return out


def bench_engine(engine: Any, prompt_tokens: int, gen_tokens: int, lanes: list[int]) -> dict:
    vocab = engine.model_config.vocab_size
    params1 = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.complete(synthetic_prompt(vocab, 16, 999), params1)  # warm up
    t0 = time.perf_counter()
    engine.complete(synthetic_prompt(vocab, prompt_tokens, 0), params1)
    prompt_s = time.perf_counter() - t0
    out: dict[str, Any] = {"prompt_tokens_per_s": prompt_tokens / prompt_s, "decode": {}}
    params = SamplingParams(max_tokens=gen_tokens, ignore_eos=True)
    for n in lanes:
        if n > engine.config.parallel:
            out["decode"][str(n)] = None
            continue
        handles = [engine.generate(synthetic_prompt(vocab, prompt_tokens, 1000 * n + i), params) for i in range(n)]
        iters = [iter(h) for h in handles]
        for it in iters:  # first token of every lane: prompts read
            next(it)
        t0 = time.perf_counter()
        for it in iters:
            for _ in it:
                pass
        dt = time.perf_counter() - t0
        out["decode"][str(n)] = {"tokens_per_s": n * (gen_tokens - 1) / dt,
                                 "per_lane_tokens_per_s": (gen_tokens - 1) / dt}
    return out


def run_bench(args: argparse.Namespace) -> int:
    import torch

    from strata.bench.pool_bench import bench_pool
    from strata.engine.engine import Engine

    cfg = config_from_args(args)
    lanes = [int(x) for x in args.lanes.split(",")]
    cfg.parallel = max(cfg.parallel, max(lanes))
    cfg.max_context = max(cfg.max_context, args.prompt_tokens + args.gen_tokens + 1)
    result: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if args.suite in ("decode", "all"):
        engine = Engine(cfg)
        try:
            result.update(model=engine.model_name, device=str(engine.device), dtype=str(engine.dtype),
                          kv=engine.pool.fmt.name, prompt_tokens=args.prompt_tokens,
                          gen_tokens=args.gen_tokens)
            result["strata"] = bench_engine(engine, args.prompt_tokens, args.gen_tokens, lanes)
            path = str(engine.loaded.path)
        finally:
            engine.close()
        if args.llama_cpp or args.llama_bench:
            vocab = engine.model_config.vocab_size
            if args.llama_bench:
                peer = run_llama_bench(args.llama_bench, path, args.prompt_tokens, args.gen_tokens,
                                       cfg.threads)
            else:
                peer = run_llama_cpp_python(path, args.prompt_tokens, args.gen_tokens, cfg.threads,
                                            synthetic_prompt(vocab, args.prompt_tokens, 0),
                                            synthetic_prompt(vocab, 16, 999))
            result["llama_cpp"] = peer
            one = result["strata"]["decode"].get("1")
            if peer and one:
                result["ratio_decode_1_lane"] = one["tokens_per_s"] / peer["decode_tokens_per_s"]
                result["ratio_prompt"] = result["strata"]["prompt_tokens_per_s"] / peer["prompt_tokens_per_s"]
    if args.suite in ("pool", "all"):
        result["pool"] = bench_pool(cfg)
    emit(result, args.out)
    return 0
