"""KV cell formats (`--kv`): the byte runs one cell of one layer is made of.

A format is a fixed list of runs (named arrays with a per-cell shape and a
dtype). The pool allocates one tensor per run with a leading cell dimension,
so moving a cell (streaming, parking, session files) means moving the same
index of every run, and `cell_bytes` is the one place a cell's size is known.
K/V are quantized when written and dequantized when read.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Run:
    name: str
    shape: tuple[int, ...]  # per cell
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


Storage = dict[str, torch.Tensor]  # run name -> [num_cells, *run.shape]


class KvFormat(ABC):
    """One `--kv` choice. Stateless apart from constants (e.g. a rotation)."""

    name: str

    def __init__(self, n_kv_heads: int, head_dim: int) -> None:
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim

    @abstractmethod
    def runs(self) -> list[Run]:
        """The arrays one cell is made of, in a fixed order."""

    def cell_bytes(self) -> int:
        """Bytes of one cell in one layer, summed over the runs."""
        return sum(r.nbytes for r in self.runs())

    def allocate(self, num_cells: int, device: torch.device | str, pin: bool = False) -> Storage:
        out: Storage = {}
        for r in self.runs():
            t = torch.zeros((num_cells, *r.shape), dtype=r.dtype, device=device)
            out[r.name] = t.pin_memory() if pin else t
        return out

    @abstractmethod
    def write(self, storage: Storage, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at cell indices `cells` [T] (int64)."""

    @abstractmethod
    def read(
        self, storage: Storage, cells: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized k, v [N, Hkv, D] in `dtype` for cell indices `cells` [N]."""

    def finish_output(self, out: torch.Tensor) -> torch.Tensor:
        """Undo any transform applied to V on write (k8v4's rotation) on the attention output."""
        return out


class PlainFormat(KvFormat):
    """fp32 / fp16 / bf16: K and V stored as they are."""

    def __init__(self, n_kv_heads: int, head_dim: int, dtype: torch.dtype, name: str) -> None:
        super().__init__(n_kv_heads, head_dim)
        self.dtype = dtype
        self.name = name

    def runs(self) -> list[Run]:
        shape = (self.n_kv_heads, self.head_dim)
        return [Run("k", shape, self.dtype), Run("v", shape, self.dtype)]

    def write(self, storage: Storage, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        storage["k"].index_copy_(0, cells, k.to(self.dtype))
        storage["v"].index_copy_(0, cells, v.to(self.dtype))

    def read(
        self, storage: Storage, cells: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return storage["k"][cells].to(dtype), storage["v"][cells].to(dtype)


FORMAT_NAMES = ("fp32", "fp16", "bf16")


def make_format(name: str, n_kv_heads: int, head_dim: int) -> KvFormat:
    """The format for a `--kv` value."""
    if name == "fp32":  # exact storage for float32 runs (oracle tests)
        return PlainFormat(n_kv_heads, head_dim, torch.float32, "fp32")
    if name == "fp16":
        return PlainFormat(n_kv_heads, head_dim, torch.float16, "fp16")
    if name == "bf16":
        return PlainFormat(n_kv_heads, head_dim, torch.bfloat16, "bf16")
    raise ValueError(f"unknown --kv format {name!r}; choose one of {', '.join(FORMAT_NAMES)}")
