"""One batched forward of the model over a planned step."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from strata.attention.select import HAVE_TRITON, backend_for, graphs_possible
from strata.engine.graphs import CaptureFailed  # host work only: Triton comes with its captures
from strata.kv.pool import KvPool
from strata.kv.state import StatePool
from strata.kv.step import SeqSpec, sampled_rows, step_positions
from strata.uploads import upload

if TYPE_CHECKING:  # the annotations of `_captures`
    from strata.engine.graphs import DecodeGraphs
    from strata.engine.prompt_graphs import PromptGraphs

log = logging.getLogger(__name__)


class StepHooks(Protocol):
    """What the runner tells about each step it launches (the expert refill of `--expert-misses
    mapped`, models/expert_refill.py): the step's real row count, before and after its launch."""

    def before_step(self, rows: int) -> None: ...

    def after_step(self, rows: int) -> None: ...


def graphs_factory() -> type | None:
    """The decode-graph capture a split's stages use (`graphs.DecodeGraphs`), None without Triton."""
    if not HAVE_TRITON:
        return None
    from strata.engine.graphs import DecodeGraphs  # imports Triton

    return DecodeGraphs


class Runner:
    def __init__(self, model: torch.nn.Module, pool: KvPool, scale: float, device: torch.device,
                 graphs: bool = True, states: StatePool | None = None, windowed: bool = False,
                 rows_per_lane: int = 1, keep_hidden: bool = False,
                 hooks: StepHooks | None = None, prompt_graphs: bool = False) -> None:
        """states: a recurrent or windowed model's per-lane state (`kv/state.py`); a recurrent
        model's decode steps replay graphs too (its states gathered by device slots), a windowed
        one's run eagerly (its ring's bookkeeping reads the slots on the host).
        windowed: a pool layer attends within a sliding window (`select.backend_for`).
        rows_per_lane: 1 + the most drafts a lane verifies in a step (graphs are sized for them).
        keep_hidden: keep an eager step's final hidden states, every row, in `hidden` (the MTP
        head reads them: engine/mtp.py).
        hooks: told each step's real row count before and after it is launched (`StepHooks`).
        prompt_graphs: with decode graphs and `states`, a lane's short prompt steps replay
        graphs too (`--prompt-graphs`, engine/prompt_graphs.py)."""
        self.model = model
        self.states = states
        self.pool = pool
        self.scale = scale
        self.device = device
        self.keep_hidden = keep_hidden
        self.hooks = hooks
        self.hidden: torch.Tensor | None = None  # the last eager step's, with keep_hidden
        self.context = backend_for(pool, windowed)  # the attention backend of every step (attention/select.py)
        self.graphs = None  # CUDA graphs of decode steps
        # an MTP head feeds on every step's hidden states, which a replayed graph does not keep
        capturable = states is None or (model.states_capturable() and not keep_hidden)
        if graphs and capturable and graphs_possible(self.context):
            from strata.engine.graphs import DecodeGraphs  # imports Triton

            self.graphs = DecodeGraphs(model, pool, scale, rows_per_lane=rows_per_lane, states=states)
        # CUDA graphs of one lane's short prompt pieces, for a recurrent model: a later turn that
        # resumes from a checkpoint reads its new message in one replay (engine/prompt_graphs.py)
        self.prompt_graphs = None
        if prompt_graphs and self.graphs is not None and states is not None:
            from strata.engine.prompt_graphs import PromptGraphs

            self.prompt_graphs = PromptGraphs(model, pool, scale, states)

    def describe_stages(self) -> list[dict]:
        """One stage: the whole model on one device (a split's runner lists each of its stages)."""
        return [{"layers": [0, len(self.model.layers)], "device": str(self.device), "kind": "local",
                 "kv_bytes": self.pool.total_bytes()}]

    def close(self) -> None:
        """Nothing to let go of on one device (a split's runner closes its links)."""

    def reconnect_if_lost(self) -> bool:
        """Whether a stage lost its state (one device: never; see parallel/stages.py)."""
        return False

    @torch.inference_mode()
    def decode_from(self, seqs: list[SeqSpec], ids: torch.Tensor) -> torch.Tensor:
        """Logits of a decode step whose input ids are a device tensor (the last step's samples).

        With CUDA graphs the ids are copied on the device, so the step is
        launched without waiting for the previous one to finish.
        """
        if self.graphs is not None and self.graphs.supports(seqs, [True] * len(seqs)) \
                and self._graphs_ready(len(seqs)):
            self.hidden = None
            return self._told(len(seqs), lambda: self.graphs.forward(seqs, [0] * len(seqs), device_ids=ids))
        return self.forward(seqs, ids.tolist(), [True] * len(seqs))

    @torch.inference_mode()
    def forward(self, seqs: list[SeqSpec], tokens: list[int], sample: list[int]) -> torch.Tensor:
        """Logits (float32) of the rows `sampled_rows(seqs, sample)` names, in order."""
        return self._told(len(tokens), lambda: self._forward(seqs, tokens, sample))

    def _graphs_ready(self, lanes: int) -> bool:
        """Whether the decode graph of `lanes` lanes exists or captures now. A capture that fails
        turns this runner's graphs off, with one warning, and its steps run eagerly."""
        assert self.graphs is not None
        if _captures(self.graphs, lanes, "decode steps", "lanes"):
            return True
        self.graphs = None
        return False

    def _prompt_graphs_ready(self, rows: int) -> bool:
        """`_graphs_ready` for the prompt graph of `rows` rows: a failed capture turns the prompt
        graphs off (one warning); the decode graphs stay."""
        assert self.prompt_graphs is not None
        if _captures(self.prompt_graphs, rows, "short prompt steps", "rows"):
            return True
        self.prompt_graphs = None
        return False

    def _told(self, rows: int, launch: Callable[[], torch.Tensor]) -> torch.Tensor:
        """launch() with the hooks told of its `rows` real rows before and after."""
        if self.hooks is None:
            return launch()
        self.hooks.before_step(rows)
        logits = launch()
        self.hooks.after_step(rows)
        return logits

    def _forward(self, seqs: list[SeqSpec], tokens: list[int], sample: list[int]) -> torch.Tensor:
        self.hidden = None  # a captured graph's step keeps none
        if self.prompt_graphs is not None and self.prompt_graphs.supports(seqs, sample) \
                and self._prompt_graphs_ready(seqs[0].n):
            return self.prompt_graphs.forward(seqs[0], tokens, bool(sample[0]))  # valid until the next step
        if self.graphs is not None:
            rows = self.graphs.step_rows(seqs, sample)  # drafts verified as decode rows
            if rows is not None and self.graphs.supports(rows, [1] * len(rows)) and self._graphs_ready(len(rows)):
                return self.graphs.forward(rows, tokens)  # valid until the next step: sample at once
        input_ids = upload(tokens, self.device)
        positions = step_positions(seqs)
        ctx = self.context(self.pool, seqs, self.scale)
        if self.states is None:
            hidden = self.model(input_ids, positions.to(self.device, non_blocking=True), ctx)
        else:
            rows = [0]
            for s in seqs[:-1]:
                rows.append(rows[-1] + s.n)
            # a run that samples all its rows (more than one) verifies drafts: its state after
            # each row is kept until the verification says how many stay (`StatePool.rewind`)
            states = self.states.step([(r, s.n) for r, s in zip(rows, seqs)], [s.lane for s in seqs],
                                      [s.start == 0 for s in seqs], [w > 1 for w in sample],
                                      [s.cuts for s in seqs])
            hidden = self.model(input_ids, positions.to(self.device, non_blocking=True), ctx, states=states)
        self.hidden = hidden if self.keep_hidden else None
        rows = sampled_rows(seqs, sample)
        if not rows:
            return torch.empty(0, device=self.device)
        return self.model.compute_logits(hidden[upload(rows, self.device)])


def _captures(graphs: DecodeGraphs | PromptGraphs, size: int, steps: str, unit: str) -> bool:
    """graphs.prepare(size), or False with one warning that such steps run eagerly from now on."""
    try:
        graphs.prepare(size)
        return True
    except CaptureFailed as e:
        log.warning("%s run eagerly from now on: a CUDA graph of %d %s did not capture (%s)", steps, size, unit, e)
        return False
