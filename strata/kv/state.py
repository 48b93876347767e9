"""Per-lane recurrent state beside the KV pool: what a recurrent layer carries between steps.

A recurrent layer (a gated DeltaNet's matrix state and its short
convolution's tail) or a sliding-window layer (the k/v of its window) has a
fixed-size state per lane instead of K/V cells that grow with the context.
The model declares each such layer's state shapes (`state_shapes`) and,
where a state is not float32, its dtype (a window's k/v stay in the model's
dtype, so they hold the same values a pool cell would); the engine keeps
one slot per lane and layer (`StatePool`), and every step hands the layers
a `StateContext`: the step's sequences as row spans, each sequence's state
before its rows (zeros for one that starts at position 0) and a place to
put the state after them.

The state of a lane always belongs to exactly the lane's tokens: unlike a
prefix of K/V it cannot be cut back, which is why prefix reuse of such a
model resumes only from the lane's full length or from a checkpoint.

A prompt piece may carry cut points inside it (`cuts`): a layer computes
the piece in parts split there, each part continuing the state the part
before left, and hands over its state at each cut (`keep_cut`), so a
checkpoint costs no step boundary (engine/checkpoints.py). The parts are
the spans the steps would have had with a boundary at each cut.

Speculative decoding feeds a lane's drafts as one run of rows and keeps
only those verification accepts. A step marks such runs (`runs`); a layer
computes a run's rows as consecutive decode rows (the arithmetic of
decoding them one a step) and hands over its state after every row
(`keep_run`: the whole state, or for a window ring the slots the run
wrote). The pool holds those until the verification, and `rewind` puts a
lane whose drafts were rejected back to the state after its last kept row,
bit for bit the state of a run that never saw the rejected tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from strata.uploads import upload

if TYPE_CHECKING:  # a type only: the pool does not depend on the model's kernels
    from strata.models.deltanet_fla import VarlenLayout

StateShapes = dict[str, tuple[int, ...]]  # state name -> per-lane shape
StateDtypes = dict[str, torch.dtype]  # state name -> dtype, where it is not float32


@dataclass
class RunStates:
    """One layer's state after each row of one verified run (speculative decoding).

    after[name][j] is the whole per-lane state after the run's row j (n rows: a tensor [n, *shape]
    or a list of n tensors, which a recurrent layer's loop made anyway: no copy); or, where
    cells[name] is given, [n, len(cells), *rest]: the values of those entries along the state's
    first dimension (a window ring's slots that the run wrote), the rest untouched.
    """

    after: dict[str, Sequence[torch.Tensor]]
    cells: dict[str, torch.Tensor] | None = None

    @property
    def rows(self) -> int:
        return len(next(iter(self.after.values())))


@dataclass(frozen=True)
class PadRows:
    """The padding of a captured prompt step (engine/prompt_graphs.py): one sequence of B rows
    whose first n are its tokens, the last of them read apart; device tensors refilled before
    each replay.

    `head` [B] bool: the rows before the last token (rows < n - 1); `last` [1] int64: the last
    token's row, n - 1. A recurrent layer computes all B rows (the graph's shapes) but leaves
    the state as the tokens leave it: the rows from n - 1 on are no-ops in the first pass (their
    gates are masked), then the last token continues the state alone, as a prompt whose end
    is a cut point is read (`checkpoints.cut_points` always cuts one token before the end), so
    the state before it is at hand for that checkpoint: each layer puts it in `kept` (layer ->
    name -> state; in a captured graph, its buffers, which every replay refills).
    """

    head: torch.Tensor
    last: torch.Tensor
    # the B rows' varlen layout for FLA's kernels (`deltanet_fla.VarlenLayout`), built for the
    # capture alone: FLA caches index tensors it derives by the identity of the layout's, so
    # a layout an eager step also used could hand the graph a tensor that cache later frees
    layout: VarlenLayout | None = None
    kept: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)


class StateContext(Protocol):
    """One step's view of the recurrent state of its sequences.

    The step's T rows are its sequences' new tokens, flattened in order;
    `spans[i]` is sequence i's (first row, number of rows).
    """

    spans: list[tuple[int, int]]
    slots: torch.Tensor  # [S] int64: each sequence's slot in the tensors of `in_place`
    # runs[i]: sequence i is a verified run of drafts: its rows are computed as consecutive
    # decode rows and its state after each row goes to `keep_run`
    runs: list[bool]
    # cuts[i]: the rows of sequence i after which its state goes to `keep_cut` (0 < c < n)
    cuts: list[tuple[int, ...]]
    # a captured prompt step's padding (`PadRows`): its one sequence's rows from its last token on
    # padding, which a layer must leave out of the state; None in every other step
    pad: PadRows | None

    def load(self, layer: int) -> dict[str, torch.Tensor]:
        """name -> [S, *shape] (float32 unless declared otherwise): each sequence's state before
        its rows (zeros where it starts at position 0)."""
        ...

    def save(self, layer: int, state: dict[str, torch.Tensor]) -> None:
        """name -> [S, *shape]: each sequence's state after its last row."""
        ...

    def in_place(self, layer: int) -> dict[str, torch.Tensor]:
        """name -> [slots, *shape]: the layer's state tensors themselves, sequence i's at
        `slots[i]`, for a layer that reads and writes a few entries of a large state where it
        lies (a sliding window's ring) instead of copying it through `load` and `save`. Slots of
        sequences at position 0 are not zeroed: such a layer knows which entries are valid."""
        ...

    def keep_run(self, layer: int, seq: int, run: RunStates) -> None:
        """The state of run `seq` (runs[seq]) after each of its rows, for `StatePool.rewind`."""
        ...

    def keep_cut(self, layer: int, seq: int, rows: int, state: dict[str, torch.Tensor]) -> None:
        """Sequence `seq`'s state (name -> [*shape]) after its first `rows` rows, a cut in
        cuts[seq]: a tensor nobody writes afterwards."""
        ...


