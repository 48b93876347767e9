"""Recurrent-state checkpoints of the lanes' conversations (`--ctx-checkpoints N`).

A model with recurrent layers (`kv/state.py`) cannot cut a conversation
back to an arbitrary prefix the way K/V can: its state belongs to the
lane's whole token list. So while a prompt is read it stops at cut points
and the lane's state is copied to the host there (a model whose state
layers keep their state at rows inside a step, `cuts_within_steps`, reads
on through the cut and hands over the state there: no step boundary); a later request that
diverges from the lane's conversation resumes from the latest checkpoint at
or before the divergence instead of from token 0 (a regenerated answer from
the end of its prompt, an edited message from the turn before it).

Cut points of a prompt (`cut_points`): one token before its end (a
regenerate reads only that token again), every `min_step` tokens of a long
prompt when set, and wherever the request names one. When a request
continues a lane's whole conversation, the lane's state at that point (the
end of the last answer) is kept too.

A checkpoint at position p stays valid while the lane keeps its first p
tokens: cutting the lane back drops the ones past the cut. A lane keeps at
most N: a full lane gives up the checkpoint closest to the one before it
(`to_drop`: an edit past it then re-reads the fewest tokens more), so the
checkpoints stay spread over the chat instead of crowding at its end.

A conversation that leaves its lane takes its checkpoints along, with one
more of the state at its full length (`snapshot`): the conversation cache
parks them beside its K/V and a session file saves them; `install` puts
them back into a lane. The states are host tensors that nobody writes once
saved, so they move between lanes, entries and files without a copy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from strata.kv.state import StatePool

State = dict[int, dict[str, torch.Tensor]]


@dataclass
class Checkpoint:
    position: int
    state: State
    nbytes: int
    used: int  # a tick: when it was saved or last restored
    copied: Any = None  # on CUDA, the event after which `state` is on the host (`StatePool.export`)

    def on_host(self) -> State:
        """The state, once its copy to the host is done (for readers on the host: session files)."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None
        return self.state


@dataclass
class CheckpointStats:
    saves: int = 0
    inside: int = 0  # of the saves, those taken inside a step (`Checkpoints.save(inner=)`)
    restores: int = 0
    tokens_reused: int = 0
    dropped: int = 0
    held: int = 0
    bytes: int = 0
    bytes_per_checkpoint: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


MIN_CUT_GAP = 16  # a cut nearer than this to the one before it saves less than a step costs


def cut_points(start: int, length: int, min_step: int, named: list[int] | None = None) -> list[int]:
    """Positions in (start, length) where reading a prompt of `length` tokens from `start`
    stops to save a checkpoint, ascending. Each stop costs a step, so a cut within MIN_CUT_GAP
    tokens after the previous one (or after `start`) is left out; the one before the end stays
    (a repeat then resumes exactly where the first read stopped)."""
    cuts = set(named or [])
    if min_step > 0:
        cuts.update(range(min_step, length, min_step))
    kept: list[int] = []
    for c in sorted(c for c in cuts if start < c < length - 1):
        if c - (kept[-1] if kept else start) >= MIN_CUT_GAP:
            kept.append(c)
    if start < length - 1:
        kept.append(length - 1)
    return kept


def to_drop(held: list[Checkpoint], newest: int) -> Checkpoint:
    """The checkpoint a full lane gives up: the one nearest the checkpoint before it (or position
    0), never the one at `newest` just saved; ties go to the least recently used."""
    ordered = sorted(held, key=lambda c: c.position)
    gaps = {id(c): c.position - (ordered[i - 1].position if i else 0) for i, c in enumerate(ordered)}
    return min((c for c in ordered if c.position != newest), key=lambda c: (gaps[id(c)], c.used))


