"""Which layers each stage of a split holds: `--gpus 0,1` (or `cpu,cpu`) and `--split 16,16`.

Without `--split` the layers go to the devices in proportion to their free
memory (CUDA: `mem_get_info`; CPU stages: equal shares), at least one each,
in device order: stage 0 (the main device) holds the first layers, the
embedding and the head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.errors import BadRequest


@dataclass(frozen=True)
class StagePlan:
    devices: tuple[torch.device, ...]
    ranges: tuple[range, ...]  # contiguous, in order, covering [0, num_layers)

    def device_of_layer(self) -> tuple[torch.device, ...]:
        return tuple(d for d, r in zip(self.devices, self.ranges) for _ in r)


def parse_devices(text: str) -> tuple[torch.device, ...]:
    """`0,1` / `cuda:0,cuda:1` / `cpu,cpu` -> devices; a bad entry is a BadRequest naming it."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if item.isdigit():
            item = f"cuda:{item}"
        try:
            dev = torch.device(item)
        except RuntimeError:
            raise BadRequest(f"--gpus: {item!r} is not a device (use GPU numbers, cuda:N or cpu)",
                             "gpus") from None
        if dev.type not in ("cpu", "cuda"):
            raise BadRequest(f"--gpus: {item!r} is not a CPU or CUDA device", "gpus")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise BadRequest(f"--gpus: {item} was asked for but CUDA is not available", "gpus")
            if (dev.index or 0) >= torch.cuda.device_count():
                raise BadRequest(f"--gpus: {item} does not exist ({torch.cuda.device_count()} GPUs)",
                                 "gpus")
        out.append(dev)
    if len(out) < 1:
        raise BadRequest("--gpus names no device", "gpus")
    return tuple(out)


def split_layers(num_layers: int, weights: list[float]) -> list[int]:
    """Layer counts proportional to `weights`, each at least 1, summing to `num_layers`."""
    n = len(weights)
    if num_layers < n:
        raise BadRequest(f"{num_layers} layers cannot be split over {n} stages", "split")
    total = sum(weights)
    shares = [w / total * num_layers if total > 0 else num_layers / n for w in weights]
    counts = [max(1, int(s)) for s in shares]
    while sum(counts) > num_layers:  # take from the largest
        counts[counts.index(max(counts))] -= 1
    order = sorted(range(n), key=lambda i: counts[i] - shares[i])  # most under its share first
    i = 0
    while sum(counts) < num_layers:
        counts[order[i % n]] += 1
        i += 1
    return counts


def free_memory(dev: torch.device) -> float:
    if dev.type == "cuda":
        return float(torch.cuda.mem_get_info(dev)[0])
    return 1.0  # CPU stages share the same RAM: equal shares


def plan_stages(num_layers: int, devices: tuple[torch.device, ...], split: str | None) -> StagePlan:
    """The stage plan for `--gpus` devices and an optional `--split` of layer counts."""
    if split is not None:
        try:
            counts = [int(t) for t in split.split(",")]
        except ValueError:
            raise BadRequest(f"--split {split!r}: give layer counts separated by commas", "split") from None
        if len(counts) != len(devices):
            raise BadRequest(f"--split names {len(counts)} stages but --gpus names {len(devices)}", "split")
        if any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise BadRequest(f"--split {split}: each stage needs at least one layer and the counts must "
                             f"add up to the model's {num_layers} layers", "split")
    else:
        counts = split_layers(num_layers, [free_memory(d) for d in devices])
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return StagePlan(tuple(devices), tuple(ranges))
