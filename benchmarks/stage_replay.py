"""Two chats on one long system prompt, replayed through a remote stage (a benchmark, not a test).

    python -m benchmarks.stage_replay [--system-tokens 3000] [--gen 32] [--threads 1]

Two chats of four turns share one system prompt of about `--system-tokens`
tokens; their turns alternate (A1 B1 A2 B2 ...) on one lane, so every turn
after the first two finds the other chat in the lane and must get its own
conversation back. Each configuration is a fresh engine on the same model:

- `one_process`: no split; parked conversations keep every layer here.
- `remote_from_0`: layers from `--split-at` in a `strata stage` worker, no
  prefix reuse: every prompt is read from token 0 (the cost to beat).
- `remote_parking`: parking ships the worker's K/V to this process's cache.
- `remote_prompt_cache`: the worker keeps its part under ids (`--prompt-cache`).

One worker process serves the remote configurations in turn. Per turn it
records the time to the first token, the total time, the prompt and reused
tokens and the decode rate; per configuration the later turns' time to first
token against `remote_from_0`'s, decode tokens/s against `one_process`'s, the
link's figures, and whether the greedy tokens equal `one_process`'s. Prints
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.stage_process import NO_MULTICAST, StageProcess
from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from strata.tokenizer.tokenizer import Tokenizer

CONFIGS = ("one_process", "remote_from_0", "remote_parking", "remote_prompt_cache")
TURNS = 4
GUIDELINE = (
    "Section {n}. Every module of the Larkspur ledger service has one job, and its docstring says "
    "why it exists rather than what each line does. Functions take their context as arguments; no "
    "module keeps hidden global state, and configuration travels in frozen dataclasses. Public "
    "functions carry type hints, errors are raised as the service's own exception types with a "
    "message a user can act on, and a retry is never silent: it is logged with the reason and the "
    "attempt number. Tests mirror the package layout, run without a network, and build their own "
    "small fixtures instead of reading files from a developer's machine.\n\n"
)
QUESTIONS = {
    "A": ["How should I name a new module that reconciles invoices?",
          "Where does its configuration live?",
          "How do I report a failed reconciliation?",
          "What must its tests avoid?"],
    "B": ["May a helper keep a cache in a module-level dictionary?",
          "What goes in a docstring?",
          "How are retries handled?",
          "Which exceptions should the importer raise?"],
}


@dataclass(frozen=True)
class Turn:
    chat: str
    index: int  # 1-based, within its chat


def replay_order() -> list[Turn]:
    """A1 B1 A2 B2 ...: each turn after the first two finds the other chat in the lane."""
    return [Turn(chat, i) for i in range(1, TURNS + 1) for chat in ("A", "B")]


def system_prompt(tok: Tokenizer, tokens: int) -> str:
    """Numbered guideline sections until the text is at least `tokens` tokens long."""
    parts: list[str] = []
    while len(tok.encode("".join(parts))) < tokens:
        parts.append(GUIDELINE.format(n=len(parts) + 1))
    return "".join(parts)


def start_worker(args: argparse.Namespace, key_file: Path, log_file: Path) -> StageProcess:
    flags = ["--device", args.worker_device or args.device, "--stage-key-file", str(key_file), "--dtype", args.dtype,
             "--weights", args.weights, "--threads", str(args.threads)]
    return StageProcess(flags + (["--model", args.model] if args.model is not None else []), log_file)


def engine_config(name: str, base: EngineConfig, address: str | None, key_file: Path,
                  split_at: int, cache_mib: int) -> EngineConfig:
    """The engine of one configuration; `cache_mib`: the conversation cache of those that park."""
    if name == "one_process":
        return replace(base, conversation_cache_mib=cache_mib)
    remote = replace(base, remote_stage=address, stage_key_file=str(key_file), split_at=split_at)
    if name == "remote_from_0":
        return replace(remote, prefix_reuse=False)
    if name == "remote_parking":
        return replace(remote, conversation_cache_mib=cache_mib)
    return replace(remote, prompt_cache=4)


def run_turn(eng: Engine, prompt: list[int], gen: int) -> dict[str, Any]:
    """One streamed request: time to the first token, total time, and the decode rate after it."""
    t0 = time.perf_counter()
    first: float | None = None
    ids: list[int] = []
    last = None
    for ev in eng.generate(prompt, SamplingParams(max_tokens=gen, ignore_eos=True)):
        if ev.token_ids and first is None:
            first = time.perf_counter()
        ids.extend(ev.token_ids)
        last = ev
    end = time.perf_counter()
    assert first is not None and last is not None, "the request produced no token"
    after = end - first
    return {"prompt_tokens": len(prompt), "cached_tokens": last.cached_tokens,
            "ttft_s": round(first - t0, 4), "total_s": round(end - t0, 4),
            "decode_tokens_per_s": round((len(ids) - 1) / after, 2) if len(ids) > 1 and after > 0 else None,
            "decode_s": after, "token_ids": ids}


def replay(eng: Engine, system: str, gen: int, label: str) -> list[dict[str, Any]]:
    """The interleaved turns; each reply (decoded text) joins its chat before its next turn.
    A line per turn goes to stderr, since a configuration takes minutes on a small CPU."""
    tok = eng.tokenizer
    chats: dict[str, list[dict[str, str]]] = {c: [{"role": "system", "content": system}] for c in QUESTIONS}
    rows = []
    for turn in replay_order():
        messages = chats[turn.chat]
        messages.append({"role": "user", "content": QUESTIONS[turn.chat][turn.index - 1]})
        prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
        row = run_turn(eng, prompt, gen)
        messages.append({"role": "assistant", "content": tok.decode(row["token_ids"])})
        rows.append({"turn": f"{turn.chat}{turn.index}", **row})
        print(f"{label} {turn.chat}{turn.index}: {row['prompt_tokens']} prompt tokens, "
              f"{row['cached_tokens']} reused, first token {row['ttft_s']:.3f} s", file=sys.stderr)
    return rows


def later(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if not r["turn"].endswith("1")]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    decoded = sum(len(r["token_ids"]) - 1 for r in rows)
    seconds = sum(r["decode_s"] for r in rows)
    ttft = [r["ttft_s"] for r in later(rows)]
    return {"first_turn_ttft_s": {r["turn"][0]: r["ttft_s"] for r in rows if r["turn"].endswith("1")},
            "later_ttft_s": {"min": min(ttft), "max": max(ttft)},
            "decode_tokens_per_s": round(decoded / seconds, 2) if seconds > 0 else None}


def compare(results: dict[str, dict[str, Any]]) -> None:
    """Later turns' time to first token against a from-0 read; decode rate and tokens against
    one process."""
    from_0 = results.get("remote_from_0")
    one = results.get("one_process")
    for res in results.values():
        if from_0 is not None:
            ratios = [a["ttft_s"] / b["ttft_s"] for a, b in zip(later(res["turns"]), later(from_0["turns"]))]
            res["later_ttft_vs_from_0"] = {"min": round(min(ratios), 4), "max": round(max(ratios), 4),
                                           "target_max": 0.05}
        if one is not None and res is not one:
            res["same_tokens_as_one_process"] = all(
                a["token_ids"] == b["token_ids"] for a, b in zip(res["turns"], one["turns"]))
            if "link" in res:
                res["decode_vs_one_process"] = round(
                    res["summary"]["decode_tokens_per_s"] / one["summary"]["decode_tokens_per_s"], 4)
    for res in results.values():
        for r in res["turns"]:
            r["decode_s"] = round(r["decode_s"], 4)
            r["generated"] = len(r.pop("token_ids"))


def link_figures(eng: Engine) -> dict[str, Any] | None:
    """The remote stage's figures (read before the engine closes its link), or None."""
    stages = eng.stats()["stages"]
    if not stages or len(stages) < 2:
        return None
    s = stages[1]
    return {k: s.get(k) for k in ("layers", "steps", "link_seconds_per_step", "bytes_per_step",
                                   "bytes_sent", "bytes_received", "kept_parts", "connects")}


