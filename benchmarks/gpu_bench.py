"""GPU throughput of the engine on one GGUF file, as JSON: decode and prompt tokens/s, the limit.

Measures, through `strata.engine.Engine` with the attention backend its
runner picks (the Triton kernels over the pool on CUDA): decode tokens/s for
several lane counts (each lane reads its own prompt, then all decode
together), eager and through CUDA graphs, prompt tokens/s for one lane, the
bandwidth limit of one lane (weight bytes over the measured copy bandwidth),
and a torch profiler summary of single decode steps, so a missed target
comes with where the time goes (`benchmarks/engine_runs.py`). Decode
attention alone per KV format and a sweep of its kernel's launch configs
(`benchmarks/attention_sweep.py`). Given llama.cpp's tools (built with CUDA,
`python -m tools.llama_build`), it runs them on the same file in the same
run and reports Strata / llama.cpp for each figure (`benchmarks/llama_peer.py`).

    python -m benchmarks.gpu_bench MODEL.gguf --out result.json --profile-out profile.txt \
        --llama-bench PATH --llama-batched-bench PATH
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from functools import partial
from typing import Any

import torch

from benchmarks.attention_sweep import attention_run, sweep_decode
from benchmarks.engine_runs import (
    attach_tokenizer,
    batch_company,
    copy_bandwidth,
    decode_run,
    eager_steps,
    long_context_runs,
    profile_step,
    prompt_run,
    step_timing,
    use_decode_graphs,
)
from benchmarks.llama_peer import llama_peer, ratios
from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.models.experts import ExpertCache
from strata.models.moe import graph_safe


def _strata_stages(args: Any, cfg: EngineConfig, lanes: list[int], lengths: list[int],
                   out: dict[str, Any], stage: Any, tables: list[str]) -> None:
    """Strata's own figures through the engine (the model is dropped on return)."""
    from strata.models import load_model
    from strata.models.blocks import weight_bytes as held_bytes

    t0 = time.perf_counter()
    loaded = load_model(args.model, args.device, "auto", progress=False, weights=args.weights,
                        experts_on_host=args.expert_cache is not None)
    attach_tokenizer(loaded)
    load_s = time.perf_counter() - t0
    out["load_seconds"] = load_s
    out["weights"] = loaded.weights
    weight_bytes = sum(held_bytes(loaded.model).values())
    out["weight_bytes"] = weight_bytes
    out["weight_file_bytes"] = loaded.file_bytes
    cuda = _engine_stages(args, cfg, loaded, weight_bytes, lanes, lengths, out, stage, tables)
    if args.long_context and cuda:  # the engine above and its pool are gone
        gc.collect()
        torch.cuda.empty_cache()
        stage("long_context_decode", lambda: long_context_runs(
            loaded, cfg, args.long_context, args.gen_tokens,
            [f for f in args.long_kv.split(",") if f]))


def _engine_stages(args: Any, cfg: EngineConfig, loaded: Any, weight_bytes: int, lanes: list[int],
                   lengths: list[int], out: dict[str, Any], stage: Any, tables: list[str]) -> bool:
    """The figures of one engine over `loaded` (`cfg`), eager first, then through CUDA graphs;
    True when it ran on CUDA."""
    with Engine(cfg, loaded=loaded) as engine:
        traces = [layer.mlp.experts.record() for layer in loaded.model.layers
                  if isinstance(getattr(layer.mlp, "experts", None), ExpertCache)] if args.trace_out else []
        out["attention"] = engine.runner.context.__name__
        out["config"] = {k: getattr(cfg, k) for k in ("parallel", "max_context", "kv_pool_tokens",
                                                        "kv_chunk", "prefill_chunk")}
        out["kv_format"] = engine.pool.fmt.name
        cuda = engine.device.type == "cuda"
        if cuda:
            out["device_name"] = torch.cuda.get_device_name(engine.device)
            bw = copy_bandwidth(engine.device)
            out["copy_bandwidth_TBps"] = bw / 1e12
            out["one_lane_limit_tokens_per_s"] = bw / weight_bytes
            out["one_lane_limit_at_4.26TBps"] = 4.26e12 / weight_bytes
        with eager_steps(engine.runner):
            _eager_stages(args, engine, lanes, lengths, stage, tables)
        if engine.expert_stats is not None:
            out["expert_cache"] = engine.expert_stats.figures()
        if traces:
            with open(args.trace_out, "w") as f:
                json.dump({"experts": loaded.config.num_experts, "layers": traces}, f)
        if cuda and graph_safe(engine.loaded.model):  # an expert cache that copies misses: eager only
            use_decode_graphs(engine.runner)
            _graph_stages(args, engine, lanes, stage, tables)
            if engine.expert_stats is not None:  # --expert-misses mapped: the counters after both
                out["expert_cache"] = engine.expert_stats.figures()
    return cuda


