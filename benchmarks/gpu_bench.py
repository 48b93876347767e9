"""GPU throughput of the engine on one GGUF file, as JSON: decode and prompt tokens/s, the limit.

Measures, through `strata.engine.Engine` with the Triton attention over the
pool: decode tokens/s for several lane counts (each lane reads its own
prompt, then all decode together), prompt tokens/s for one lane, the
bandwidth limit of one lane (weight bytes over the measured copy bandwidth),
and a torch profiler summary of single decode steps, so a missed target
comes with where the time goes. Given llama.cpp's tools (built with CUDA,
`tools.llama_build`), it runs them on the same file in the same run and
reports Strata / llama.cpp for each figure.

    python -m benchmarks.gpu_bench MODEL.gguf --out result.json --profile-out profile.txt \
        --llama-bench PATH --llama-batched-bench PATH
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from typing import Any

import torch

from strata.bench.main import synthetic_prompt
from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from strata.attention.reference import SeqSpec


def copy_bandwidth(device: torch.device, gib: float = 2.0, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1e3 / reps
    return 2 * n * 4 / seconds


def attach_tokenizer(loaded: Any) -> None:
    """Give a loaded GGUF model its tokenizer when the loader left it out."""
    if loaded.tokenizer is None and str(loaded.path).endswith(".gguf"):
        from strata.gguf import GGUFFile
        from strata.tokenizer import Tokenizer

        loaded.tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(loaded.path).metadata, loaded.path)


def use_gpu_attention(engine: Engine) -> str:
    """The attention context the engine's steps use on this pool; points the runner at the kernels.

    A hooked runner (docs/GPU.md: `context`, or `context_class` in the first
    proposal) has already chosen; an older one names `TableAttention` in its
    module, which is redirected.
    """
    from strata.engine import runner as runner_module
    from strata.attention.triton_pool import context_class

    for attr in ("context", "context_class"):
        chosen = getattr(engine.runner, attr, None)
        if isinstance(chosen, type):
            return chosen.__name__
    cls = context_class(engine.pool)
    runner_module.TableAttention = cls  # type: ignore[attr-defined,misc]
    return cls.__name__


def without_decode_graphs(engine: Engine) -> Any:
    """Take a hooked runner's decode graphs out, so that steps run eagerly; returns them (or None)."""
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is not None:
        engine.runner.graphs = None
    return graphs


def use_decode_graphs(engine: Engine, graphs: Any = None) -> Any:
    """Route pure decode steps through CUDA graphs: a hooked runner's own (`graphs`, taken out by
    `without_decode_graphs`, put back), else as the runner hook does (docs/GPU.md)."""
    runner = engine.runner
    if getattr(runner, "graphs", None) is not None:
        return runner.graphs
    if hasattr(runner, "graphs"):  # the hooked runner: its forward replays whatever it holds
        if graphs is None:
            from strata.engine.graphs import DecodeGraphs

            graphs = DecodeGraphs(runner.model, engine.pool, runner.num_heads, runner.scale,
                                  runner.dtype)
        runner.graphs = graphs
        return graphs
    from strata.engine.graphs import DecodeGraphs

    graphs = DecodeGraphs(runner.model, engine.pool, runner.num_heads, runner.scale, runner.dtype)
    eager = runner.forward

    def forward(seqs: list[SeqSpec], tokens: list[int], sample: list[bool]) -> torch.Tensor:
        if graphs.supports(seqs, sample):
            return graphs.forward(seqs, tokens)
        return eager(seqs, tokens, sample)

    runner.forward = forward  # type: ignore[method-assign]
    return graphs


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def decode_run(engine: Engine, lanes: int, prompt_tokens: int, gen_tokens: int, salt: int) -> dict:
    """All lanes read their prompts in one step, then decode `gen_tokens` together; decode time only.

    As llama-batched-bench measures: every lane starts decoding in the same step, so the timed
    window holds `lanes` lanes throughout (with prompts read `--prefill-chunk` tokens a step,
    early lanes would decode alone while later ones still read, and finish early).
    """
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=gen_tokens, ignore_eos=True)
    prompts = [synthetic_prompt(vocab, prompt_tokens, salt + i) for i in range(lanes)]
    sched = engine.scheduler
    budget = sched.prefill_chunk

    def submit() -> list[Any]:  # on the engine thread: admitted together, read in one step
        sched.prefill_chunk = max(budget, lanes * prompt_tokens)
        return [engine.generate(p, params) for p in prompts]

    handles = engine.call(submit).result()
    iters = [iter(h) for h in handles]
    t0 = time.perf_counter()
    for it in iters:  # first token of every lane: its prompt has been read
        next(it)
    t1 = time.perf_counter()
    engine.call(lambda: setattr(sched, "prefill_chunk", budget)).result()
    done = [sum(len(ev.token_ids) for ev in it) for it in iters]
    dt = time.perf_counter() - t1
    return {"lanes": lanes, "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens,
            "decode_tokens_per_s": sum(done) / dt, "per_lane_tokens_per_s": sum(done) / dt / lanes,
            "decode_seconds": dt, "prompts_seconds": t1 - t0}


