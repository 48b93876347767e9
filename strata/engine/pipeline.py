"""Pipelined greedy decode: plan the next step from a launched one, before its tokens reach the host.

On the GPU a forward is asynchronous, so the host's work between two steps
(sampling's one sync, detokenizing, stop strings, events, planning) leaves
the device idle unless the next step is already queued. For a greedy decode
step the tokens are an argmax that can stay on the device: the next step is
the same lanes one position further, fed those ids on the device
(`Runner.decode_from`), launched before this step is post-processed.

A lane the launched step ends by max_tokens or context is left out of the
continuation. A lane it ends otherwise (EOS, a stop string, cancellation)
wastes one step: its K/V lands one position past what the lane keeps, and
its row is skipped when that step is post-processed (`Launched.reqs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from strata.engine.controls import has_controls
from strata.engine.masks import PendingMasks
from strata.engine.request import Request
from strata.engine.sampling import has_penalties
from strata.engine.scheduler import Lane, Scheduler, Step
from strata.kv.step import SeqSpec


@dataclass
class Launched:
    """A step whose forward has been issued; post-processed once its tokens are needed."""

    step: Step
    reqs: list[Request | None]  # each lane's request when the step was launched
    logits: torch.Tensor  # sampled rows, in order
    ids: torch.Tensor | None = None  # greedy decode steps: the sampled ids, on the device
    host: torch.Tensor | None = None  # ... and their copy on the host
    ready: Any = None  # CUDA event: the copy is done
    masks: PendingMasks | None = None  # grammar masks of its constrained rows, computed meanwhile
    # a recurrent model's states at the cut points inside its prompt pieces (`StatePool.take_cuts`)
    cuts: dict[int, dict[int, dict[int, dict[str, torch.Tensor]]]] = field(default_factory=dict)

    def take_greedy_ids(self) -> None:
        """For a step of plain greedy decode rows: argmax on the device, copy started to the host."""
        step = self.step
        if not (all(step.sample) and all(s.decoding for s in step.seqs) and all(map(plain_greedy, self.reqs))):
            return
        self.ids = self.logits.argmax(dim=-1)  # what `sample` does for such rows
        self.host = self.ids.to("cpu", non_blocking=True)
        if self.ids.is_cuda:
            self.ready = torch.cuda.Event()
            self.ready.record()

    def host_ids(self) -> list[int]:
        """The greedy ids on the host (waits for their copy only, not for later steps)."""
        assert self.host is not None
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def plain_greedy(req: Request | None) -> bool:
    """Greedy, with no penalties, logprobs or controls: its token is the argmax, taken on the device."""
    return (req is not None and req.params.greedy and req.params.logprobs is None
            and not has_penalties(req.params) and not has_controls(req.params))


def continuation(prev: Launched, scheduler: Scheduler, max_context: int) -> tuple[Step, torch.Tensor] | None:
    """The decode step after `prev` and its input ids on the device, or None for the ordinary path.

    None when `prev` has no device ids, requests are waiting for a lane (they
    are admitted between ordinary steps), no lane goes on, or a lane cannot
    grow (the ordinary plan truncates it).
    """
    if prev.ids is None or scheduler.waiting:
        return None
    seqs: list[SeqSpec] = []
    lanes: list[Lane] = []
    rows: list[int] = []
    for i, (lane, req) in enumerate(zip(prev.step.lanes, prev.reqs)):
        if req is None or lane.request is not req:  # cancelled meanwhile
            continue
        pos = len(lane.tokens) + 1  # prev fed position len(lane.tokens); its sample goes next
        if len(req.output) + 1 >= req.params.max_tokens or pos + 1 >= max_context:
            continue  # prev's token is this request's last
        if scheduler.pool.backed(lane.index) <= pos and not scheduler.reserve_for(lane, pos + 1):
            return None
        seqs.append(SeqSpec(lane.index, pos, 1))
        lanes.append(lane)
        rows.append(i)
    if not seqs:
        return None
    ids = prev.ids if len(rows) == len(prev.reqs) else prev.ids[torch.tensor(rows, device=prev.ids.device)]
    return Step(seqs, lanes, [0] * len(seqs), [True] * len(seqs)), ids
