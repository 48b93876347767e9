"""A layer split against one device, on one GGUF file, as JSON: decode and prompt tokens/s.

    python -m benchmarks.split_bench MODEL.gguf --gpus 0,1 --remote-device cuda:1 --out split.json

Configurations, each a fresh engine over the same file: `one` (the whole model on `--device`),
`gpus` (`--gpus` in one process: `0,1` on two GPUs, `0,0` runs the same code as two stages on
one), and `remote` (a `strata stage` child on `--remote-device` running layers from
`--split-at` on; NCCL carries the hidden states between two GPUs, gloo through the host
otherwise). For each: decode tokens/s at `--lanes` (all lanes decoding together, as
llama-batched-bench measures), one-lane prompt reads of `--prompt-lengths`, and each
configuration's ratio to `one`. The remote rows add the link's time and bytes per step.
A child process gets NVLink multicast switched off (NCCL_NVLS_ENABLE=0 and the others).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.engine_runs import decode_run, prompt_run
from benchmarks.stage_process import NO_MULTICAST, StageProcess
from strata.engine.config import EngineConfig
from strata.engine.engine import Engine


def _measure(cfg: EngineConfig, lanes: list[int], lengths: list[int], gen: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with Engine(cfg) as eng:
        row: dict[str, Any] = {"load_seconds": time.perf_counter() - t0}
        decode_run(eng, max(lanes), 64, 8, salt=1)  # compiles kernels, captures graphs
        decode_run(eng, 1, 64, 8, salt=2)
        row["decode"] = [decode_run(eng, n, 512, gen, salt=100 * n) for n in lanes]
        row["prompt"] = [prompt_run(eng, n, salt=5000 + n, reps=3) for n in lengths]
        row["stages"] = eng.stats()["stages"]
    print(json.dumps({k: v for k, v in row.items() if k != "stages"}), file=sys.stderr, flush=True)
    return row


def _ratios(rows: dict[str, Any]) -> dict[str, Any]:
    base = rows.get("one")
    if base is None:
        return {}
    out = {}
    for name, row in rows.items():
        if name == "one":
            continue
        out[name] = {
            "decode": {d["lanes"]: d["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                       for d, b in zip(row["decode"], base["decode"])},
            "prompt": {p["prompt_tokens"]: p["prompt_tokens_per_s"] / b["prompt_tokens_per_s"]
                       for p, b in zip(row["prompt"], base["prompt"])}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpus", default="0,1")
    ap.add_argument("--split", default=None)
    ap.add_argument("--remote-device", default="cuda:1")
    ap.add_argument("--split-at", type=int, default=None, help="default: half the layers")
    ap.add_argument("--lanes", default="1,16,64")
    ap.add_argument("--prompt-lengths", default="512,8192")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--configs", default="one,gpus,remote")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.update(NO_MULTICAST)  # this process's NCCL too
    lanes = [int(x) for x in args.lanes.split(",")]
    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    base = dict(model=args.model, device=args.device, weights="dense", parallel=max(lanes),
                max_context=max(lengths + [512]) + args.gen + 64, kv_chunk=1024,
                prefill_chunk=max(512, max(lengths)))
    rows: dict[str, Any] = {}
    configs = args.configs.split(",")
    if "one" in configs:
        rows["one"] = _measure(EngineConfig(**base), lanes, lengths, args.gen)
    if "gpus" in configs:
        rows["gpus"] = _measure(EngineConfig(**base, gpus=args.gpus, split=args.split), lanes, lengths, args.gen)
    if "remote" in configs:
        from strata.gguf import GGUFFile

        meta = GGUFFile(args.model).metadata
        arch = meta["general.architecture"]
        split_at = args.split_at or int(meta[f"{arch}.block_count"]) // 2
        with tempfile.TemporaryDirectory() as tmp:
            key = Path(tmp) / "stage.key"
            key.write_text(os.urandom(24).hex())
            worker = StageProcess(["--model", args.model, "--device", args.remote_device, "--weights", "dense",
                                   "--stage-key-file", str(key), "--stage-timeout", "600"],
                                  Path(tmp) / "stage.log")
            try:
                rows["remote"] = _measure(EngineConfig(**base, remote_stage=worker.address, stage_key_file=str(key),
                                                       split_at=split_at, stage_timeout=600.0),
                                          lanes, lengths, args.gen)
            finally:
                worker.kill()
    result = {"model": args.model, "configs": rows, "ratio_to_one": _ratios(rows)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