def long_context_runs(loaded: Any, base: EngineConfig, context: int, gen_tokens: int,
                      formats: list[str]) -> list[dict]:
    """One lane decoding after a `context`-token prompt, through the engine with CUDA-graph
    decode, per KV format (the loaded model reused; a pool of one lane each)."""
    rows = []
    for fmt in formats:
        cfg = dataclasses.replace(base, parallel=1, max_context=context + gen_tokens + 64,
                                  kv_pool_tokens=None, kv=fmt, max_queued=4)
        with Engine(cfg, loaded=loaded) as engine:
            use_gpu_attention(engine)
            decode_run(engine, 1, 512, 4, salt=7)  # compiles, captures the one-lane graph
            row = decode_run(engine, 1, context, gen_tokens, salt=11)
            row["kv"] = engine.pool.fmt.name
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    if rows and rows[0]["kv"] == "bf16":
        for r in rows:
            r["time_vs_bf16"] = rows[0]["decode_tokens_per_s"] / r["decode_tokens_per_s"]
    return rows


def prompt_run(engine: Engine, prompt_tokens: int, salt: int, reps: int = 5) -> dict:
    """One lane reads a prompt and samples one token, `reps` times (distinct prompts, no prefix
    reuse between them); the median time (llama-bench's pp figure is a mean over repetitions)."""
    vocab = engine.model_config.vocab_size
    times = []
    for i in range(reps):
        prompt = synthetic_prompt(vocab, prompt_tokens, salt + 7919 * i)
        t0 = time.perf_counter()
        engine.complete(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        times.append(time.perf_counter() - t0)
    dt = sorted(times)[len(times) // 2]
    return {"prompt_tokens": prompt_tokens, "prompt_tokens_per_s": prompt_tokens / dt,
            "seconds": dt, "seconds_each": times}


def batch_company(engine: Engine, sizes: list[int], prompt_tokens: int, gen_tokens: int) -> dict:
    """Greedy tokens of each request alone, then among `sizes` lanes admitted together.

    How a lane's output depends on its company: counts of identical outputs and, for the others,
    the first generated position that differs.
    """
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=gen_tokens, ignore_eos=True)
    prompts = [synthetic_prompt(vocab, prompt_tokens, 700_000 + i) for i in range(max(sizes))]

    def together(batch: list[list[int]]) -> list[list[int]]:
        handles = engine.call(lambda: [engine.generate(p, params) for p in batch]).result()
        return [h.result().token_ids for h in handles]

    alone = [together([p])[0] for p in prompts]
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens}
    for n in sizes:
        among = together(prompts[:n])
        differ = [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
                  for a, b in zip(alone, among) if a != b]
        out[f"among_{n}"] = {"identical": n - len(differ), "of": n, "first_difference": sorted(differ)}
    return out


def _decode_step(engine: Engine, lanes: int, position: int) -> tuple[list[SeqSpec], list[int], list[bool]]:
    """One decode step of `lanes` lanes at `position` (reserving their chunks; the engine is idle)."""
    for i in range(lanes):
        assert engine.pool.reserve(i, position + 1), "pool too small for the profiled step"
    seqs = [SeqSpec(i, position, 1) for i in range(lanes)]
    return seqs, [100 + i for i in range(lanes)], [True] * lanes