class StatePool:
    """One slot per lane of every stateful layer's state, on the model's device.

    A lane's state lives in slot `slot_of[lane]`; moving a conversation
    between lanes swaps slots (no copy), as the KV pool swaps chunk tables.
    """

    def __init__(self, shapes: dict[int, StateShapes], num_lanes: int, device: torch.device | str,
                 dtypes: dict[int, StateDtypes] | None = None, trash: bool = False) -> None:
        """dtypes: layer -> name -> dtype of the states that are not float32.
        trash: one more slot that no lane owns, for the padding rows of a captured decode step
        (engine/graphs.py) to write; it costs one lane's state."""
        self.shapes = shapes
        self.device = torch.device(device)
        self.slot_of = list(range(num_lanes))
        self.trash = num_lanes if trash else None
        # the last step's verified runs: lane -> (layer, slot, its state after each row)
        self.kept_runs: dict[int, list[tuple[int, int, RunStates]]] = {}
        # the last eager step's states at cut points: lane -> rows into its span -> layer -> name
        # -> state (`StateContext.keep_cut`); the engine takes them (`take_cuts`)
        self.cut_states: dict[int, dict[int, dict[int, dict[str, torch.Tensor]]]] = {}
        dtypes = dtypes or {}
        self.layers: dict[int, dict[str, torch.Tensor]] = {
            layer: {name: torch.zeros((num_lanes + int(trash), *shape), device=self.device,
                                      dtype=dtypes.get(layer, {}).get(name, torch.float32))
                    for name, shape in named.items()}
            for layer, named in shapes.items()}

    def bytes_per_lane(self) -> int:
        """Bytes of one lane's state over every layer: what a checkpoint holds."""
        return sum(t[0].nbytes for named in self.layers.values() for t in named.values())

    def total_bytes(self) -> int:
        return sum(t.nbytes for named in self.layers.values() for t in named.values())

    def swap(self, a: int, b: int) -> None:
        self.slot_of[a], self.slot_of[b] = self.slot_of[b], self.slot_of[a]

    def export(self, lane: int) -> tuple[dict[int, dict[str, torch.Tensor]], torch.cuda.Event | None]:
        """A host copy of the lane's state (a checkpoint), and on CUDA the event after which it is
        there: the copy goes to pinned memory without stopping the stream (a prompt read that
        checkpoints as it goes would otherwise wait for the device at every cut). `load` may take
        it at once (same stream); a reader on the host waits for the event first."""
        s = self.slot_of[lane]
        return self.to_host({layer: {name: t[s] for name, t in named.items()}
                             for layer, named in self.layers.items()})

    def to_host(self, state: dict[int, dict[str, torch.Tensor]]
                ) -> tuple[dict[int, dict[str, torch.Tensor]], torch.cuda.Event | None]:
        """A host copy of one lane's state (layer -> name -> tensor on the pool's device), as
        `export` returns it: on CUDA into pinned memory without stopping the stream."""
        if self.device.type != "cuda":
            return {layer: {name: t.to("cpu", copy=True) for name, t in named.items()}
                    for layer, named in state.items()}, None
        flat = [(layer, name, t) for layer, named in state.items() for name, t in named.items()]
        out: dict[int, dict[str, torch.Tensor]] = {layer: {} for layer in state}
        for (layer, name, t), host in zip(flat, pinned_like([t for _, _, t in flat]), strict=True):
            out[layer][name] = host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return out, done

    def load(self, lane: int, state: dict[int, dict[str, torch.Tensor]] | None) -> None:
        """Set the lane's state to `state` (as `export` returns it); None: zeros (position 0)."""
        s = self.slot_of[lane]
        for layer, named in self.layers.items():
            for name, t in named.items():
                if state is None:
                    t[s].zero_()
                else:
                    t[s].copy_(state[layer][name], non_blocking=True)

    def step(self, spans: list[tuple[int, int]], lanes: list[int], fresh: list[bool],
             runs: list[bool] | None = None, cuts: list[tuple[int, ...]] | None = None) -> StepStates:
        """The StateContext of one step: sequence i is lane `lanes[i]`'s rows `spans[i]`,
        starting from zeros where `fresh[i]` (its first row is position 0); `runs[i]`: a verified
        run of drafts, whose state after each row is kept until `rewind` (None: no runs);
        `cuts[i]`: rows after which its state is kept (`StepStates.cut_states`).
        The previous step's kept runs are let go."""
        self.kept_runs = {}
        self.cut_states = {}
        return StepStates(self, spans, lanes, fresh, runs or [False] * len(spans), cuts or [()] * len(spans))

    def take_cuts(self) -> dict[int, dict[int, dict[int, dict[str, torch.Tensor]]]]:
        """The last step's states at its cut points (lane -> rows into its span -> state), let go
        here: a later step does not overwrite them, so a pipelined engine may post-process the
        step after launching the next."""
        cuts, self.cut_states = self.cut_states, {}
        return cuts

    def rewind(self, lane: int, rows: int) -> None:
        """The lane keeps only the first `rows` rows of its verified run of the last step (the
        drafts after them were rejected): its state becomes the one after row `rows` - 1, as if
        the rejected rows had never been fed. Keeping every row leaves the state as it is."""
        for layer, slot, run in self.kept_runs.pop(lane, []):
            if not 0 < rows <= run.rows:
                raise ValueError(f"a run of {run.rows} rows cannot keep {rows}")
            if rows == run.rows:
                continue
            for name, after in run.after.items():
                t = self.layers[layer][name][slot]
                cells = None if run.cells is None else run.cells.get(name)
                if cells is None:
                    t.copy_(after[rows - 1])
                else:
                    t.index_copy_(0, cells, after[rows - 1].to(t.dtype))


