"""Stages of a layer split and the runner that passes a step's hidden states through them.

A stage runs a contiguous range of the model's layers over its own part of
the pool, with its own attention backend (and RoPE tables) on its device. A
`LocalStage` is in this process; a `RemoteStage` (`remote.py`) sends the
step to a worker. `SplitRunner` has the single-device `Runner`'s interface:
it embeds on the main device, hands the hidden states from stage to stage
(one device crossing per boundary), and computes the final norm and the
sampled rows' logits back on the main device, the same operations in the
same order as one device runs them, so a split's output is the unsplit
model's bit for bit where every stage's device computes alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from strata.attention.select import backend_for, graphs_possible
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec, sampled_rows, step_positions
from strata.uploads import upload

# DecodeGraphs(model, pool, scale, layers, embed=, head=, rope=): the engine's graph capture
GraphsFactory = Callable[..., Any]


class Stage(Protocol):
    layers: range

    def run(self, h: torch.Tensor, positions: torch.Tensor, seqs: list[SeqSpec]) -> torch.Tensor:
        """Hidden states [T, H] after this stage's layers, for the step's `positions` (host, [T])."""
        ...

    def describe(self) -> dict[str, Any]:
        """What /v1/state and /metrics show of the stage."""
        ...

    def decode(self, seqs: list[SeqSpec], tokens: list[int], h: torch.Tensor | None,
               device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """A pure decode step: from the ids (the first stage) or the hidden states before it."""
        ...

    def reconnect_if_lost(self) -> bool:
        """Whether the stage's K/V was lost since it was last asked (a remote worker replaced)."""
        ...

    def close(self) -> None:
        """Let go of links (a worker then serves its next main)."""
        ...


class LocalStage:
    """Layers `pool.layer_range` of `model`, on `pool.device`, over that part of the pool.

    On CUDA with the in-place Triton backend its decode steps run as its own captured graphs
    (`engine/graphs.py`): the first stage's embed the ids, the others read the hidden states.
    """

    def __init__(self, model: torch.nn.Module, pool: KvPool, scale: float, max_positions: int,
                 graphs: GraphsFactory | None = None) -> None:
        """`graphs`: how to capture decode graphs (`engine/graphs.py: DecodeGraphs`, handed down
        by the engine or `strata stage`); None: every step eager."""
        self.model = model
        self.pool = pool
        self.scale = scale
        self.layers = pool.layer_range
        self.device = pool.device
        self.context = backend_for(pool)
        own = model.rope_cos
        if not own.is_meta and own.device == self.device and own.shape[0] >= max_positions:
            self.rope = (own, model.rope_sin)
        elif not own.is_meta:  # the main device's tables, copied: the same bits on every stage
            self.rope = (own.to(self.device), model.rope_sin.to(self.device))
        else:
            dtype = next(model.layers[self.layers.start].parameters()).dtype
            self.rope = model.rope_for(max_positions, self.device, dtype)
        self.graphs = None
        if graphs is not None and graphs_possible(self.context):
            self.graphs = graphs(model, pool, scale, self.layers, embed=self.layers.start == 0,
                                 head=False, rope=self.rope)

    def decode(self, seqs: list[SeqSpec], tokens: list[int], h: torch.Tensor | None,
               device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """A decode step through the stage's graphs (the first stage from `tokens` or `device_ids`,
        the others from `h`), or eagerly where it has none."""
        if self.graphs is not None and len(seqs) <= self.graphs.sizes[-1]:
            return self.graphs.forward(seqs, tokens, device_ids=device_ids,
                                       hidden=None if self.graphs.embed else h)
        if h is None:
            ids = device_ids if device_ids is not None else upload(tokens, self.device)
            h = self.model.embed(ids)
        positions = torch.tensor([s.start for s in seqs], dtype=torch.int64)
        return self.run(h, positions, seqs)

    def run(self, h: torch.Tensor, positions: torch.Tensor, seqs: list[SeqSpec]) -> torch.Tensor:
        ctx = self.context(self.pool, seqs, self.scale)
        return self.model.run_layers(h.to(self.device), positions.to(self.device), ctx,
                                     self.layers.start, self.layers.stop, rope=self.rope)

    def describe(self) -> dict[str, Any]:
        return {"layers": [self.layers.start, self.layers.stop], "device": str(self.device),
                "kind": "local", "kv_bytes": self.pool.total_bytes()}

    def reconnect_if_lost(self) -> bool:
        return False

    def close(self) -> None:
        pass


class SplitRunner:
    """The engine's runner over a chain of stages.

    Pure decode steps go through each stage's `decode` (its own CUDA graphs where it has them)
    and a captured head on the main device when the first stage has graphs; prompt reading runs
    every stage eagerly.
    """

    def __init__(self, model: torch.nn.Module, stages: list[Stage], device: torch.device,
                 head: Any = None) -> None:
        """`head`: DecodeGraphs of the final norm and logits on the main device, or None."""
        self.model = model
        self.stages = stages
        self.device = device
        self.graphs = head  # the engine pipelines decode steps when this is not None

    def _decoding(self, seqs: list[SeqSpec], sample: list[int]) -> bool:
        return self.graphs is not None and self.graphs.supports(seqs, sample)

    def _decode(self, seqs: list[SeqSpec], tokens: list[int], ids: torch.Tensor | None) -> torch.Tensor:
        h = None
        for stage in self.stages:
            h = stage.decode(seqs, tokens, h, device_ids=ids if h is None else None)
        assert h is not None
        return self.graphs.forward(seqs, tokens, hidden=h.to(self.device))

    def close(self) -> None:
        for stage in self.stages:
            stage.close()

    def describe_stages(self) -> list[dict[str, Any]]:
        return [stage.describe() for stage in self.stages]

    def reconnect_if_lost(self) -> bool:
        """Reconnect remote stages whose link is down; True if any worker is new (its K/V empty)."""
        return any([stage.reconnect_if_lost() for stage in self.stages])  # every stage checked

    @torch.inference_mode()
    def decode_from(self, seqs: list[SeqSpec], ids: torch.Tensor) -> torch.Tensor:
        if self._decoding(seqs, [True] * len(seqs)):
            return self._decode(seqs, [0] * len(seqs), ids)
        return self.forward(seqs, ids.tolist(), [True] * len(seqs))

    @torch.inference_mode()
    def forward(self, seqs: list[SeqSpec], tokens: list[int], sample: list[int]) -> torch.Tensor:
        """Logits (float32) of the rows `sampled_rows(seqs, sample)` names, in order."""
        if self._decoding(seqs, sample):
            return self._decode(seqs, tokens, None)
        input_ids = upload(tokens, self.device)
        positions = step_positions(seqs)
        h = self.model.embed(input_ids)
        for stage in self.stages:
            h = stage.run(h, positions, seqs)
        hidden = self.model.norm.forward(h.to(self.device))
        rows = sampled_rows(seqs, sample)
        if not rows:
            return torch.empty(0, device=self.device)
        return self.model.compute_logits(hidden[upload(rows, self.device)])