def engine_counters(eng: Engine) -> dict[str, Any]:
    st = eng.stats()
    keys = ("prefix_reuse_hits", "prefix_tokens_reused", "conversation_parks", "conversation_restores",
            "conversation_tokens_restored", "restore_misses")
    return {k: st[k] for k in keys}


class _Counted(Exception):
    def __init__(self, layers: int) -> None:
        self.layers = layers


def layer_count(model: str | None) -> int:
    """The model's layers, for the default split point (half of them): the loader stops at the
    placement question, before any weight is read."""
    from strata.models.base import ModelConfig
    from strata.models.loader import Placement, load_model

    def count(cfg: ModelConfig) -> Placement:
        raise _Counted(cfg.num_layers)

    try:
        load_model(model, "cpu", "auto", progress=False, place=count)
    except _Counted as c:
        return c.layers
    raise AssertionError("the loader never asked where the layers go")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or model folder (default: the embedded model)")
    ap.add_argument("--device", default="cpu", help="the main's device (and the worker's, unless --worker-device)")
    ap.add_argument("--worker-device", default=None,
                    help="the worker's device, e.g. cuda:1 beside a main on cuda:0 (NCCL between them)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="both processes' compute dtype")
    ap.add_argument("--weights", default="dense", choices=["auto", "dense", "int8", "int4"],
                    help="both processes' weights (the worker's must match the main's)")
    ap.add_argument("--system-tokens", type=int, default=3000)
    ap.add_argument("--gen", type=int, default=32, help="tokens generated per turn")
    ap.add_argument("--split-at", type=int, default=None, help="default: half the model's layers")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each process")
    ap.add_argument("--cache-mib", type=int, default=1024,
                    help="conversation cache of the parking configurations (both chats must fit)")
    ap.add_argument("--parallel", type=int, default=1,
                    help="lanes (1: each turn finds the other chat in the lane and must get its own back)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default=None, help="also write the JSON to this file")
    args = ap.parse_args(argv)
    os.environ.update(NO_MULTICAST)  # this process's NCCL too (a worker on another GPU)
    names = [c for c in args.configs.split(",") if c]
    unknown = set(names) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configurations: {', '.join(sorted(unknown))}")
    split_at = args.split_at or layer_count(args.model) // 2
    # room for the system prompt, every turn's question and template, and its reply
    max_context = args.system_tokens + 2 * TURNS * (args.gen + 64) + 256
    base = EngineConfig(model=args.model, device=args.device, parallel=args.parallel, max_context=max_context,
                        dtype=args.dtype, weights=args.weights, threads=args.threads)
    out: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "model": args.model or "embedded default", "device": args.device,
        "worker_device": args.worker_device or args.device, "dtype": args.dtype,
        "weights": args.weights, "threads_per_process": args.threads, "parallel": args.parallel,
        "split_at": split_at, "gen": args.gen, "turns": [t.chat + str(t.index) for t in replay_order()],
        "configs": {}}
    results: dict[str, dict[str, Any]] = out["configs"]
    worker: StageProcess | None = None
    mains = 0
    with tempfile.TemporaryDirectory() as tmp:
        key_file = Path(tmp) / "stage.key"
        key_file.write_text(os.urandom(24).hex() + "\n")
        key_file.chmod(0o600)
        try:
            if any(n != "one_process" for n in names):
                worker = start_worker(args, key_file, Path(tmp) / "stage.log")
            system: str | None = None
            for name in sorted(names, key=CONFIGS.index):  # one_process first: the reference
                cfg = engine_config(name, base, worker.address if worker else None, key_file, split_at,
                                    args.cache_mib)
                t0 = time.perf_counter()
                with Engine(cfg) as eng:
                    load_s = time.perf_counter() - t0
                    if system is None:
                        system = system_prompt(eng.tokenizer, args.system_tokens)
                        out["system_tokens"] = len(eng.tokenizer.encode(system))
                    # kernels compile and graphs are captured outside the timed turns (on the GPU,
                    # the first configuration would otherwise pay for them)
                    eng.complete(eng.tokenizer.encode("Warm up."), SamplingParams(max_tokens=8, ignore_eos=True))
                    rows = replay(eng, system, args.gen, name)
                    res = {"load_s": round(load_s, 2), "summary": summarize(rows), "turns": rows,
                           "counters": engine_counters(eng)}
                    link = link_figures(eng)
                    if link is not None:
                        res["link"] = link
                results[name] = res
                if worker is not None and cfg.remote_stage is not None:
                    mains += 1
                    worker.wait_for(" gone (", 30, count=mains)  # the next main is not refused
        except Exception:
            if worker is not None:  # the worker's side of a failure
                sys.stderr.write(worker.log()[-4000:])
            raise
        finally:
            if worker is not None:
                worker.kill()
    compare(results)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
