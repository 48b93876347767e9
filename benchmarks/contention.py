"""Decode speed with the machine's cores to ourselves and with one of them kept busy (JSON).

    python -m benchmarks.contention [--model FILE.gguf] [--threads auto,1,2] [--loads quiet,busy]
        [--prompt-tokens 16] [--gen-tokens 128] [--warmup-tokens 64] [--repeats 2]
        [--busy-core N] [--llama-bench PATH] [--out FILE]

One lane of the default model (or --model) decodes `--gen-tokens` tokens
after a `--prompt-tokens` prompt, through the engine, at each --threads
setting (auto: the cores found, with the governor; a number: forced), with
no other load and with a busy loop (`while True: pass`) in a child process
pinned to one core (`--busy-core`, default the last CPU of the affinity
mask). Before each timed run a `--warmup-tokens` decode lets the engine
settle (the governor choose); the figure is tokens/s of the timed run, the
best of `--repeats` (the loads and settings alternate, so other work on a
shared machine weighs on all of them alike). With `--llama-bench PATH`,
llama.cpp's own benchmark runs tg `--gen-tokens` at 1 and 2 threads (or the
counts given) under the same loads. The load average of the machine before
each run is in the output: figures taken while other processes compile are
noisy, so compare the runs of one output.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from strata.bench.main import synthetic_prompt
from strata.bench.peers import parse_llama_bench
from strata.bench.report import emit
from strata.default_model import default_model_path
from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.threads import find_cores, parse_threads
from strata.engine.types import SamplingParams

BUSY_LOOP = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


@contextmanager
def load(kind: str, core: int) -> Iterator[None]:
    """`quiet`: nothing; `busy`: a child process spinning on `core` while the block runs."""
    if kind == "quiet":
        yield
        return
    child = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(core)])
    try:
        time.sleep(0.5)  # let it start and take its core
        yield
    finally:
        child.kill()
        child.wait()


def decode(engine: Engine, prompt: list[int], tokens: int) -> float:
    """Tokens/s of one lane's decode after its prompt (the first token, which reads it, not timed)."""
    events = iter(engine.generate(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True)))
    next(events)
    start = time.perf_counter()
    n = sum(len(ev.token_ids) for ev in events)
    return n / (time.perf_counter() - start)


def strata_run(engine: Engine, args: argparse.Namespace, salt: int) -> dict[str, Any]:
    vocab = engine.model_config.vocab_size
    if args.warmup_tokens > 0:
        decode(engine, synthetic_prompt(vocab, args.prompt_tokens, salt + 1), args.warmup_tokens)
    before = engine.stats()
    speed = decode(engine, synthetic_prompt(vocab, args.prompt_tokens, salt), args.gen_tokens)
    after = engine.stats()
    return {"decode_tokens_per_s": round(speed, 2), "threads_at_end": after["cpu_threads"],
            "switches": after["cpu_thread_switches"] - before["cpu_thread_switches"],
            "probes": after["cpu_thread_probes"] - before["cpu_thread_probes"]}


def llama_run(binary: str, model: str, args: argparse.Namespace, threads: int) -> dict[str, Any]:
    cmd = [binary, "-m", model, "-p", str(args.prompt_tokens), "-n", str(args.gen_tokens),
           "-t", str(threads), "-r", "2", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
    return {k: round(v, 2) for k, v in parse_llama_bench(done.stdout).items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded model)")
    ap.add_argument("--threads", default="auto,1,2", help="comma-separated: auto and/or counts")
    ap.add_argument("--loads", default="quiet,busy", help="comma-separated: quiet, busy")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--warmup-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--busy-core", type=int, default=None, help="the CPU the busy loop spins on")
    ap.add_argument("--llama-bench", default=None, metavar="PATH", help="a llama-bench binary")
    ap.add_argument("--llama-threads", default="1,2", help="llama-bench's thread counts")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    settings = args.threads.split(",")
    loads = args.loads.split(",")
    core = args.busy_core if args.busy_core is not None else max(os.sched_getaffinity(0))
    cores = find_cores()
    loadavg_start = [round(x, 2) for x in os.getloadavg()]
    path = str(default_model_path()) if args.model is None else args.model
    name = Path(path).stem
    max_context = args.prompt_tokens + args.warmup_tokens + args.gen_tokens + 8
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in range(args.repeats):
        for kind in loads:
            with load(kind, core):
                for t in settings:
                    before = round(os.getloadavg()[0], 2)
                    # one engine at a time, loading the model on its own thread as `strata serve`
                    # does: OpenMP keeps a pool of workers per thread that ran a parallel region,
                    # and with more workers than cores libgomp stops spinning (docs/PERFORMANCE.md,
                    # "CPU threads under contention"), which would slow every setting but one
                    config = EngineConfig(model=path, device="cpu", dtype="bfloat16", threads=parse_threads(t),
                                          max_context=max_context)
                    with Engine(config) as engine:
                        figures = strata_run(engine, args, salt=100 * r + 7)
                    figures["loadavg_1min_before"] = before
                    print(f"{kind} --threads {t}: {figures}", file=sys.stderr, flush=True)
                    runs.setdefault((kind, t), []).append(figures)
    table = {kind: {t: max(runs[kind, t], key=lambda f: f["decode_tokens_per_s"]) for t in settings}
             for kind in loads}
    result: dict[str, Any] = {
        "model": name, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
        "cores": {"affinity": cores.affinity, "quota": cores.quota, "threads_auto": cores.threads},
        "busy_core": core, "repeats": args.repeats, "loadavg_start": loadavg_start, "strata": table,
        "strata_all_runs": {f"{k}/{t}": v for (k, t), v in runs.items()},
    }
    if "quiet" in loads and "busy" in loads:
        result["busy_over_quiet"] = {
            t: round(table["busy"][t]["decode_tokens_per_s"] / table["quiet"][t]["decode_tokens_per_s"], 3)
            for t in settings}
        if "auto" in settings:  # the target: auto under load against the best quiet speed
            best_quiet = max(f["decode_tokens_per_s"] for f in table["quiet"].values())
            result["auto_busy_over_best_quiet"] = round(
                table["busy"]["auto"]["decode_tokens_per_s"] / best_quiet, 3)
    if args.llama_bench:
        peer: dict[str, Any] = {}
        for kind in loads:
            with load(kind, core):
                for t in args.llama_threads.split(","):
                    before = round(os.getloadavg()[0], 2)
                    peer[f"{kind}/{t}"] = llama_run(args.llama_bench, path, args, int(t))
                    peer[f"{kind}/{t}"]["loadavg_1min_before"] = before
        result["llama_bench"] = peer
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
