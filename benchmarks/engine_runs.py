"""Timed runs through one `strata.engine.Engine` on the GPU, for `benchmarks.gpu_bench`.

Decode of many lanes together, one lane's prompt reads, the runner's forward
of one decode step alone and its torch profile, a lane's output among
others; the device's copy bandwidth (the one-lane limit's denominator).
Eager steps and CUDA-graph steps are chosen through the runner's own
`graphs` (`eager_steps`, `use_decode_graphs`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from strata.bench.main import synthetic_prompt
from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.runner import Runner
from strata.engine.types import SamplingParams
from strata.kv.step import SeqSpec


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


@contextlib.contextmanager
def eager_steps(runner: Runner) -> Iterator[None]:
    """Every step runs eagerly inside: the runner's decode graphs are taken out, then put back."""
    graphs, runner.graphs = runner.graphs, None
    try:
        yield
    finally:
        runner.graphs = graphs


def use_decode_graphs(runner: Runner) -> None:
    """Pure decode steps through CUDA graphs: the runner's own, or new ones where it has none."""
    if runner.graphs is None:
        from strata.engine.graphs import DecodeGraphs  # imports Triton

        runner.graphs = DecodeGraphs(runner.model, runner.pool, runner.scale)


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


def _decode_step(engine: Engine, lanes: int, position: int,
                 rows: int = 1) -> tuple[list[SeqSpec], list[int], list[int]]:
    """One decode step of `lanes` lanes at `position`, each feeding `rows` tokens with logits for
    all of them (above 1: a verified draft; reserving their chunks; the engine is idle)."""
    for i in range(lanes):
        assert engine.pool.reserve(i, position + rows), "pool too small for the profiled step"
    seqs = [SeqSpec(i, position, rows) for i in range(lanes)]
    return seqs, [100 + i for i in range(lanes) for _ in range(rows)], [rows] * lanes


def step_timing(engine: Engine, lanes: int, position: int, reps: int = 20, rows: int = 1) -> dict:
    """Wall time of the runner's forward for one decode step of `rows` rows a lane, synchronized
    (no sampling, no engine). Call it on the engine's thread (`engine.call`), as its steps run: on
    the CPU another thread's OpenMP pool slows both (engine/threads.py)."""
    seqs, toks, sample = _decode_step(engine, lanes, position, rows)
    for _ in range(3):
        engine.runner.forward(seqs, toks, sample)
    _sync(engine)
    t0 = time.perf_counter()
    for _ in range(reps):
        engine.runner.forward(seqs, toks, sample)
    _sync(engine)
    ms = (time.perf_counter() - t0) / reps * 1e3
    return {"lanes": lanes, "position": position, "rows_per_lane": rows, "forward_ms": ms,
            "forward_tokens_per_s": lanes * rows / ms * 1e3}


def profile_step(engine: Engine, lanes: int, position: int, reps: int = 5) -> tuple[dict, str]:
    """Torch profiler over `reps` decode steps: device time per step and the costliest operators.
    On the engine's thread, as `step_timing`."""
    from torch.profiler import ProfilerActivity, profile

    seqs, toks, sample = _decode_step(engine, lanes, position)
    engine.runner.forward(seqs, toks, sample)
    _sync(engine)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            engine.runner.forward(seqs, toks, sample)
        _sync(engine)
    events = prof.key_averages()

    def is_kernel(e: Any) -> bool:  # operators also carry their kernels' time: count kernels once
        return str(e.device_type).endswith("CUDA")

    kernels = [e for e in events if is_kernel(e)]
    total = sum(float(e.self_device_time_total) for e in kernels)
    top = sorted(kernels, key=lambda e: float(e.self_device_time_total), reverse=True)[:12]
    summary = {
        "lanes": lanes,
        "position": position,
        "device_ms_per_step": total / reps / 1e3,
        "cpu_ms_per_step": sum(float(e.self_cpu_time_total) for e in events if not is_kernel(e)) / reps / 1e3,
        "top": [{"name": e.key[:80], "device_ms_per_step": float(e.self_device_time_total) / reps / 1e3,
                 "calls_per_step": e.count / reps} for e in top],
    }
    return summary, events.table(sort_by="self_device_time_total", row_limit=30)
