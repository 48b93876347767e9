"""Speculative decoding measured (issue 19): agent-style and open-text conversations with and without
drafts, at one lane and many, beside llama.cpp's own n-gram speculation on the same file (JSON).

    python -m benchmarks.spec_bench [--specs off,2,4,8,auto] [--lanes 1,16] [--max-tokens 256]
        [--llama-server PATH] [--llama-spec none,ngram-simple,ngram-mod] [--quick] [--out FILE]
    python -m benchmarks.spec_bench --verify-cost [--device cuda --synth llama-3.1-8b
        --tokenizer-from .bench/tokenizer.gguf]

Workloads (`spec_workloads.py`): (a) agent, conversations that re-emit a file with one edit and
then the answer with another, or quote a tool's output back and summarise it; (b) open text,
stories and explanations with nothing to copy. Every request is rendered with the model's chat
template and sent to `Engine` directly; one model load, one engine per configuration and lane
count (so no configuration drafts from another's finished conversations). Greedy unless said;
the agent workload also runs sampled (temperature 0.7, seeded) for `--sampled-specs`. Above one
lane the configurations are `--multi-lane-specs` (a CPU step of 8 decode rows takes no drafts, so
there the runs check that nothing is lost) on `--multi-lane-workloads`. `--proposers` picks which
proposers draft: the suffix proposer, a draft model (`--spec-model FILE`, loaded once and shared),
or both.

Each run reports `tokens_per_s` (every generated token over the run's wall time, prompt reads
included: at 16 lanes the throughput of all of them) and `lane_decode_tokens_per_s` (tokens after
each request's first over the time after it: at one lane the decode rate), both also as ratios to
spec off on the same workload and lane count (`speedup`, `decode_speedup`); the acceptance rate
and mean accepted length from `Engine.stats()["speculation"]`; and `identical`: whether every
answer equals spec off's token for token (the exactness claim). On CUDA spec off runs twice: with
the engine's default products (the speed reference) and with batch-invariant ones (the answer:
drafted runs use those products, `--batch-invariant auto`), after one untimed request that
compiles the kernels (`--no-warmup` skips it). llama-server (`--llama-server`)
gets the same conversations as token ids through /completion, greedy, the same thread count, with
each `--llama-spec` type against its own run without; its figures come from its `timings`.

`--verify-cost` (`spec_verify.py`) measures what does not depend on the weights, for random-weight
models on the GPU (and on the CPU too): a step of k + 1 rows a lane against one row, k = 0..8, at
1 and 16 lanes, and a regenerate (the same requests twice; the second drafts from the first).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.engine_runs import attach_tokenizer
from benchmarks.llama_server import LlamaServer
from benchmarks.spec_replay import (
    compare,
    engine_sender,
    llama_figures,
    llama_sender,
    outputs,
    replay,
    summarise,
)
from benchmarks.spec_verify import regenerate, verify_costs
from benchmarks.spec_workloads import Conversation, agent_conversations, open_conversations, sources
from strata.bench.report import emit
from strata.engine.config import EngineConfig, probability_arg, spec_arg
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams

Spec = tuple[str, int]  # the flag's spelling and the draft count it means
FULL = {"specs": "off,2,4,8,auto", "multi_lane_specs": "off,auto", "lanes": "1,16", "max_tokens": 256,
        "file_tokens": 500, "conversations": 4, "open": 3, "sampled_specs": "off,auto",
        "llama_spec": "none,ngram-simple,ngram-mod"}
QUICK = {"specs": "off,auto", "multi_lane_specs": "off,auto", "lanes": "1,4", "max_tokens": 64,
         "file_tokens": 300, "conversations": 2, "open": 2, "sampled_specs": "off,auto",
         "llama_spec": "none,ngram-simple"}
PROPOSERS = ("suffix", "draft_model", "suffix+draft_model")
WORKLOADS = ("agent", "open")
LLAMA_SPEC_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
SAMPLED_TEMPERATURE = 0.7


def spec_list(text: str) -> list[Spec]:
    """--specs: comma-separated --spec values (off, auto, or a count)."""
    try:
        return [(s, spec_arg(s)) for s in text.split(",") if s]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"--specs: {e}") from None


def count_list(text: str) -> list[int]:
    if not all(s.isdigit() and int(s) > 0 for s in text.split(",")):
        raise argparse.ArgumentTypeError(f"positive counts separated by commas, not {text!r}")
    return [int(s) for s in text.split(",")]


def workload_list(text: str) -> list[str]:
    bad = [t for t in text.split(",") if t not in WORKLOADS]
    if bad:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(WORKLOADS)}, not {bad[0]!r}")
    return text.split(",")


def proposer_list(text: str) -> list[str]:
    bad = [t for t in text.split(",") if t not in PROPOSERS]
    if bad:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(PROPOSERS)}, not {bad[0]!r}")
    return text.split(",")


def llama_types(text: str) -> list[str]:
    bad = [t for t in text.split(",") if t not in LLAMA_SPEC_TYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(LLAMA_SPEC_TYPES)}, not {bad[0]!r}")
    return text.split(",")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spec_bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--weights", default="auto", help="as strata serve's --weights")
    p.add_argument("--synth", default=None, metavar="SHAPE",
                   help="write a random-weight GGUF of this tools.synth shape (e.g. llama-3.1-8b) and use it")
    p.add_argument("--tokenizer-from", default=None, metavar="GGUF",
                   help="with --synth: the GGUF whose tokenizer it gets (default: the embedded model)")
    p.add_argument("--specs", type=spec_list, default=None, help=f"--spec values to run (default {FULL['specs']})")
    p.add_argument("--multi-lane-specs", type=spec_list, default=None,
                   help=f"--spec values at lane counts above 1 (default {FULL['multi_lane_specs']}: on the CPU "
                        "a step of 8 decode rows takes no drafts, so 16 lanes check only that nothing is lost)")
    p.add_argument("--multi-lane-workloads", type=workload_list, default=["agent"],
                   help="the workloads run above one lane (default agent; agent,open for both)")
    p.add_argument("--spec-min-p", type=probability_arg, default=0.0)
    p.add_argument("--proposers", type=proposer_list, default=["suffix"],
                   help=f"which proposers draft in each spec run, from {', '.join(PROPOSERS)} (default "
                        "suffix; draft_model needs --spec-model)")
    p.add_argument("--spec-model", default=None, metavar="FILE",
                   help="the draft model (a small model with the same tokenizer), loaded once")
    p.add_argument("--lanes", type=count_list, default=None, help=f"lane counts (default {FULL['lanes']})")
    p.add_argument("--max-tokens", type=int, default=None, help=f"per request (default {FULL['max_tokens']})")
    p.add_argument("--file-tokens", type=int, default=None,
                   help=f"tokens of each quoted file (default {FULL['file_tokens']})")
    p.add_argument("--conversations", type=int, default=None,
                   help=f"agent conversations at one lane; at N lanes at least N (default {FULL['conversations']})")
    p.add_argument("--open", type=int, default=None,
                   help=f"open-text requests at one lane; at N lanes at least N (default {FULL['open']})")
    p.add_argument("--sampled-specs", type=spec_list, default=None,
                   help=f"--spec values of the sampled agent run at the first lane count (default "
                        f"{FULL['sampled_specs']}; empty: none)")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="CPU threads for Strata and llama-server alike (default: this process's CPUs)")
    p.add_argument("--llama-server", default=None, metavar="PATH", help="llama.cpp's llama-server binary")
    p.add_argument("--llama-spec", type=llama_types, default=None,
                   help=f"its --spec-type values, none first (default {FULL['llama_spec']})")
    p.add_argument("--llama-lanes", type=count_list, default=[1], help="its -np runs (default 1)")
    p.add_argument("--llama-args", default="", help="more llama-server arguments, e.g. '-ngl 99'")
    p.add_argument("--verify-cost", action="store_true", help="the forward cost and regenerate figures instead")
    p.add_argument("--position", type=int, default=512, help="--verify-cost: the context of the timed steps")
    p.add_argument("--verify-drafts", type=count_list, default=None,
                   help="--verify-cost: the draft counts k of the timed steps (default 1..8; 0 always)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="on CUDA, skip the untimed first request that compiles the kernels")
    p.add_argument("--reps", type=int, default=10, help="--verify-cost: forwards timed per figure")
    p.add_argument("--quick", action="store_true", help="a smoke run: " + ", ".join(
        f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()) + " (flags given still win)")
    p.add_argument("--out", default=None)
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """The flags left unset take --quick's or the full run's values; a draft model named or used
    without the other."""
    if any("draft_model" in p for p in args.proposers) != (args.spec_model is not None):
        parser().error("--spec-model and a draft_model entry in --proposers go together")
    chosen = QUICK if args.quick else FULL
    convert = {"specs": spec_list, "multi_lane_specs": spec_list, "sampled_specs": spec_list,
               "lanes": count_list, "llama_spec": llama_types}
    for key, value in chosen.items():
        if getattr(args, key) is None:
            setattr(args, key, convert[key](value) if key in convert else value)
    return args


@dataclass(frozen=True)
class Models:
    """The model every engine shares, its file (llama-server's too), and any draft model."""

    loaded: Any
    path: str
    draft: Any = None


@dataclass(frozen=True)
class Run:
    """One configuration: the --spec spelling, its draft count, the proposers that draft."""

    spec: str
    drafts: int
    proposers: str = ""  # "" when off; else suffix, draft_model or suffix+draft_model
    batch_invariant: str = "auto"  # the engine's --batch-invariant (auto: on with drafts)


def load(args: argparse.Namespace) -> Models:
    from strata.default_model import default_model_path
    from strata.models import load_model

    path = args.model
    if args.synth:
        from tools.synth import SHAPES, copy_tokenizer_fields, write_gguf

        path = str(Path(tempfile.mkdtemp(prefix="spec-bench-")) / f"{args.synth}.gguf")
        src = args.tokenizer_from or str(default_model_path())
        write_gguf(Path(path), SHAPES[args.synth], copy_tokenizer_fields(src), name=f"synthetic-{args.synth}")
    path = path or str(default_model_path())
    loaded = load_model(path, args.device, "auto", progress=False, weights=args.weights)
    attach_tokenizer(loaded)
    draft = None
    if args.spec_model:
        draft = load_model(args.spec_model, args.device, "auto", progress=False, weights=args.weights)
        attach_tokenizer(draft)
    return Models(loaded, path, draft)


def engine_config(args: argparse.Namespace, lanes: int, drafts: int, suffix: bool = True,
                  batch_invariant: str = "auto") -> EngineConfig:
    return EngineConfig(device=args.device, parallel=lanes, max_context=args.max_context,
                        threads=args.threads, max_queued=4 * lanes, spec=drafts,
                        spec_min_p=args.spec_min_p, suffix_draft=suffix, batch_invariant=batch_invariant)


def open_engine(models: Models, args: argparse.Namespace, lanes: int, run: Run) -> Engine:
    cfg = engine_config(args, lanes, run.drafts, suffix="suffix" in run.proposers,
                        batch_invariant=run.batch_invariant)
    draft = models.draft if "draft_model" in run.proposers else None
    return Engine(cfg, loaded=models.loaded, spec_model=draft)


def runs_of(specs: list[Spec], proposers: list[str], exact_off: bool = False) -> tuple[list[Run], dict[str, str]]:
    """Off first, then each distinct draft count with each proposer set; the spellings that
    repeat another's count (auto = 8 today) are named instead of run again.

    `exact_off` (CUDA): a second off run with batch-invariant products, the answer drafts must
    keep (with drafts the engine's products are invariant; without, the faster one-row kernels
    and cuBLAS round differently); the first off run stays the speed reference."""
    counts: dict[int, str] = {0: "off"}
    same: dict[str, str] = {}
    for label, n in specs:
        if n in counts and counts[n] != label:
            same[label] = counts[n]
        counts.setdefault(n, label)
    runs = [Run("off", 0)] + ([Run("off", 0, batch_invariant="on")] if exact_off else [])
    runs += [Run(label, n, p) for n, label in counts.items() if n for p in proposers]
    return runs, same


def _with_ratios(row: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    for key, rate in (("speedup", "tokens_per_s"), ("decode_speedup", "lane_decode_tokens_per_s")):
        row[key] = row[rate] / ref[rate] if ref[rate] else None
    return row


def workload_runs(models: Models, args: argparse.Namespace, name: str, convs: list[Conversation], lanes: int,
                  specs: list[Spec], temperature: float) -> list[dict[str, Any]]:
    """One workload at one lane count under each configuration (off first): figures, ratios and
    whether every answer equals off's."""
    cuda = str(args.device).startswith("cuda")
    runs, same = runs_of(specs, args.proposers, exact_off=cuda)
    rows: list[dict[str, Any]] = []
    ref: dict[str, Any] = {}
    answers: dict[str, Any] = {}  # batch_invariant -> the off run's outputs: what drafts must keep
    if cuda and args.warmup:  # Triton compiles each kernel variant (per row count) at its first use
        for run in runs[:2]:  # in the process: the default products and the invariant ones
            with open_engine(models, args, lanes, run) as engine:
                replay(convs[:lanes], lanes, engine_sender(engine, 16, temperature), engine.tokenizer)
    for run in runs:
        with open_engine(models, args, lanes, run) as engine:
            records, wall = replay(convs, lanes, engine_sender(engine, args.max_tokens, temperature),
                                   engine.tokenizer)
            stats = engine.stats()
            invariant = engine.batch_invariant
        row = {"workload": name, "temperature": temperature, "lanes": lanes, **dataclasses.asdict(run),
               "invariant_products": invariant, **summarise(records, wall), "steps": stats["steps"],
               "speculation": stats["speculation"]}
        got = outputs(records)
        if not ref:
            ref = row
        if run.drafts == 0:
            answers.setdefault(str(invariant), got)
            row["outputs"] = got
        else:
            check = compare(got, answers.get(str(invariant), ref["outputs"]))
            row.update(identical=check["identical"], first_difference=check["first_difference"])
        rows.append(_with_ratios(row, ref))
        print(json.dumps({k: v for k, v in row.items() if k != "outputs"}), file=sys.stderr, flush=True)
    rows += [{"workload": name, "temperature": temperature, "lanes": lanes, "spec": label, "same_as": other}
             for label, other in same.items()]
    return rows


def strata_runs(models: Models, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both workloads greedy at every lane count, and the agent workload sampled at the first."""
    count = lambda text: len(models.loaded.tokenizer.encode(text))  # noqa: E731
    rows: list[dict[str, Any]] = []
    for lanes in args.lanes:
        specs = args.specs if lanes == 1 else args.multi_lane_specs
        workloads = WORKLOADS if lanes == 1 else args.multi_lane_workloads
        if "agent" in workloads:
            agent = agent_conversations(max(args.conversations, lanes), count, args.file_tokens)
            rows += workload_runs(models, args, "agent", agent, lanes, specs, 0.0)
        if "open" in workloads:
            rows += workload_runs(models, args, "open", open_conversations(max(args.open, lanes)), lanes,
                                  specs, 0.0)
    if args.sampled_specs:
        lanes = args.lanes[0]
        agent = agent_conversations(max(args.conversations, lanes), count, args.file_tokens)
        rows += workload_runs(models, args, "agent", agent, lanes, args.sampled_specs, SAMPLED_TEMPERATURE)
    key = lambda r: (r["workload"], r["invariant_products"])  # noqa: E731
    first = {key(r): r["outputs"] for r in rows
             if "outputs" in r and r["lanes"] == args.lanes[0] and r["temperature"] == 0.0}
    for r in rows:  # spec off among more lanes against spec off at the first count: does company matter?
        if "outputs" in r and r["lanes"] != args.lanes[0] and r["temperature"] == 0.0 and key(r) in first:
            r["identical_to_first_lane_count"] = compare(r["outputs"], first[key(r)])["identical"]
    return rows


def llama_runs(models: Models, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The same conversations through llama-server, greedy, per --spec-type and lane count."""
    tokenizer = models.loaded.tokenizer
    count = lambda text: len(tokenizer.encode(text))  # noqa: E731
    rows = []
    for lanes in args.llama_lanes:
        workloads = {"agent": agent_conversations(max(args.conversations, lanes), count, args.file_tokens),
                     "open": open_conversations(max(args.open, lanes))}
        refs: dict[str, tuple[dict, dict]] = {}
        for spec_type in args.llama_spec:
            extra = args.llama_args.split() + (["--spec-type", spec_type] if spec_type != "none" else [])
            with LlamaServer(args.llama_server, models.path, args.max_context, extra, lanes=lanes,
                             threads=args.threads) as server:
                for name, convs in workloads.items():
                    records, wall = replay(convs, lanes, llama_sender(server.url, args.max_tokens), tokenizer)
                    row = {"workload": name, "lanes": lanes, "spec_type": spec_type,
                           **summarise(records, wall), **llama_figures(records)}
                    if name not in refs:
                        refs[name] = (row, outputs(records))
                    else:
                        row["identical"] = compare(outputs(records), refs[name][1])["identical"]
                    rows.append(_with_ratios(row, refs[name][0]))
                    print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def versus_llama(strata: list[dict[str, Any]], llama: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Strata's tokens/s over llama-server's, greedy, per workload and lane count: each without
    speculation, and each at its fastest speculation."""
    out = []
    for peer in (r for r in llama if r["spec_type"] == "none"):
        ours = [r for r in strata if r.get("workload") == peer["workload"] and r.get("lanes") == peer["lanes"]
                and r.get("temperature") == 0.0 and "tokens_per_s" in r]
        theirs = [r for r in llama if r["workload"] == peer["workload"] and r["lanes"] == peer["lanes"]]
        if not ours:
            continue
        off = next(r for r in ours if r["drafts"] == 0)
        best, best_peer = max(ours, key=lambda r: r["tokens_per_s"]), max(theirs, key=lambda r: r["tokens_per_s"])
        out.append({"workload": peer["workload"], "lanes": peer["lanes"],
                    "without_speculation": off["tokens_per_s"] / peer["tokens_per_s"],
                    "fastest": best["tokens_per_s"] / best_peer["tokens_per_s"],
                    "fastest_strata": best["spec"], "fastest_llama": best_peer["spec_type"]})
    return out


def verify_mode(models: Models, args: argparse.Namespace) -> dict[str, Any]:
    """--verify-cost: forward cost by draft count, then the regenerate under each configuration."""
    drafts = [0, *(args.verify_drafts or range(1, 9))]
    cfg = dataclasses.replace(engine_config(args, max(args.lanes), max(drafts)),  # graphs sized for the rows
                              max_context=max(args.max_context, args.position + max(drafts) + 64))
    with Engine(cfg, loaded=models.loaded) as engine:
        costs = verify_costs(engine, args.lanes, drafts, args.position, args.reps)
    rows = []
    for lanes in args.lanes:
        runs, _ = runs_of(args.specs if lanes == 1 else args.multi_lane_specs, args.proposers)
        convs = open_conversations(max(args.open, lanes))
        ref: dict[str, Any] = {}
        for run in runs:
            with open_engine(models, args, lanes, run) as engine:
                row = {"lanes": lanes, **dataclasses.asdict(run), **regenerate(engine, convs, lanes, args.max_tokens)}
            got = row.pop("outputs")
            if not ref:
                ref = {**row, "outputs": got}
            else:
                row["identical"] = compare(got, ref["outputs"])["identical"]
            rows.append(_with_ratios(row, ref))
            print(json.dumps(row), file=sys.stderr, flush=True)
    return {"verify_cost": costs, "regenerate": rows}


def main(argv: list[str] | None = None) -> int:
    args = resolve(parser().parse_args(argv))
    t0 = time.perf_counter()
    models = load(args)
    out: dict[str, Any] = {"model": models.path, "spec_model": args.spec_model, "device": args.device,
                           "threads": args.threads, "max_tokens": args.max_tokens,
                           "load_average_start": os.getloadavg()}
    if args.device.startswith("cuda"):
        import torch

        out["device_name"] = torch.cuda.get_device_name(torch.device(args.device))
    with Engine(engine_config(args, 1, 0), loaded=models.loaded) as engine:  # kernels and caches warm
        engine.complete(engine.tokenizer.encode("warm up"), SamplingParams(max_tokens=8))
    if args.verify_cost:
        out.update(verify_mode(models, args))
    else:
        out.update(file_tokens=args.file_tokens, licence_sources=sources(),
                   rates="tokens_per_s: all generated tokens / the run's wall time (prompt reads "
                         "included); lane_decode_tokens_per_s: tokens after each request's first / the "
                         "time after its first token")
        out["runs"] = strata_runs(models, args)
        if args.llama_server:
            out["llama_server"] = llama_runs(models, args)
            out["versus_llama"] = versus_llama(out["runs"], out["llama_server"])
        for r in out["runs"]:
            r.pop("outputs", None)
    out["load_average_end"] = os.getloadavg()
    out["seconds"] = round(time.perf_counter() - t0, 1)
    emit(out, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
