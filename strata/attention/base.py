"""The contract between the model, the engine's runner and an attention backend.

A backend is a class whose instances are one step's `AttentionContext`:
the runner builds one per forward, `Backend(pool, seqs, scale)`, from the
pool the step reads and writes and the step's sequences (`kv/step.py`);
each attention layer of the model then calls `ctx.attend(layer, q, k, v)`
with q/k after RoPE. Everything a backend needs of the step it computes in
its constructor, once, not per layer. Model code never holds K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec

# what a backend without sliding-window attention says when a layer asks for it
WINDOW_UNSUPPORTED = ("sliding-window attention (gemma3's local layers) runs on the CPU backend only; "
                      "the Triton kernels do not take a window yet")


class AttentionContext(Protocol):
    """One forward step's view of the KV cache, built by the engine's runner.

    The step's tokens are flattened to T rows (several sequences, each a run of
    consecutive positions). `attend` stores k/v for those rows and returns, for
    each row, causal attention over its sequence's cached cells plus the new
    ones up to and including itself.
    """

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D].

        window: a sliding-window layer's row at position p sees only the keys at positions
        > p - window (Hugging Face's convention); None: all keys up to p.
        """
        ...


@dataclass(frozen=True)
class InPlaceCells:
    """What one C++ call needs to do a layer's attention itself (`TableAttention.cells_in_place`): the
    layer's plain K and V cells [cells, Hkv, D] of the pool, read and written where they are, the
    step's write cells, each sequence's cells [S, positions], each row's sequence and position,
    and the softmax scale. A context offers it where its own `attend` is exactly "write the new
    K/V at write_cells, then the C++ kernel over cells", so a caller that does the same gets the
    same bits (`models/layers.py: DecoderLayer._forward_blocks_cpu`)."""

    k: torch.Tensor
    v: torch.Tensor
    write_cells: torch.Tensor
    cells: torch.Tensor
    row_seq: torch.Tensor
    row_pos: torch.Tensor
    scale: float


class AttentionBackend(Protocol):
    """What `select.backend_for` returns: a constructor of one step's context."""

    def __call__(self, pool: KvPool, seqs: list[SeqSpec], scale: float) -> AttentionContext:
        ...
