"""Per-lane recurrent state beside the KV pool: what a recurrent layer carries between steps.

A recurrent layer (a gated DeltaNet's matrix state and its short
convolution's tail) has a fixed-size state per lane instead of K/V cells
that grow with the context. The model declares each such layer's state
shapes (`state_shapes`), the engine keeps one float32 slot per lane and
layer (`StatePool`), and every step hands the layers a `StateContext`:
the step's sequences as row spans, each sequence's state before its rows
(zeros for one that starts at position 0) and a place to put the state
after them.

The state of a lane always belongs to exactly the lane's tokens: unlike a
prefix of K/V it cannot be cut back, which is why prefix reuse of such a
model resumes only from the lane's full length or from a checkpoint.
"""

from __future__ import annotations

from typing import Protocol

import torch

StateShapes = dict[str, tuple[int, ...]]  # state name -> per-lane shape


class StateContext(Protocol):
    """One step's view of the recurrent state of its sequences.

    The step's T rows are its sequences' new tokens, flattened in order;
    `spans[i]` is sequence i's (first row, number of rows).
    """

    spans: list[tuple[int, int]]

    def load(self, layer: int) -> dict[str, torch.Tensor]:
        """name -> [S, *shape] float32: each sequence's state before its rows (zeros where it
        starts at position 0)."""
        ...

    def save(self, layer: int, state: dict[str, torch.Tensor]) -> None:
        """name -> [S, *shape]: each sequence's state after its last row."""
        ...
