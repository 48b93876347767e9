"""Drafts from the model's own multi-token-prediction head (`--mtp`; `models/mtp.py`).

The head's entry at position p reads the token at p + 1 and the model's
final hidden state at p, and attends over the head's earlier entries, whose
K/V are one more layer of the KV pool. So after every step the proposer
feeds the head the rows the step kept (`ingest`): a prompt part's rows, a
decoded token, a verified run's accepted rows, each with the token after it
(the next prompt token or the token just sampled). A lane's last entry then
guesses the token after its pending one; a draft continues greedily, each
guess fed back with the head's own output in place of the model's hidden
state, until it has k tokens or its probability falls below `--spec-min-p`.

Those chained entries, and a rejected draft's rows, lie past the lane's
tokens: the next step's entries overwrite them, rolled back by length like
the rest of the pool. A conversation's entries park, move and restore with
its K/V. A greedy draft is a point mass, so verification keeps the answer
(speculative.py). After an edit the entry just before the divergence was
built from the old next token; drafts there may hold less, the answer is
unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from strata.errors import BadRequest
from strata.kv.step import SeqSpec, step_positions
from strata.kv.tables import TablePool

if TYPE_CHECKING:
    from strata.engine.request import Request
    from strata.engine.scheduler import Step
    from strata.engine.speculative import LaneDrafting


def mtp_pool_layers(model: Any, name: str) -> list[int]:
    """The pool layers the model's MTP head adds (its layer's K/V: the index after the model's
    layers); BadRequest without a head."""
    if not model.config.mtp_layers:
        raise BadRequest(f"--mtp: {name} carries no multi-token-prediction head (a Qwen3-Next folder "
                         "whose weights hold mtp.*; GGUF files and folders saved by transformers have "
                         "none); run it without --mtp", "mtp")
    return [model.config.num_layers]


@dataclass
class _Last:
    """A lane's last entry: whose request, its position, the head's output there."""

    request: int
    position: int
    hidden: torch.Tensor  # [H]


class MtpProposer:
    """Greedy drafts of the model's MTP head, its entries in pool layer `layer_index`."""

    name = "mtp"

    def __init__(self, model: Any, pool: TablePool, context: Callable[..., Any], scale: float,
                 min_p: float) -> None:
        """context: the attention backend of the engine's steps (`Runner.context`)."""
        self.model = model
        self.pool = pool
        self.context = context
        self.scale = scale
        self.min_p = min_p
        self.device = next(model.parameters()).device
        self._last: dict[int, _Last] = {}  # lane -> its last entry

    @torch.inference_mode()
    def ingest(self, step: Step, reqs: list[Request | None], hidden: torch.Tensor | None) -> None:
        """Feed the head the rows step `step` kept (post-processed: the lanes hold them now), each
        with the token after it; `hidden`: the step's final hidden states, every row."""
        if hidden is None:
            return
        seqs, ids, rows, owners = [], [], [], []
        first = 0
        for seq, lane, req in zip(step.seqs, step.lanes, reqs):
            if req is not None:
                ctx = req.prompt + req.output
                kept = min(seq.n, len(lane.tokens) - seq.start, len(ctx) - 1 - seq.start)
                if kept > 0:
                    seqs.append(SeqSpec(lane.index, seq.start, kept))
                    ids += ctx[seq.start + 1 : seq.start + 1 + kept]
                    rows += range(first, first + kept)
                    owners.append(req.id)
            first += seq.n
        if seqs:
            self.ingest_rows(seqs, ids, hidden[torch.tensor(rows, device=hidden.device)], owners)

    @torch.inference_mode()
    def ingest_rows(self, seqs: list[SeqSpec], ids: list[int], hidden: torch.Tensor,
                    owners: list[int]) -> torch.Tensor:
        """Entries at `seqs`' positions: the tokens after them `ids`, the model's hidden states
        `hidden` (one row each); `owners[i]`: the request sequence i belongs to. Returns the
        head's outputs [rows, H]; each lane's last one is where its next draft starts."""
        out = self._run(seqs, ids, hidden)
        end = 0
        for seq, owner in zip(seqs, owners):
            end += seq.n
            self._last[seq.lane] = _Last(owner, seq.end - 1, out[end - 1])
        return out

    def _run(self, seqs: list[SeqSpec], ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        positions = step_positions(seqs).to(self.device)
        ctx = self.context(self.pool, seqs, self.scale)
        tokens = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return self.model.mtp_step(tokens, hidden, positions, ctx)

    @torch.inference_mode()
    def draft(self, lane: int, owner: int, position: int, k: int) -> list[int]:
        """Up to k greedy tokens from lane `lane`'s last entry, if it is request `owner`'s at
        `position` (the one before the pending token's)."""
        last = self._last.get(lane)
        if last is None or last.request != owner or last.position != position:
            return []
        drafts: list[int] = []
        pos, h = position, last.hidden
        while len(drafts) < k:
            p, t = self.model.compute_logits(h[None])[0].softmax(-1).max(-1)
            if float(p) < self.min_p:
                break
            drafts.append(int(t))
            pos += 1  # the guess's entry, past the lane's tokens: rolled back by length
            if len(drafts) == k or not self.pool.reserve(lane, pos + 1):
                break
            h = self._run([SeqSpec(lane, pos, 1)], drafts[-1:], h[None])[0]
        return drafts

    def propose(self, req: Request, state: LaneDrafting, k: int) -> list[int]:
        lane = req.handle.lane
        if lane is None:
            return []
        return self.draft(lane, req.id, len(req.prompt) + len(req.output) - 2, k)

    def finished(self, req: Request, state: LaneDrafting) -> None:
        """Nothing to keep: the lane's entries stay in the pool with its conversation."""