@dataclass
class Checkpoints:
    """Every lane's checkpoints, beside the state pool whose slots they copy."""

    pool: StatePool
    per_lane: int
    min_step: int = 0
    lanes: dict[int, list[Checkpoint]] = field(default_factory=dict)
    stats: CheckpointStats = field(default_factory=CheckpointStats)
    _tick: int = 0

    def __post_init__(self) -> None:
        self.stats.bytes_per_checkpoint = self.pool.bytes_per_lane()

    def _export(self, lane: int, inner: State | None) -> tuple[State, int, int, Any]:
        state, copied = self.pool.export(lane) if inner is None else self.pool.to_host(inner)
        return state, self.pool.bytes_per_lane(), self._now(), copied

    def _now(self) -> int:
        self._tick += 1
        return self._tick

    def _held(self, lane: int) -> list[Checkpoint]:
        return self.lanes.setdefault(lane, [])

    def save(self, lane: int, position: int, inner: State | None = None) -> None:
        """Copy the lane's state, which covers its first `position` tokens; or `inner`, its state
        at `position` taken inside a step (`StatePool.take_cuts`)."""
        if self.per_lane <= 0 or position <= 0:
            return
        held = [c for c in self._held(lane) if c.position != position]
        held.append(Checkpoint(position, *self._export(lane, inner)))
        while len(held) > self.per_lane:
            held.remove(to_drop(held, position))
            self.stats.dropped += 1
        self.lanes[lane] = sorted(held, key=lambda c: c.position)
        self.stats.saves += 1
        self.stats.inside += inner is not None
        self._count()

    def best(self, lane: int, limit: int) -> int:
        """The latest checkpointed position at or before `limit` (0: none, read from the start)."""
        return max((c.position for c in self._held(lane) if c.position <= limit), default=0)

    def resume(self, lane: int, position: int) -> None:
        """Put the lane's state back to `position` (a checkpoint of it, or zeros at 0) and drop
        the checkpoints past it."""
        self.cut(lane, position)
        if position == 0:
            self.pool.load(lane, None)
            return
        cp = next(c for c in self._held(lane) if c.position == position)
        self.pool.load(lane, cp.state)
        cp.used = self._now()
        self.stats.restores += 1
        self.stats.tokens_reused += position

    def cut(self, lane: int, keep: int) -> None:
        """The lane keeps its first `keep` tokens: checkpoints past them are no longer its own."""
        held = self._held(lane)
        kept = [c for c in held if c.position <= keep]
        self.stats.dropped += len(held) - len(kept)
        self.lanes[lane] = kept
        self._count()

    def snapshot(self, lane: int, length: int) -> list[Checkpoint]:
        """The lane's checkpoints and its state at its full `length` (a new one): what a parked
        or saved conversation keeps, ascending by position."""
        held = [c for c in self._held(lane) if c.position < length]
        now = Checkpoint(length, *self._export(lane, None))
        return held + [now]

    def install(self, lane: int, states: list[Checkpoint], position: int) -> None:
        """The lane now holds a conversation's first `position` tokens (restored from the cache
        or a file): its state becomes the one saved at `position`, its checkpoints those up to it."""
        state = next((c for c in states if c.position == position), None)
        if state is None:
            raise ValueError(f"no saved state at position {position}")
        self.pool.load(lane, state.state)
        before = [c for c in states if c.position <= position]
        self.lanes[lane] = before[max(0, len(before) - self.per_lane):] if self.per_lane > 0 else []
        state.used = self._now()
        self.stats.restores += 1
        self.stats.tokens_reused += position
        self._count()

    def layout(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """("layer.name", dtype, per-lane shape) of every state tensor, in `flat_state`'s order:
        what a session file records and checks."""
        return [(f"{layer}.{name}", t.dtype, tuple(t.shape[1:]))
                for layer, named in sorted(self.pool.layers.items()) for name, t in sorted(named.items())]

    def cut_points(self, start: int, length: int, named: list[int] | None = None) -> list[int]:
        """Where reading a prompt of `length` tokens from `start` stops (module docstring)."""
        return cut_points(start, length, self.min_step, named) if self.per_lane > 0 else []

    def swap(self, a: int, b: int) -> None:
        """Conversations moved between lanes: their states (slots, not copies) and checkpoints
        go with them."""
        self.pool.swap(a, b)
        self.lanes[a], self.lanes[b] = self._held(b), self._held(a)

    def _count(self) -> None:
        held = [c for cs in self.lanes.values() for c in cs]
        self.stats.held = len(held)
        self.stats.bytes = sum(c.nbytes for c in held)


def flat_state(state: State) -> dict[str, torch.Tensor]:
    """A state keyed "layer.name" (layers ascending, names sorted): a session file's runs."""
    return {f"{layer}.{name}": t for layer, named in sorted(state.items()) for name, t in sorted(named.items())}


def nested_state(flat: dict[str, torch.Tensor]) -> State:
    """`flat_state` undone."""
    out: State = {}
    for key, t in flat.items():
        layer, name = key.split(".", 1)
        out.setdefault(int(layer), {})[name] = t
    return out
