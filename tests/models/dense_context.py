"""A test-only AttentionContext and StateContext: one sequence, K/V and recurrent state in lists.

They stand in for the pool-based contexts so model code can be checked
against transformers without the KV pool or the state pool. Attention is
plain causal SDPA (within the window of a sliding layer) with the KV heads
repeated for grouped-query attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kv.state import StateDtypes, StateShapes
from strata.models.base import ModelConfig


class DenseContext:
    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.k: list[list[torch.Tensor]] = [[] for _ in range(cfg.num_layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(cfg.num_layers)]

    def cached(self, layer: int) -> int:
        return sum(t.shape[0] for t in self.k[layer])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        start = self.cached(layer)
        self.k[layer].append(k)
        self.v[layer].append(v)
        keys = torch.cat(self.k[layer])
        values = torch.cat(self.v[layer])
        group = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        t, s = q.shape[0], keys.shape[0]
        dev = q.device
        key_pos = torch.arange(s, device=dev)[None, :]
        q_pos = (start + torch.arange(t, device=dev))[:, None]
        mask = key_pos <= q_pos
        if window is not None:  # a sliding layer: the last `window` keys, itself included
            mask &= key_pos > q_pos - window
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            scale=self.cfg.attn_scale,
        )
        return out.transpose(0, 1)


class DenseStates:
    """Recurrent state of the sequences of a step, kept per sequence: sequence i of the step is
    `seqs[i]`, whose state starts as zeros."""

    MAX_SEQS = 16  # sequences `in_place` holds state for

    def __init__(self, shapes: dict[int, StateShapes], device: torch.device | str = "cpu",
                 dtypes: dict[int, StateDtypes] | None = None) -> None:
        self.shapes = shapes
        self.device = device
        self.dtypes = dtypes or {}
        self.state: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        self.seqs: list[str] = ["0"]
        self.spans: list[tuple[int, int]] = []
        self.runs: list[bool] = []  # no verified runs of drafts here
        self.cuts: list[tuple[int, ...]] = []
        self.pad = None  # no captured prompt step's padding here
        self.at_cuts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # rows -> layer -> state
        self.slot_of: dict[str, int] = {}
        self.held: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def slots(self) -> torch.Tensor:
        return torch.tensor([self.slot_of.setdefault(s, len(self.slot_of)) for s in self.seqs],
                            dtype=torch.int64, device=self.device)

    def in_place(self, layer: int) -> dict[str, torch.Tensor]:
        if layer not in self.held:
            self.held[layer] = {
                name: torch.zeros((self.MAX_SEQS, *shape), device=self.device,
                                  dtype=self.dtypes.get(layer, {}).get(name, torch.float32))
                for name, shape in self.shapes[layer].items()}
        return self.held[layer]

    def step(self, spans: list[tuple[int, int]], seqs: list[str] | None = None,
             cuts: list[tuple[int, ...]] | None = None) -> None:
        """The next step's row spans, which sequence each is (default: the first) and the rows
        after which each keeps its state (`at_cuts`, of the first sequence's cuts)."""
        self.spans = spans
        self.seqs = seqs or ["0"] * len(spans)
        self.runs = [False] * len(spans)
        self.cuts = cuts or [()] * len(spans)
        self.at_cuts = {}

    def keep_cut(self, layer: int, seq: int, rows: int, state: dict[str, torch.Tensor]) -> None:
        self.at_cuts.setdefault(rows, {})[layer] = {n: t.clone() for n, t in state.items()}

    def keep_run(self, layer: int, seq: int, run: object) -> None:
        raise AssertionError("this context steps no verified runs of drafts")

    def zero(self, seq: str, layer: int) -> None:
        self.state.get(seq, {}).pop(layer, None)

    def load(self, layer: int) -> dict[str, torch.Tensor]:
        rows = [self.state.get(s, {}).get(layer) for s in self.seqs]
        return {name: torch.stack([torch.zeros(shape, device=self.device) if r is None else r[name]
                                   for r in rows])
                for name, shape in self.shapes[layer].items()}

    def save(self, layer: int, state: dict[str, torch.Tensor]) -> None:
        for i, s in enumerate(self.seqs):
            self.state.setdefault(s, {})[layer] = {n: t[i].clone() for n, t in state.items()}


@torch.inference_mode()
def run(model, ids: list[int], start: int, ctx, states: DenseStates) -> torch.Tensor:
    """One step of one sequence: ids at positions start.. -> hidden [len(ids), hidden]."""
    dev = model.norm.weight.device
    states.step([(0, len(ids))])
    pos = torch.arange(start, start + len(ids), device=dev)
    return model(torch.tensor(ids, dtype=torch.long, device=dev), pos, ctx, states)


@torch.inference_mode()
def prompt_logits(loaded, ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] for every position of one prompt."""
    ctx = DenseContext(loaded.config)
    states = DenseStates(loaded.model.state_layers(), loaded.device, loaded.model.state_dtypes())
    return loaded.model.compute_logits(run(loaded.model, ids, 0, ctx, states))


@torch.inference_mode()
def greedy(loaded, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after a prompt: one prefill, then one token per step."""
    model = loaded.model
    ctx = DenseContext(loaded.config)
    states = DenseStates(model.state_layers(), loaded.device, model.state_dtypes())
    hidden = run(model, ids, 0, ctx, states)
    out = [int(model.compute_logits(hidden[-1:]).argmax(-1))]
    pos = len(ids)
    while len(out) < n:
        hidden = run(model, [out[-1]], pos, ctx, states)
        out.append(int(model.compute_logits(hidden).argmax(-1)))
        pos += 1
    return out
