"""The cells one engine step reads and writes: the scheduler-to-attention contract.

A step is a list of `SeqSpec`s, each a run of new tokens at positions
[start, start + n) of one lane. Position p of a lane lives in cell
`tables[lane, p // chunk] * chunk + p % chunk` (kv/pool.py); `cells_at` is
the one place that formula is written on the host, for torch tensors and
numpy arrays alike (the kernels read the device copy of the same tables,
`kernels/triton/cells.py: cells_of`). `step_cells` gives every backend and
the graph runner what they need of a step in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

if TYPE_CHECKING:
    from strata.kv.pool import KvPool

Index = TypeVar("Index", torch.Tensor, np.ndarray)


@dataclass(frozen=True)
class SeqSpec:
    lane: int
    start: int  # position of the first new token
    n: int  # new tokens
    prompt: bool = False  # a piece of a prompt: read as prompt rows even when one token long, so
    # a prompt token's attention does not depend on where the step cut the prompt (or on a reused
    # prefix leaving only its last token to read)
    drafted: bool = False  # a decoding lane's token and its drafts: every token a decode row, as
    # each would be decoded alone (a verified run rounds as the tokens decoded one at a time)
    cuts: tuple[int, ...] = ()  # a prompt piece's rows after which a recurrent model keeps its
    # state for a checkpoint (0 < c < n, ascending): cut points inside the step, not at its end

    @property
    def end(self) -> int:
        return self.start + self.n

    @property
    def decoding(self) -> bool:
        """One new token that the lane generated (or drafted): a decode row."""
        return self.n == 1 and not self.prompt


def decode_step(seqs: list[SeqSpec]) -> bool:
    """Every sequence a decode row (what the decode graphs and a stage's decode path compute)."""
    return bool(seqs) and all(s.decoding for s in seqs)


def cells_at(tables: Index, chunk: int, lanes: Index, positions: Index) -> Index:
    """Cells of `positions` of `lanes` (broadcast against each other) through the chunk tables.

    Positions past a lane's table width read its last entry (then the trash
    chunk, for a lane that does not reach that far): reads of padding stay
    inside the pool.
    """
    col = (positions // chunk).clip(max=tables.shape[1] - 1)
    return tables[lanes, col] * chunk + positions % chunk


@dataclass(frozen=True)
class StepCells:
    """Per sequence of a step (host, int64), and the cells of its new tokens."""

    lanes: torch.Tensor  # [S]
    starts: torch.Tensor  # [S] position of the first new token
    ns: torch.Tensor  # [S] new tokens
    rows: torch.Tensor  # [S] first row of each sequence in the step's flattened tokens
    write: torch.Tensor  # [T] cell of every new token, in row order
    positions: torch.Tensor  # [T] position of every new token, in row order
    token_seq: torch.Tensor  # [T] the sequence each new token belongs to
    prompt: torch.Tensor  # [S] bool: prompt pieces (`SeqSpec.prompt`)
    drafted: torch.Tensor  # [S] bool: drafted runs (`SeqSpec.drafted`)

    @property
    def ends(self) -> torch.Tensor:
        return self.starts + self.ns

    @property
    def decode(self) -> torch.Tensor:
        """[S] bool: sequences read as decode rows, one query a token (one new token that is not
        a prompt piece, or a drafted run); the others are read as prompt rows."""
        return ((self.ns == 1) & ~self.prompt) | self.drafted


def step_cells(pool: KvPool, seqs: list[SeqSpec]) -> StepCells:
    """The step's sequences as tensors, and the cells its new tokens go to.

    Computed in numpy on the tables' memory (`Tensor.numpy` shares it) and handed out as torch
    tensors over the same arrays: a step's few sequences are a dozen tiny operations, each
    several times cheaper in numpy than in torch (about 60 us a decode step in torch).
    """
    ns = np.fromiter((s.n for s in seqs), dtype=np.int64, count=len(seqs))
    starts = np.fromiter((s.start for s in seqs), dtype=np.int64, count=len(seqs))
    lanes = np.fromiter((s.lane for s in seqs), dtype=np.int64, count=len(seqs))
    rows = np.cumsum(ns) - ns
    token_seq = np.repeat(np.arange(len(seqs), dtype=np.int64), ns)
    positions = np.arange(int(ns.sum()), dtype=np.int64) - np.repeat(rows - starts, ns)
    write = cells_at(pool.tables.numpy(), pool.chunk_size, lanes[token_seq], positions)
    prompt = np.fromiter((s.prompt for s in seqs), dtype=np.bool_, count=len(seqs))
    drafted = np.fromiter((s.drafted for s in seqs), dtype=np.bool_, count=len(seqs))
    t = torch.from_numpy
    return StepCells(t(lanes), t(starts), t(ns), t(rows), t(write), t(positions), t(token_seq), t(prompt),
                     t(drafted))


def decode_rows(cells: StepCells, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode query per token of the decode sequences (a drafted run's n tokens are n
    queries, each over the cells up to its own position, as the decode graphs read them):
    their rows, table keys (`keys` [S]: per sequence) and lengths."""
    rows = torch.nonzero(cells.decode[cells.token_seq]).view(-1)
    return rows, keys[cells.token_seq[rows]], cells.positions[rows] + 1


def key_cells(pool: KvPool, lanes: torch.Tensor, length: int) -> torch.Tensor:
    """[S, length] cells of positions [0, length) of each lane (host, int64)."""
    pos = np.arange(length, dtype=np.int64)
    return torch.from_numpy(cells_at(pool.tables.numpy(), pool.chunk_size, lanes.numpy()[:, None], pos[None, :]))


def sampled_rows(seqs: list[SeqSpec], sample: list[int]) -> list[int]:
    """The flattened rows whose logits a step computes, in order: the last `sample[i]` rows of
    sequence i (1 (or True) for its last token, n for every row of a verified draft, 0 for none)."""
    rows, end = [], 0
    for s, wanted in zip(seqs, sample):
        end += s.n
        rows.extend(range(end - int(wanted), end))
    return rows


def step_positions(seqs: list[SeqSpec]) -> torch.Tensor:
    """Every new token's position (host, int64), in row order."""
    return torch.cat([torch.arange(s.start, s.end, dtype=torch.int64) for s in seqs])