def pinned_like(tensors: list[torch.Tensor], align: int = 64, pin: bool = True) -> list[torch.Tensor]:
    """Empty host tensors shaped like `tensors`, views of one block (page-locked where `pin`):
    a checkpoint of every layer's state costs one page-locked allocation (about 0.3 ms each on
    an H100), not one a tensor. Each view starts `align`-byte aligned."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.nbytes // align) * align
    block = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    return [block[o : o + t.nbytes].view(t.dtype).view(t.shape) for o, t in zip(offsets, tensors)]


class SlotStates:
    """`StateContext` over a `StatePool` for sequences whose slots are a device tensor: gathers
    them before a layer's rows, scatters them back after. It verifies no drafts (`keep_run`)."""

    def __init__(self, pool: StatePool, slots: torch.Tensor, spans: list[tuple[int, int]],
                 runs: list[bool], cuts: list[tuple[int, ...]], pad: PadRows | None = None) -> None:
        self.pool = pool
        self.slots = slots
        self.spans = spans
        self.runs = runs
        self.cuts = cuts
        self.pad = pad

    def load(self, layer: int) -> dict[str, torch.Tensor]:
        return {name: t.index_select(0, self.slots) for name, t in self.pool.layers[layer].items()}

    def in_place(self, layer: int) -> dict[str, torch.Tensor]:
        return self.pool.layers[layer]

    def save(self, layer: int, state: dict[str, torch.Tensor]) -> None:
        for name, t in self.pool.layers[layer].items():
            t.index_copy_(0, self.slots, state[name].to(t.dtype))

    def keep_run(self, layer: int, seq: int, run: RunStates) -> None:
        raise RuntimeError("this step verifies no drafts")

    def keep_cut(self, layer: int, seq: int, rows: int, state: dict[str, torch.Tensor]) -> None:
        raise RuntimeError("this step has no cut points")


