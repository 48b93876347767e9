"""Session files for lanes: save a lane's conversation, restore one into a lane.

Saves and the writing half of a restore run inside the engine loop (between
steps), so they never race a forward pass. A restore is read and checked
first, off the engine thread (`read`: only regular files, the checksum, then
every layout fact against this engine: layers, runs, dtypes, cell shapes,
length, token ids, a recurrent model's state layout), then `install`
reserves the pool chunks it needs (KvPoolFull if they are not there) and only
then writes a byte; on any error the engine is left as it was. A recurrent
model's file holds the conversation's saved states (`checkpoints.py`: its
checkpoints and its state at the end), so it continues where it was saved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from strata.engine.checkpoints import Checkpoint, Checkpoints, flat_state, nested_state
from strata.engine.scheduler import Lane, Scheduler
from strata.engine.snapshot import (
    RunInfo,
    SavedState,
    SessionHeader,
    check_layout,
    check_tokens,
    layout_of,
    read_session,
    resolve_session_path,
    save_session,
)
from strata.errors import BadRequest, KvPoolFull, SessionFileError, StrataError
from strata.kv.formats import Storage


@dataclass
class LoadedSession:
    """A session file read and checked against this engine, not yet in any lane."""

    filename: str
    tokens: torch.Tensor
    layers: list[Storage]
    n_bytes: int
    states: list[Checkpoint]  # a recurrent model's saved states, ascending; the last at the end


@dataclass
class SessionResult:
    lane: int
    filename: str
    n_tokens: int
    n_bytes: int


class SessionFiles:
    def __init__(self, scheduler: Scheduler, session_dir: str | None, model_identity: str,
                 vocab_size: int | None = None) -> None:
        self.scheduler = scheduler
        self.checkpoints: Checkpoints | None = scheduler.checkpoints  # a recurrent model's
        self.pool = scheduler.pool
        self.session_dir = session_dir
        self.identity = model_identity
        self.vocab_size = vocab_size
        # fixed for the engine's life: safe to read anywhere; every layer's cells have the format's runs
        self.layout = layout_of([self.pool.fmt.allocate(0, "cpu") for _ in range(self.pool.num_layers)])
        cps = self.checkpoints
        self.state_layout = tuple(RunInfo(name, str(dtype).removeprefix("torch."), shape)
                                  for name, dtype, shape in (cps.layout() if cps is not None else []))

    def _path(self, filename: str) -> Path:
        if self.session_dir is None:
            raise SessionFilesDisabled()
        return resolve_session_path(self.session_dir, filename)

    def _lane(self, index: int) -> Lane:
        lanes = self.scheduler.lanes
        if not 0 <= index < len(lanes):
            raise BadRequest(f"no lane {index}: lanes are 0..{len(lanes) - 1}", "id_slot")
        return lanes[index]

    def save(self, lane_index: int, filename: str) -> SessionResult:
        """Write the conversation the lane holds (idle, or the part read so far) to a file."""
        path = self._path(filename)
        lane = self._lane(lane_index)
        n = len(lane.tokens)
        if n == 0:
            raise BadRequest(f"lane {lane_index} holds no conversation to save", "id_slot")
        layers = self.pool.export_range(lane.index, 0, n)
        states = self.checkpoints.snapshot(lane.index, n) if self.checkpoints is not None else []
        size = save_session(path, lane.tokens, layers, model_identity=self.identity,
                            kv_format=self.pool.fmt.name, states=saved(states))
        return SessionResult(lane_index, filename, n, size)

    def save_parked(self, cache: Any, entry_id: int, filename: str) -> SessionResult:
        """Write a parked conversation (from the conversation cache) to a file."""
        path = self._path(filename)
        if cache is None or entry_id not in cache.entry_ids():
            raise BadRequest(f"no parked conversation {entry_id}", "id")
        entry = cache.entry(entry_id)
        parking = self.scheduler.parking
        layers = parking.entry_runs(entry_id) if parking is not None else entry.kv.layers()
        n = entry.kv.n_cells
        size = save_session(path, entry.tokens[:n], layers, model_identity=self.identity,
                            kv_format=self.pool.fmt.name, states=saved(entry.states))
        return SessionResult(-1, filename, n, size)

    def restore(self, lane_index: int, filename: str) -> SessionResult:
        """Read a file into an idle lane, replacing (after parking) its conversation."""
        self._lane(lane_index)
        return self.install(lane_index, self.read(filename))

    def read(self, filename: str) -> LoadedSession:
        """Read and check a session file against this engine; touches no lane (any thread)."""
        path = self._path(filename)
        where = str(path)

        def accept(header: SessionHeader) -> None:
            check_layout(header, self.layout, where)
            n = header.n_tokens
            if n < 1:
                raise BadRequest(f"{filename}: the file holds no tokens", "filename")
            if n >= self.pool.max_chunks * self.pool.chunk_size:
                raise BadRequest(f"{filename}: {n} tokens do not fit --max-context", "filename")
            if self.pool.chunks_for(n) > self.pool.num_chunks:
                raise BadRequest(f"{filename}: {n} tokens are more than the whole KV pool holds "
                                 f"({self.pool.total_cells} cells)", "filename")
            self._check_states(header, where)

        data = read_session(path, model_identity=self.identity, kv_format=self.pool.fmt.name,
                            accept=accept)  # one open: the header checked is the one read
        if self.vocab_size is not None:
            check_tokens(data.tokens, self.vocab_size, where)
        states = [Checkpoint(pos, nested_state(flat), sum(t.nbytes for t in flat.values()), 0)
                  for pos, flat in data.states]
        return LoadedSession(filename, data.tokens, data.layers, os.lstat(path).st_size, states)

    def _check_states(self, header: SessionHeader, where: str) -> None:
        """A recurrent model needs the file's state at its end, in this model's layout; any other
        model refuses a file with states."""
        if not self.state_layout:
            if header.state_runs:
                raise SessionFileError(where, "holds recurrent state; this model has no recurrent layers")
            return
        if not header.state_positions or header.state_positions[-1] != header.n_tokens:
            raise SessionFileError(where, "holds no recurrent state at its end; this model needs it")
        if header.state_runs != self.state_layout:
            got = {r.name: (r.dtype, list(r.shape)) for r in header.state_runs}
            want = {r.name: (r.dtype, list(r.shape)) for r in self.state_layout}
            diff = sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))
            raise SessionFileError(where, f"its recurrent state differs from this model's (first at "
                                          f"{diff[0] if diff else 'the run order'})")

    def install(self, lane_index: int, loaded: LoadedSession) -> SessionResult:
        """Write a checked session into an idle lane (engine thread), its old conversation giving way."""
        lane = self._lane(lane_index)
        if lane.request is not None:
            raise BadRequest(f"lane {lane_index} is busy; restore into an idle lane", "id_slot")
        n = len(loaded.tokens)
        need = self.pool.chunks_for(n)
        if self.pool.shortfall(lane.index, n) > 0 and not self._room_possible(lane, need):
            raise KvPoolFull(f"KV pool full: restoring {n} tokens needs {need} chunks",
                             retry_after=self.scheduler.retry_after)
        self.scheduler.give_way(lane, 0)
        if not self.scheduler.reserve_for(lane, n):
            raise KvPoolFull(f"KV pool full: restoring {n} tokens needs {need} chunks",
                             retry_after=self.scheduler.retry_after)
        self.pool.import_range(lane.index, 0, [{k: torch.as_tensor(a[:n]) for k, a in runs.items()}
                                               for runs in loaded.layers])
        if self.checkpoints is not None:
            self.checkpoints.install(lane.index, loaded.states, n)
        lane.tokens = loaded.tokens.tolist()
        return SessionResult(lane_index, loaded.filename, n, loaded.n_bytes)

    def _room_possible(self, lane: Lane, need: int) -> bool:
        """Could `need` chunks be found for the lane by evicting idle conversations?"""
        idle = sum(self.pool.reserved[o.index] for o in self.scheduler.lanes
                   if o.request is None and o is not lane and o.tokens)
        return self.pool.free_chunks + self.pool.reserved[lane.index] + idle >= need


def saved(states: list[Checkpoint]) -> list[SavedState]:
    """Checkpoints as a session file's saved states."""
    return [(c.position, flat_state(c.on_host())) for c in states]


class SessionFilesDisabled(StrataError):
    """Session files are off: the server answers 501 with this message."""

    def __init__(self) -> None:
        super().__init__("session files are disabled; start the server with --session-dir DIR "
                         "to save and restore conversations")
