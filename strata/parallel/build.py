"""Putting a layer split together for the engine: where layers load, each stage's pool part.

`--gpus 0,1` (or `cpu,cpu`) splits the model in this process (`LocalStage`s);
`--remote-stage HOST:PORT --split-at L` keeps layers [0, L) and the head
here and runs the rest in a worker (`remote.py`). Either way the engine gets
one `SplitPool` and a `SplitRunner`, and its scheduler never knows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from strata.errors import BadRequest
from strata.kv.formats import KvFormat
from strata.kv.pool import KvPool
from strata.kv.stream import StreamedPool
from strata.kv.tables import ChunkTables
from strata.models.base import ModelConfig
from strata.models.loader import Placement
from strata.parallel.handshake import read_key
from strata.parallel.plan import StagePlan, parse_devices, plan_stages
from strata.parallel.remote import RemoteStage, hello_for, split_address
from strata.parallel.split_pool import RemoteParts, SplitPool, StagePart
from strata.parallel.stages import GraphsFactory, LocalStage, SplitRunner, Stage


@dataclass(frozen=True)
class PoolShape:
    """What every stage's part of the pool is made of (the engine's pool flags)."""

    fmt: KvFormat
    lanes: int
    max_context: int
    chunk: int
    pool_tokens: int | None
    resident: int | None  # --kv-resident: cells per layer on the device, or None


def part_on(shape: PoolShape, layers: Sequence[int], device: torch.device,
            tables: ChunkTables | None) -> KvPool:
    """A pool of model layers `layers` on `device` over `tables` (a split's shared ones; None: its
    own): a split's stage passes its range, one device the model's `pool_layers()`."""
    if shape.resident is not None:
        return StreamedPool(shape.fmt, layers, shape.lanes, shape.max_context, shape.chunk,
                            shape.pool_tokens, device, resident_cells=shape.resident, tables=tables)
    return KvPool(shape.fmt, layers, shape.lanes, shape.max_context, shape.chunk, shape.pool_tokens,
                  device, tables=tables)


def head_graphs(model: torch.nn.Module, first: LocalStage, scale: float, graphs: GraphsFactory | None) -> Any:
    """Captured final norm and logits on the main device, where the first stage has graphs."""
    if first.graphs is None or graphs is None:
        return None
    n = len(model.layers)
    return graphs(model, first.pool, scale, range(n, n), embed=False, head=True)


class LocalSplit:
    """`--gpus`: the plan is made when the model's layer count is known (`place`)."""

    def __init__(self, gpus: str, split: str | None) -> None:
        self.devices = parse_devices(gpus)  # a bad device fails before the model loads
        self.split = split
        self.plan: StagePlan | None = None

    def place(self, cfg: ModelConfig) -> Placement:
        self.plan = plan_stages(cfg.num_layers, self.devices, self.split)
        return Placement(self.plan.device_of_layer(), self.plan.devices[0])

    def build(self, model: torch.nn.Module, identity: str, shape: PoolShape, scale: float,
              graphs: GraphsFactory | None) -> tuple[SplitPool, SplitRunner]:
        """The pool and runner; `graphs`: each stage's decode-graph capture (None: eager)."""
        assert self.plan is not None, "place() runs while the model loads"
        tables = ChunkTables(shape.lanes, shape.max_context, shape.chunk, shape.pool_tokens)
        pools = [part_on(shape, r, d, tables) for d, r in zip(self.plan.devices, self.plan.ranges)]
        local = [LocalStage(model, p, scale, shape.max_context, graphs) for p in pools]
        stages: list[Stage] = list(local)
        parts: list[StagePart] = list(pools)
        main = self.plan.devices[0]
        return SplitPool(tables, shape.fmt, parts, main), SplitRunner(model, stages, main,
                                                                      head_graphs(model, local[0], scale, graphs))


class RemoteSplit:
    """`--remote-stage HOST:PORT --split-at L`: layers [0, L) and the head here, the rest in a
    worker chain (`strata stage`)."""

    def __init__(self, address: str, key_file: str | None, split_at: int | None, timeout: float,
                 device: torch.device, prompt_cache: int = 0) -> None:
        """`prompt_cache` N > 0: the worker keeps its part of up to N parked conversations (and the
        one being restored), under ids; 0: their bytes come to the main's conversation cache."""
        if key_file is None:
            raise BadRequest("--remote-stage needs --stage-key-file (the key both ends share)",
                             "stage_key_file")
        if split_at is None or split_at < 1:
            raise BadRequest("--remote-stage needs --split-at L (layers [0, L) stay here), L >= 1",
                             "split_at")
        split_address(address)  # a bad address fails before the model loads
        self.address = address
        self.key = read_key(key_file)
        self.split_at = split_at
        self.timeout = timeout
        self.device = device
        self.keep_max = prompt_cache + 1 if prompt_cache > 0 else 0

    def place(self, cfg: ModelConfig) -> Placement:
        if self.split_at >= cfg.num_layers:
            raise BadRequest(f"--split-at {self.split_at} leaves no layer of the model's "
                             f"{cfg.num_layers} to the remote stage", "split_at")
        return Placement(tuple(self.device if i < self.split_at else None for i in range(cfg.num_layers)),
                         self.device)

    def build(self, model: torch.nn.Module, identity: str, shape: PoolShape, scale: float,
              graphs: GraphsFactory | None) -> tuple[SplitPool, SplitRunner]:
        cfg = model.config
        tables = ChunkTables(shape.lanes, shape.max_context, shape.chunk, shape.pool_tokens)
        local = part_on(shape, range(0, self.split_at), self.device, tables)
        dtype = model.norm.weight.dtype
        remote = RemoteStage(self.address, self.key,
                             hello_for(self.split_at, identity, shape.fmt, tables, dtype, cfg.hidden_size,
                                       self.keep_max, model.batch_invariant),
                             tables, shape.fmt, self.device, self.timeout)
        first = LocalStage(model, local, scale, shape.max_context, graphs)
        stages: list[Stage] = [first, remote]
        parts: list[StagePart] = [local, remote]
        kept = RemoteParts([local], [remote]) if self.keep_max else None
        return (SplitPool(tables, shape.fmt, parts, self.device, kept),
                SplitRunner(model, stages, self.device, head_graphs(model, first, scale, graphs)))