class StepStates(SlotStates):
    """The StateContext of an eager step (`StatePool.step`): sequences starting at position 0
    begin from zeros, and verified runs keep their states for `StatePool.rewind`."""

    def __init__(self, pool: StatePool, spans: list[tuple[int, int]], lanes: list[int],
                 fresh: list[bool], runs: list[bool], cuts: list[tuple[int, ...]]) -> None:
        slots = upload([pool.slot_of[lane] for lane in lanes], pool.device)
        super().__init__(pool, slots, spans, runs, cuts)
        self.lanes = lanes
        self.fresh = upload(fresh, pool.device, torch.bool)
        self.any_fresh = any(fresh)

    def load(self, layer: int) -> dict[str, torch.Tensor]:
        out = super().load(layer)
        if self.any_fresh:  # a masked fill, not a boolean index: that would wait for the device
            for s in out.values():
                s.masked_fill_(self.fresh.view(-1, *[1] * (s.dim() - 1)), 0)
        return out

    def keep_run(self, layer: int, seq: int, run: RunStates) -> None:
        lane = self.lanes[seq]
        self.pool.kept_runs.setdefault(lane, []).append((layer, self.pool.slot_of[lane], run))

    def keep_cut(self, layer: int, seq: int, rows: int, state: dict[str, torch.Tensor]) -> None:
        self.pool.cut_states.setdefault(self.lanes[seq], {}).setdefault(rows, {})[layer] = state


def decode_states(pool: StatePool, slots: torch.Tensor) -> SlotStates:
    """The StateContext of a captured decode step (engine/graphs.py): one row per sequence, the
    sequences' slots in `slots` [S] (int64 on the device, refilled before each replay: a lane's
    slot, or `pool.trash` for a padding row), so the step reads and writes the states where they
    lie with no host work. No sequence starts at position 0 and none verifies drafts."""
    n = slots.shape[0]
    return SlotStates(pool, slots, [(i, 1) for i in range(n)], [False] * n, [()] * n)


def prompt_states(pool: StatePool, slot: torch.Tensor, pad: PadRows) -> SlotStates:
    """The StateContext of a captured prompt step (engine/prompt_graphs.py): one sequence of
    `pad`'s rows, the lane's slot in `slot` [1] (int64 on the device). The lane continues its
    state (it does not start at position 0) and verifies no drafts."""
    rows = int(pad.head.shape[0])
    return SlotStates(pool, slot, [(0, rows)], [False], [()], pad)