def step_timing(engine: Engine, lanes: int, position: int, reps: int = 20) -> dict:
    """Wall time of the runner's forward for one decode step, synchronized (no sampling, no engine)."""
    seqs, toks, sample = _decode_step(engine, lanes, position)
    for _ in range(3):
        engine.runner.forward(seqs, toks, sample)
    _sync(engine)
    t0 = time.perf_counter()
    for _ in range(reps):
        engine.runner.forward(seqs, toks, sample)
    _sync(engine)
    ms = (time.perf_counter() - t0) / reps * 1e3
    return {"lanes": lanes, "position": position, "forward_ms": ms, "forward_tokens_per_s": lanes / ms * 1e3}


def profile_step(engine: Engine, lanes: int, position: int, reps: int = 5) -> tuple[dict, str]:
    """Torch profiler over `reps` decode steps: device time per step and the costliest operators."""
    from torch.profiler import ProfilerActivity, profile

    seqs, toks, sample = _decode_step(engine, lanes, position)
    engine.runner.forward(seqs, toks, sample)
    _sync(engine)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            engine.runner.forward(seqs, toks, sample)
        _sync(engine)
    events = prof.key_averages()

    def dev_self(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))

    def is_kernel(e: Any) -> bool:  # operators also carry their kernels' time: count kernels once
        return str(getattr(e, "device_type", "")).endswith("CUDA")

    kernels = [e for e in events if is_kernel(e)]
    total = sum(dev_self(e) for e in kernels)
    top = sorted(kernels, key=dev_self, reverse=True)[:12]
    summary = {
        "lanes": lanes,
        "position": position,
        "device_ms_per_step": total / reps / 1e3,
        "cpu_ms_per_step": sum(float(e.self_cpu_time_total) for e in events if not is_kernel(e)) / reps / 1e3,
        "top": [{"name": e.key[:80], "device_ms_per_step": dev_self(e) / reps / 1e3,
                 "calls_per_step": e.count / reps} for e in top],
    }
    try:
        table = events.table(sort_by="self_device_time_total", row_limit=30)
    except (AttributeError, KeyError, ValueError):  # older torch names it after CUDA
        table = events.table(sort_by="self_cuda_time_total", row_limit=30)
    return summary, table


