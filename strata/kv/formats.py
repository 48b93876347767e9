"""KV cell formats (`--kv`): the byte runs one cell of one layer is made of.

A format is a fixed list of runs (named arrays with a per-cell shape and a
dtype). The pool allocates one tensor per run with a leading cell dimension,
so moving a cell (streaming, parking, session files) means moving the same
index of every run, and `cell_bytes` is the one place a cell's size is known.
K/V are quantized when written and dequantized when read; the arithmetic
lives in `quant.py` (int8, Q4_0) and `hadamard.py` (k8v4's rotation).

Scales are float32: a float16 scale of amax / 127 underflows for small
activations and costs only 2 bytes less per head, and the k8v4 figure of the
seed (816 bytes for 4 KV heads of 128) fixes K scales at 4 bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from strata.kv.hadamard import check_power_of_two, hadamard_rotate
from strata.kv.quant import (
    Q4_0_BLOCK,
    Q4_0_BLOCK_BYTES,
    check_q4_0_dim,
    dequantize_int8,
    dequantize_q4_0,
    quantize_int8,
    quantize_q4_0,
)


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
    def write(
        self, storage: Storage, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store k, v [T, Hkv, D] at distinct cell indices `cells` [T] (int64)."""

    @abstractmethod
    def read(
        self, storage: Storage, cells: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized k, v [N, Hkv, D] in `dtype` for cell indices `cells` [N]."""

    def finish_output(self, out: torch.Tensor) -> torch.Tensor:
        """Undo any transform applied to V on write (k8v4's rotation) on the attention output."""
        return out


def _take(t: torch.Tensor, cells: "torch.Tensor | slice") -> torch.Tensor:
    """Cells of one run: a view for a slice of consecutive cells, a gather for an index tensor."""
    return t[cells] if isinstance(cells, slice) else t[cells.to(t.device)]


def _put(storage: Storage, name: str, cells: torch.Tensor, values: torch.Tensor) -> None:
    """Write `values` [T, ...] at `cells` of one run, on the run's device."""
    dest = storage[name]
    dest.index_copy_(0, cells.to(dest.device), values.to(dest.device))


class PlainFormat(KvFormat):
    """fp32 / fp16 / bf16: K and V stored as they are."""

    def __init__(self, n_kv_heads: int, head_dim: int, dtype: torch.dtype, name: str) -> None:
        super().__init__(n_kv_heads, head_dim)
        self.dtype = dtype
        self.name = name

    def runs(self) -> list[Run]:
        shape = (self.n_kv_heads, self.head_dim)
        return [Run("k", shape, self.dtype), Run("v", shape, self.dtype)]

    def write(
        self, storage: Storage, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        _put(storage, "k", cells, k.to(self.dtype))
        _put(storage, "v", cells, v.to(self.dtype))

    def read(
        self, storage: Storage, cells: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _take(storage["k"], cells).to(dtype), _take(storage["v"], cells).to(dtype)


class Int8Format(KvFormat):
    """int8: K and V as int8 codes, one float32 scale per cell and KV head."""

    name = "int8"

    def runs(self) -> list[Run]:
        h, d = self.n_kv_heads, self.head_dim
        return [
            Run("k_q", (h, d), torch.int8),
            Run("k_s", (h,), torch.float32),
            Run("v_q", (h, d), torch.int8),
            Run("v_s", (h,), torch.float32),
        ]

    def write(
        self, storage: Storage, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        k_q, k_s = quantize_int8(k)
        v_q, v_s = quantize_int8(v)
        _put(storage, "k_q", cells, k_q)
        _put(storage, "k_s", cells, k_s)
        _put(storage, "v_q", cells, v_q)
        _put(storage, "v_s", cells, v_s)

    def read(
        self, storage: Storage, cells: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = dequantize_int8(_take(storage["k_q"], cells), _take(storage["k_s"], cells), dtype)
        v = dequantize_int8(_take(storage["v_q"], cells), _take(storage["v_s"], cells), dtype)
        return k, v


class Q4_0Format(KvFormat):
    """q4_0: K and V as ggml Q4_0 blocks along the head dimension (18 bytes per 32 values)."""

    name = "q4_0"

    def __init__(self, n_kv_heads: int, head_dim: int) -> None:
        check_q4_0_dim(head_dim)
        super().__init__(n_kv_heads, head_dim)

    def runs(self) -> list[Run]:
        shape = (self.n_kv_heads, self.head_dim // Q4_0_BLOCK, Q4_0_BLOCK_BYTES)
        return [Run("k_q4", shape, torch.uint8), Run("v_q4", shape, torch.uint8)]

    def write(
        self, storage: Storage, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        _put(storage, "k_q4", cells, quantize_q4_0(k))
        _put(storage, "v_q4", cells, quantize_q4_0(v))

    def read(
        self, storage: Storage, cells: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = dequantize_q4_0(_take(storage["k_q4"], cells), dtype)
        v = dequantize_q4_0(_take(storage["v_q4"], cells), dtype)
        return k, v


class K8V4Format(KvFormat):
    """k8v4: int8 K and Q4_0 V after a normalized Hadamard rotation of the head dimension.

    K keeps 8 bits because attention scores amplify K error through the
    softmax; V tolerates 4 bits once the rotation has spread its outliers.
    `read` returns V still rotated: attention mixes V rows linearly, so
    `finish_output` rotates the output back once instead of every row.
    `rotate=False` is the same layout without the rotation, kept only to
    measure what the rotation earns (benchmarks.quality); it is no `--kv` value.
    """

    def __init__(self, n_kv_heads: int, head_dim: int, rotate: bool = True) -> None:
        check_q4_0_dim(head_dim)
        if rotate:
            check_power_of_two(head_dim)
        super().__init__(n_kv_heads, head_dim)
        self.rotate = rotate
        self.name = "k8v4" if rotate else "k8v4_norot"

    def runs(self) -> list[Run]:
        h, d = self.n_kv_heads, self.head_dim
        return [
            Run("k_q", (h, d), torch.int8),
            Run("k_s", (h,), torch.float32),
            Run("v_q4", (h, d // Q4_0_BLOCK, Q4_0_BLOCK_BYTES), torch.uint8),
        ]

    def write(
        self, storage: Storage, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        k_q, k_s = quantize_int8(k)
        _put(storage, "k_q", cells, k_q)
        _put(storage, "k_s", cells, k_s)
        _put(storage, "v_q4", cells, quantize_q4_0(hadamard_rotate(v) if self.rotate else v))

    def read(
        self, storage: Storage, cells: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = dequantize_int8(_take(storage["k_q"], cells), _take(storage["k_s"], cells), dtype)
        return k, dequantize_q4_0(_take(storage["v_q4"], cells), dtype)

    def finish_output(self, out: torch.Tensor) -> torch.Tensor:
        """Rotate the attention output [..., D] back (the rotation is its own inverse)."""
        return hadamard_rotate(out).to(out.dtype) if self.rotate else out


FORMAT_NAMES = ("fp32", "fp16", "bf16", "int8", "q4_0", "k8v4")


def make_format(name: str, n_kv_heads: int, head_dim: int) -> KvFormat:
    """The format for a `--kv` value.

    ValueError for an unknown name or a head_dim the format cannot hold.
    """
    if name == "fp32":  # exact storage for float32 runs (oracle tests)
        return PlainFormat(n_kv_heads, head_dim, torch.float32, "fp32")
    if name == "fp16":
        return PlainFormat(n_kv_heads, head_dim, torch.float16, "fp16")
    if name == "bf16":
        return PlainFormat(n_kv_heads, head_dim, torch.bfloat16, "bf16")
    if name == "int8":
        return Int8Format(n_kv_heads, head_dim)
    if name == "q4_0":
        return Q4_0Format(n_kv_heads, head_dim)
    if name == "k8v4":
        return K8V4Format(n_kv_heads, head_dim)
    raise ValueError(f"unknown --kv format {name!r}; choose one of {', '.join(FORMAT_NAMES)}")


def kv_block_bytes(fmt: KvFormat, n_cells: int) -> int:
    """Bytes of `n_cells` cells of one layer: what every path that moves cells sizes by."""
    return fmt.cell_bytes() * n_cells