def _on_engine(engine: Engine, runs: list[Any]) -> list[Any]:
    """Each run's result, run on the engine's thread as its steps are: on the CPU this (main)
    thread's own OpenMP pool would slow both (engine/threads.py)."""
    return engine.call(lambda: [run() for run in runs]).result()


def _profiles(args: Any, engine: Engine, tables: list[str], label: str) -> list[dict]:
    """Profiles of one decode step per `--profile-lanes` count; their tables go to `tables`."""
    result = []
    for n in [int(x) for x in args.profile_lanes.split(",") if x]:
        summary, table = engine.call(lambda: profile_step(engine, n, args.prompt_tokens)).result()
        result.append(summary)
        title = f"== decode step{label}, {n} lanes at position {args.prompt_tokens} =="
        tables.append(f"{title}\n{table}")
    return result


def _eager_stages(args: Any, engine: Engine, lanes: list[int], lengths: list[int], stage: Any,
                  tables: list[str]) -> None:
    """Warm-up, eager decode, prompt reads, one eager forward step and its profile."""
    def warmup() -> float:  # compiles every kernel variant the runs below use
        t = time.perf_counter()
        for n in sorted({1, max(lanes)}):
            decode_run(engine, n, args.prompt_tokens, 8, salt=90_000 + 100 * n)
        return time.perf_counter() - t

    stage("warmup_seconds", warmup)
    if not args.skip_eager:
        stage("decode", lambda: [decode_run(engine, n, args.prompt_tokens, args.gen_tokens,
                                            salt=1000 * n) for n in lanes])
    stage("prompt", lambda: [prompt_run(engine, n, salt=500_000 + n) for n in lengths])
    if not args.skip_eager:
        stage("forward_step", lambda: _on_engine(engine, [partial(step_timing, engine, n, args.prompt_tokens)
                                                          for n in lanes]))
        if engine.device.type == "cuda":
            stage("profile", lambda: _profiles(args, engine, tables, ""))


def _graph_stages(args: Any, engine: Engine, lanes: list[int], stage: Any,
                  tables: list[str]) -> None:
    """Decode, one forward step and its profile through CUDA graphs; a lane among others."""
    def graph_warmup() -> float:  # captures the padded sizes the runs below use
        t = time.perf_counter()
        for n in lanes:
            decode_run(engine, n, args.prompt_tokens, 4, salt=95_000 + 100 * n)
        return time.perf_counter() - t

    stage("graphs_warmup_seconds", graph_warmup)
    stage("decode_graphs", lambda: [decode_run(engine, n, args.prompt_tokens, args.gen_tokens,
                                               salt=2000 * n) for n in lanes])
    stage("forward_step_graphs", lambda: _on_engine(engine, [partial(step_timing, engine, n, args.prompt_tokens)
                                                              for n in lanes]))
    stage("profile_graphs", lambda: _profiles(args, engine, tables, " (CUDA graph)"))
    sizes = [int(x) for x in args.company.split(",") if x]
    if sizes:
        stage("batch_company", lambda: batch_company(engine, sizes, args.prompt_tokens, 32))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bench",
                                description="GPU throughput of the engine on one GGUF file (JSON)")
    p.add_argument("model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--weights", default="auto", help="as strata serve's --weights (auto: a quantized "
                   "file's blocks stay blocks)")
    p.add_argument("--lanes", default="1,16,64")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--prompt-lengths", default="512,8192", help="one-lane prompt reads to time")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--kv", default="auto")
    p.add_argument("--kv-chunk", type=int, default=1024)
    p.add_argument("--profile-lanes", default="1,64")
    p.add_argument("--attention", default="bf16,int8,q4_0,k8v4",
                   help="KV formats to time decode attention alone in (empty: skip)")
    p.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench (CUDA build)")
    p.add_argument("--llama-batched-bench", default=None, help="llama.cpp's llama-batched-bench")
    p.add_argument("--sweep-decode", default="",
                   help="KV formats whose decode-kernel launch configs to time (empty: none)")
    p.add_argument("--skip-strata", action="store_true", help="only the peers and sweeps")
    p.add_argument("--skip-eager", action="store_true", help="graph decode only (saves device time)")
    p.add_argument("--company", default="",
                   help="lane counts, e.g. 16,64: each request's greedy tokens alone vs among that many")
    p.add_argument("--pipeline", default="auto", choices=["auto", "on", "off"],
                   help="the engine's --pipeline (auto: on with CUDA-graph decode)")
    p.add_argument("--batch-invariant", default="off", choices=["auto", "on", "off"],
                   help="the engine's --batch-invariant (off here: these runs draft nothing, where the "
                        "engine's auto is off too; on: every lane's products summed as alone)")
    p.add_argument("--long-context", type=int, default=0,
                   help="also decode one lane after a prompt of this many tokens (e.g. 32768)")
    p.add_argument("--long-kv", default="bf16,int8,k8v4",
                   help="KV formats of the --long-context runs (bf16 first: the others' ratio)")
    p.add_argument("--expert-cache", default=None, metavar="N|auto",
                   help="a MoE model's experts in host RAM, N per layer on the GPU (strata serve's flag)")
    p.add_argument("--expert-policy", default="lfru", help="strata serve's --expert-policy")
    p.add_argument("--expert-misses", default="copy", choices=["copy", "mapped"],
                   help="strata serve's --expert-misses (mapped: decode steps keep CUDA graphs)")
    p.add_argument("--expert-uploads", type=int, default=None, help="strata serve's --expert-uploads")
    p.add_argument("--trace-out", default=None,
                   help="with --expert-cache: write every layer's routing (experts per step) as JSON "
                        "for `benchmarks.expert_policy`")
    p.add_argument("--llama-args", default="",
                   help="extra llama.cpp arguments for both tools, e.g. '--n-cpu-moe 36'")
    p.add_argument("--out", default=None)
    p.add_argument("--profile-out", default=None)
    return p


