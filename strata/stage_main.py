"""`strata stage`: the flags of a worker that runs a main's later layers, and running it."""

from __future__ import annotations

import argparse
import logging

from strata.errors import StrataError
from strata.models.quantize import WEIGHT_MODES
from strata.parallel.handshake import read_key
from strata.parallel.worker import StageWorker, WorkerOptions


def add_stage_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("stage worker (docs/STAGES.md)")
    g.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="where mains connect (a bare PORT binds 127.0.0.1); a public address "
                        "prints what the link does not encrypt")
    g.add_argument("--next", dest="next_address", default=None, metavar="HOST:PORT",
                   help="relay: run layers up to --split-at and forward the rest to this worker")
    g.add_argument("--split-at", type=int, default=None, metavar="M",
                   help="with --next: this worker runs layers [the main's split, M)")
    g.add_argument("--model", "-m", default=None,
                   help="the same .gguf file or model folder as the main's (default: embedded)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--weights", default="auto", choices=list(WEIGHT_MODES),
                   help="as the main's --weights (the model identity includes it)")
    g.add_argument("--kv-resident", type=int, default=None,
                   help="stream this worker's K/V: this many cells per layer on the device")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    from strata.engine.config import EngineConfig, add_stage_link_arguments, add_threads_argument

    add_threads_argument(g, governed=False)
    add_stage_link_arguments(g, EngineConfig())


def run_stage(args: argparse.Namespace) -> int:
    """Serve mains until interrupted."""
    import torch

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from strata.engine.threads import find_cores

    cores = find_cores()
    torch.set_num_threads(args.threads or cores.threads)
    logging.getLogger("strata.stage").info("CPU: %s; threads %d", cores.describe(), torch.get_num_threads())
    if args.stage_key_file is None:
        raise StrataError("--stage-key-file is required (the key the main also reads)")
    listen = args.listen if ":" in args.listen else f"127.0.0.1:{args.listen}"
    from strata.engine.runner import graphs_factory

    worker = StageWorker(WorkerOptions(
        model=args.model, device=args.device, dtype=args.dtype, weights=args.weights,
        kv_resident=args.kv_resident, listen=listen, key=read_key(args.stage_key_file),
        next_address=args.next_address, split_at=args.split_at, timeout=args.stage_timeout),
        graphs_factory())
    try:
        worker.serve_forever()
    finally:
        worker.stop()
    return 0
