"""Round trips over the stage link on loopback: a small control message and hidden-state tensors.

    python -m benchmarks.link_rtt [--reps 200] [--shapes 1x4096,128x4096] [--dtype bfloat16]

A worker process (spawned, so it has its own interpreter and GIL) listens on
127.0.0.1 and echoes; this process connects, then times `--reps` round trips
of a small message (send, echoed reply) and, per shape, of a tensor (sent by
gloo, received back). Prints one JSON object: the median and 90th percentile
in microseconds, and the tensors' bytes per second one way at the median.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import secrets
import statistics
import time
from dataclasses import dataclass

import torch

from strata.parallel.link import Listener, connect
from strata.parallel.messages import message


@message("bench.echo")
@dataclass(frozen=True)
class Echo:
    n: int


@message("bench.tensors")
@dataclass(frozen=True)
class Tensors:
    """Echo `reps` tensors of this shape and dtype, then wait for the next instruction."""

    reps: int
    shape: list
    dtype: str


@message("bench.stop")
@dataclass(frozen=True)
class Stop:
    pass


def _worker(key: bytes, ports: mp.Queue) -> None:
    with Listener("127.0.0.1", 0, key) as listener:
        ports.put(listener.port)
        with listener.accept(timeout=60) as link:
            while not isinstance(msg := link.recv(60), Stop):
                if isinstance(msg, Echo):
                    link.send(msg)
                    continue
                assert isinstance(msg, Tensors)
                for _ in range(msg.reps):
                    link.send_tensor(link.recv_tensor(msg.shape, getattr(torch, msg.dtype)))


def _summary(seconds: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in seconds)
    return {"median_us": round(statistics.median(us), 1), "p90_us": round(us[len(us) * 9 // 10], 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--shapes", default="1x4096,128x4096")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    key = secrets.token_bytes(32)
    ctx = mp.get_context("spawn")
    ports: mp.Queue = ctx.Queue()
    worker = ctx.Process(target=_worker, args=(key, ports))
    worker.start()
    link = connect("127.0.0.1", ports.get(timeout=60), key)
    times = []
    for i in range(args.reps + 10):
        t0 = time.perf_counter()
        link.send(Echo(i))
        link.recv(10)
        times.append(time.perf_counter() - t0)
    out = {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
           "torch": torch.__version__, "reps": args.reps, "message": _summary(times[10:]),
           "tensors": []}
    dtype = getattr(torch, args.dtype)
    for spec in args.shapes.split(","):
        shape = [int(x) for x in spec.split("x")]
        t = torch.randn(shape).to(dtype)
        link.send(Tensors(args.reps + 10, shape, args.dtype))
        times = []
        for _ in range(args.reps + 10):
            t0 = time.perf_counter()
            link.send_tensor(t)
            link.recv_tensor(shape, dtype)
            times.append(time.perf_counter() - t0)
        row = {"shape": shape, "dtype": args.dtype, **_summary(times[10:])}
        row["one_way_MB_per_s"] = round(t.numel() * t.element_size() / (row["median_us"] / 2), 1)
        out["tensors"].append(row)
    link.send(Stop())
    link.close()
    worker.join(30)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
