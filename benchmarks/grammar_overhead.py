"""What grammar masks cost in greedy decode: the same lanes with and without a JSON schema (JSON).

    python -m benchmarks.grammar_overhead [--model FILE.gguf] [--lanes 1,16] [--tokens 64]
        [--repeats 3] [--device auto] [--threads N] [--out FILE]

For each lane count, every lane decodes `--tokens` tokens from its own short
prompt, once unconstrained (ignore_eos) and once under a JSON schema that
cannot be complete by then (an array of at least 1,000 objects), so both
runs produce the same number of tokens. Decode time is the run's time minus
that of the same requests with max_tokens 1 (admission, prompt read, first
token). From the engine's counters: the time its thread waited for masks
and applied them, per constrained token and as a share of decode time, and
the worker thread's time computing them (which overlaps the forward). The
two modes alternate `--repeats` times and the fastest run of each is kept,
so load from other processes on a shared machine skews the ratio less; the
engine's counters are the steadier figures.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from strata.bench.report import emit
from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.grammar import json_schema_grammar
from strata.engine.types import SamplingParams
from strata.models import load_model

SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                       "role": {"enum": ["admin", "user", "guest"]}},
        "required": ["id", "name", "role"],
    },
}


def _timed(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[int]]:
    start = time.perf_counter()
    handles = [engine.generate(p, params) for p in prompts]
    counts = [h.result().completion_tokens for h in handles]
    return time.perf_counter() - start, counts


def run(engine: Engine, lanes: int, tokens: int, grammar: str | None) -> dict[str, Any]:
    """One measurement: `lanes` lanes decoding `tokens` tokens, constrained by `grammar` or not."""
    prompts = [engine.tokenizer.encode(f"Request {i}: list the users of system {i} as JSON.")
               for i in range(lanes)]
    first = SamplingParams(max_tokens=1, ignore_eos=True, grammar=grammar)
    whole = SamplingParams(max_tokens=tokens, ignore_eos=True, grammar=grammar)
    _timed(engine, prompts, first)  # warm: the lanes hold the prompts from here on, in both runs
    t_first, _ = _timed(engine, prompts, first)
    before = engine.stats()
    t_whole, counts = _timed(engine, prompts, whole)
    after = engine.stats()
    decode_s = t_whole - t_first
    rows = after["grammar_rows"] - before["grammar_rows"]
    wait_s = after["grammar_wait_s"] - before["grammar_wait_s"]
    mask_s = after["grammar_mask_s"] - before["grammar_mask_s"]
    return {
        "lanes": lanes,
        "grammar": grammar is not None,
        "completion_tokens": sum(counts),
        "decode_s": round(decode_s, 3),
        "decode_tokens_per_s": round(sum(c - 1 for c in counts) / decode_s, 1),
        "grammar_rows": rows,
        "grammar_wait_ms_per_token": round(1e3 * wait_s / rows, 4) if rows else None,
        "grammar_mask_ms_per_token": round(1e3 * mask_s / rows, 4) if rows else None,
        "grammar_wait_share_of_decode": round(wait_s / decode_s, 4) if rows else None,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--lanes", default="1,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    lane_counts = [int(x) for x in args.lanes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, args.device, progress=False, weights="auto")
    grammar = json_schema_grammar(SCHEMA, param="schema")
    runs = []
    for lanes in lane_counts:
        cfg = EngineConfig(model=loaded.path, device=args.device, parallel=lanes, max_context=512,
                           threads=args.threads)
        with Engine(cfg, loaded=loaded) as engine:
            engine.grammars.check(grammar, "schema")  # builds llguidance's tokenizer outside the timing
            run(engine, lanes, args.tokens, None)  # warm-up: graph capture and first launches, not timed
            tries: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
            for _ in range(args.repeats):
                tries[False].append(run(engine, lanes, args.tokens, None))
                tries[True].append(run(engine, lanes, args.tokens, grammar))
        plain, constrained = (min(tries[mode], key=lambda r: r["decode_s"]) for mode in (False, True))
        for mode, best in ((False, plain), (True, constrained)):
            best["all_tokens_per_s"] = [r["decode_tokens_per_s"] for r in tries[mode]]
        constrained["speed_vs_unconstrained"] = round(
            constrained["decode_tokens_per_s"] / plain["decode_tokens_per_s"], 3)
        runs += [plain, constrained]
    emit({"model": str(loaded.path), "device": str(next(loaded.model.parameters()).device),
          "dtype": str(next(loaded.model.parameters()).dtype), "threads": torch.get_num_threads(),
          "tokens": args.tokens, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