def attention_run(fmt_name: str, lanes: int, context: int, device: torch.device,
                  heads: int = 32, kv_heads: int = 8, head_dim: int = 128, reps: int = 20) -> dict:
    """Decode attention alone (one layer, Llama-3.1-8B heads) over full contexts: time and bytes/s.

    The time covers the whole `attend` (write, attention, output rotation),
    replayed from a CUDA graph so that it is device time, not launch cost.
    """
    from strata.kv.formats import make_format
    from strata.attention.triton_pool import GpuTableAttention
    from strata.kv.pool import KvPool

    fmt = make_format(fmt_name, kv_heads, head_dim)
    pool = KvPool(fmt, 1, lanes, context + 1, 4096, None, device)
    for t in pool.layers[0].values():  # random cells: never time zeros
        if t.is_floating_point():
            t.copy_(torch.rand_like(t))
        else:
            t.copy_(torch.randint_like(t, 0, 100))
    seqs = [SeqSpec(i, context - 1, 1) for i in range(lanes)]
    ctx = GpuTableAttention(pool, seqs, heads, head_dim**-0.5, torch.bfloat16)
    q = torch.randn(lanes, heads, head_dim, device=device, dtype=torch.bfloat16)
    kv = torch.randn(lanes, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        ctx.attend(0, q, kv, kv)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()  # replayed: launch costs out of the figure, as in a decode graph
    with torch.cuda.graph(graph):
        for _ in range(reps):
            ctx.attend(0, q, kv, kv)
    graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    us = start.elapsed_time(end) / (3 * reps) * 1e3
    read = lanes * context * fmt.cell_bytes()
    return {"kv": fmt_name, "lanes": lanes, "context": context, "us_per_layer": us,
            "cell_bytes_read": read, "TBps": read / us / 1e6}


def sweep_decode(fmt_name: str, device: torch.device, shapes: tuple[tuple[int, int], ...] = (
        (1, 32768), (64, 4096)), reps: int = 20) -> list[dict]:
    """Decode attention alone under every launch config of `decode.CONFIGS`' search space."""
    import itertools

    from strata.kernels.triton import decode
    from strata.attention.layout import halves

    rows = []
    fmt_halves = None
    saved = dict(decode.CONFIGS)
    try:
        for block_n, warps, stages, per_sm in itertools.product((64, 128), (4, 8), (1, 2), (2, 4)):
            cfg = decode.DecodeConfig(block_n, warps, stages, per_sm)
            if fmt_halves is None:
                from strata.kv.formats import make_format

                k, v = halves(make_format(fmt_name, 1, 128), make_format(fmt_name, 1, 128).allocate(1, "cpu"))
                fmt_halves = (k.kind, v.kind)
            decode.CONFIGS[fmt_halves] = cfg
            row: dict[str, Any] = {"kv": fmt_name, "block_n": block_n, "num_warps": warps,
                                   "num_stages": stages, "per_sm": per_sm}
            for lanes, context in shapes:
                try:
                    row[f"us_{lanes}x{context}"] = attention_run(fmt_name, lanes, context, device,
                                                                 reps=reps)["us_per_layer"]
                except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result
                    row[f"us_{lanes}x{context}"] = f"{type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        decode.CONFIGS.clear()
        decode.CONFIGS.update(saved)
    return rows


def llama_peer(model: str, bench: str | None, batched: str | None, lanes: list[int],
               prompt_tokens: int, gen_tokens: int) -> dict[str, Any]:
    """llama.cpp's llama-bench and llama-batched-bench on `model` (each when given)."""
    from strata.bench.peers import llama_batched_bench_gpu, llama_bench_gpu

    out: dict[str, Any] = {}
    if bench:
        out["llama_bench"] = llama_bench_gpu(bench, model, prompt_tokens, gen_tokens)
    if batched:
        out["llama_batched_bench"] = llama_batched_bench_gpu(batched, model, lanes, prompt_tokens,
                                                             gen_tokens)
    return out


def ratios(out: dict[str, Any]) -> dict[str, float]:
    """Strata / llama.cpp for every figure both measured (above 1: Strata is faster)."""
    r: dict[str, float] = {}
    peer = out.get("llama_cpp", {})
    strata_decode = {d["lanes"]: d["decode_tokens_per_s"] for d in out.get("decode_graphs", [])
                     if isinstance(d, dict) and "lanes" in d}
    strata_prompt = {p["prompt_tokens"]: p["prompt_tokens_per_s"] for p in out.get("prompt", [])
                     if isinstance(p, dict) and "prompt_tokens" in p}
    lb = peer.get("llama_bench", {})
    if "decode_tokens_per_s" in lb and 1 in strata_decode:
        r["decode_1_lane_vs_llama_bench_tg"] = strata_decode[1] / lb["decode_tokens_per_s"]
    if "prompt_tokens_per_s" in lb and lb.get("prompt_tokens") in strata_prompt:
        r[f"prompt_{lb['prompt_tokens']}_vs_llama_bench_pp"] = (
            strata_prompt[lb["prompt_tokens"]] / lb["prompt_tokens_per_s"])
    for row in peer.get("llama_batched_bench", {}).get("rows", []):
        if row["pl"] in strata_decode:
            r[f"decode_{row['pl']}_lanes_vs_batched_bench"] = (
                strata_decode[row["pl"]] / row["decode_tokens_per_s"])
    return r


def _strata_stages(args: Any, cfg: EngineConfig, lanes: list[int], lengths: list[int],
                   out: dict[str, Any], stage: Any, tables: list[str]) -> None:
    """Strata's own figures through the engine (the model is dropped on return)."""
    from strata.models import load_model

    t0 = time.perf_counter()
    loaded = load_model(args.model, args.device, "auto", progress=False)
    attach_tokenizer(loaded)
    load_s = time.perf_counter() - t0
    out["load_seconds"] = load_s
    weight_bytes = sum(t.numel() * t.element_size() for t in loaded.model.parameters())
    out["weight_bytes"] = weight_bytes
    cuda = _engine_stages(args, cfg, loaded, weight_bytes, lanes, lengths, out, stage, tables)
    if args.long_context and cuda:  # the engine above and its pool are gone
        gc.collect()
        torch.cuda.empty_cache()
        stage("long_context_decode", lambda: long_context_runs(
            loaded, cfg, args.long_context, args.gen_tokens,
            [f for f in args.long_kv.split(",") if f]))


def _engine_stages(args: Any, cfg: EngineConfig, loaded: Any, weight_bytes: int, lanes: list[int],
                   lengths: list[int], out: dict[str, Any], stage: Any, tables: list[str]) -> bool:
    """The figures of one engine over `loaded` (`cfg`); True when it ran on CUDA."""
    parallel = max(lanes)

    def profiles() -> list[dict]:
        result = []
        for n in [int(x) for x in args.profile_lanes.split(",") if x]:
            summary, table = profile_step(engine, n, args.prompt_tokens)
            result.append(summary)
            tables.append(f"== decode step, {n} lanes at position {args.prompt_tokens} ==\n{table}")
        return result

    def warmup() -> float:  # compiles every kernel variant the runs below use
        t = time.perf_counter()
        for n in sorted({1, parallel}):
            decode_run(engine, n, args.prompt_tokens, 8, salt=90_000 + 100 * n)
        return time.perf_counter() - t

    with Engine(cfg, loaded=loaded) as engine:
        out["attention"] = use_gpu_attention(engine)
        own_graphs = without_decode_graphs(engine)  # the eager figures first, as before the hook
        out["runner_hooked"] = hasattr(engine.runner, "graphs")
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
        stage("warmup_seconds", warmup)
        if not args.skip_eager:
            stage("decode", lambda: [decode_run(engine, n, args.prompt_tokens, args.gen_tokens,
                                                salt=1000 * n) for n in lanes])
        stage("prompt", lambda: [prompt_run(engine, n, salt=500_000 + n) for n in lengths])
        if not args.skip_eager:
            stage("forward_step", lambda: [step_timing(engine, n, args.prompt_tokens) for n in lanes])
        if cuda:
            if not args.skip_eager:
                stage("profile", profiles)
            use_decode_graphs(engine, own_graphs)

            def graph_warmup() -> float:  # captures the padded sizes the runs below use
                t = time.perf_counter()
                for n in lanes:
                    decode_run(engine, n, args.prompt_tokens, 4, salt=95_000 + 100 * n)
                return time.perf_counter() - t

            stage("graphs_warmup_seconds", graph_warmup)
            stage("decode_graphs", lambda: [decode_run(engine, n, args.prompt_tokens, args.gen_tokens,
                                                       salt=2000 * n) for n in lanes])
            stage("forward_step_graphs",
                  lambda: [step_timing(engine, n, args.prompt_tokens) for n in lanes])
            tables_before = len(tables)
            stage("profile_graphs", profiles)
            sizes = [int(x) for x in args.company.split(",") if x]
            if sizes:
                stage("batch_company", lambda: batch_company(engine, sizes, args.prompt_tokens, 32))
            for i in range(tables_before, len(tables)):
                tables[i] = tables[i].replace("== decode step", "== decode step (CUDA graph)")
    return cuda


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="GPU throughput of the engine on one GGUF file (JSON)")
    p.add_argument("model")
    p.add_argument("--device", default="cuda")
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
    p.add_argument("--long-context", type=int, default=0,
                   help="also decode one lane after a prompt of this many tokens (e.g. 32768)")
    p.add_argument("--long-kv", default="bf16,int8,k8v4",
                   help="KV formats of the --long-context runs (bf16 first: the others' ratio)")
    p.add_argument("--out", default=None)
    p.add_argument("--profile-out", default=None)
    args = p.parse_args(argv)
    lanes = [int(x) for x in args.lanes.split(",") if x]
    lengths = [int(x) for x in args.prompt_lengths.split(",") if x]
    parallel = max(lanes)
    max_context = max(lengths + [args.prompt_tokens + args.gen_tokens]) + 64
    per_lane = args.prompt_tokens + args.gen_tokens + 1
    chunks = parallel * -(-per_lane // args.kv_chunk) + -(-max_context // args.kv_chunk) + 1
    cfg = EngineConfig(model=args.model, device=args.device, parallel=parallel, max_context=max_context,
                       kv_pool_tokens=chunks * args.kv_chunk, kv_chunk=args.kv_chunk, kv=args.kv,
                       prefill_chunk=args.prefill_chunk, max_queued=4 * parallel,
                       pipeline=args.pipeline)
    out: dict[str, Any] = {"model": args.model, "pipeline": args.pipeline}
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
                                              lanes, args.prompt_tokens, args.gen_tokens))
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