def engine_config(args: Any, lanes: list[int], lengths: list[int]) -> EngineConfig:
    """The engine of the runs: every lane's prompt and generation, and the longest one-lane read."""
    parallel = max(lanes)
    max_context = max(lengths + [args.prompt_tokens + args.gen_tokens]) + 64
    per_lane = args.prompt_tokens + args.gen_tokens + 1
    chunks = parallel * -(-per_lane // args.kv_chunk) + -(-max_context // args.kv_chunk) + 1
    return EngineConfig(model=args.model, device=args.device, parallel=parallel,
                        max_context=max_context,
                        kv_pool_tokens=chunks * args.kv_chunk, kv_chunk=args.kv_chunk, kv=args.kv,
                        prefill_chunk=args.prefill_chunk, max_queued=4 * parallel,
                        pipeline=args.pipeline, batch_invariant=args.batch_invariant,
                        expert_cache=args.expert_cache,
                        expert_policy=args.expert_policy, expert_misses=args.expert_misses,
                        expert_uploads=args.expert_uploads)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    lanes = [int(x) for x in args.lanes.split(",") if x]
    lengths = [int(x) for x in args.prompt_lengths.split(",") if x]
    cfg = engine_config(args, lanes, lengths)
    out: dict[str, Any] = {"model": args.model, "pipeline": args.pipeline,
                           "batch_invariant": args.batch_invariant}
    tables: list[str] = []

    def stage(name: str, fn: Any) -> None:
        """Run one measurement; a failure is recorded and the others still run."""
        t = time.perf_counter()
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - a benchmark reports, it does not stop
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"[{name}: {time.perf_counter() - t:.1f} s]", file=sys.stderr, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps(out, indent=1) + "\n")

    if not args.skip_strata:
        _strata_stages(args, cfg, lanes, lengths, out, stage, tables)
        gc.collect()  # the model's GPU memory back before llama.cpp loads the file
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.llama_bench or args.llama_batched_bench:
        stage("llama_cpp", lambda: llama_peer(args.model, args.llama_bench, args.llama_batched_bench,
                                              lanes, args.prompt_tokens, args.gen_tokens,
                                              args.llama_args.split()))
        out["ratios"] = ratios(out)
        tg = out["llama_cpp"].get("llama_bench", {}).get("decode_tokens_per_s")
        if tg and "one_lane_limit_tokens_per_s" in out:
            out["llama_bench_tg_fraction_of_limit"] = tg / out["one_lane_limit_tokens_per_s"]
    if args.device.startswith("cuda") and args.attention:
        dev = torch.device(args.device)
        stage("attention_kernel", lambda: [attention_run(f, n, c, dev) for f in args.attention.split(",")
                                           for n, c in ((1, 32768), (16, 4096), (64, 4096), (64, 512))])
    if args.device.startswith("cuda") and args.sweep_decode:
        dev = torch.device(args.device)
        stage("decode_sweep", lambda: [r for f in args.sweep_decode.split(",") for r in sweep_decode(f, dev)])
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.profile_out and tables:
        with open(args.profile_out, "w") as f:
            f.write("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
