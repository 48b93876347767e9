"""The engine's AttentionContext on a CUDA pool: Triton kernels over the chunk tables.

Same constructor and `attend` as `TableAttention` (the torch reference and
the oracle in tests; `attention/base.py` has the contract, `select.py` the
rule that picks). Everything a step's kernels need besides the pool (rows,
lanes, lengths, write cells) is computed once per step on the host
(`kv/step.py`) and copied to the device in one transfer; the chunk tables
themselves are read by the kernels from the pool's fixed device copy.
"""

from __future__ import annotations

import weakref

import torch

from strata.attention.base import WINDOW_UNSUPPORTED
from strata.attention.layout import halves
from strata.kernels.triton.decode import DecodeBatch, decode_attention
from strata.kernels.triton.half import Half
from strata.kernels.triton.prefill import PrefillBatch, prefill_attention, query_blocks
from strata.kernels.triton.write import write_plain, write_quantized
from strata.kv.formats import K8V4Format, PlainFormat
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec, StepCells, decode_rows, step_cells

# Per pool, per layer: the (K, V) kernel views of its storage, made once.
_HALVES: weakref.WeakKeyDictionary[KvPool, list[tuple[Half, Half]]] = weakref.WeakKeyDictionary()


def _layer_halves(pool: KvPool, layer: int) -> tuple[Half, Half]:
    views = _HALVES.get(pool)
    if views is None:
        views = [halves(pool.fmt, st) for st in pool.layers]
        _HALVES[pool] = views
    return views[pool.local(layer)]


def batch_parts(cells: StepCells, keys: torch.Tensor) -> list[torch.Tensor]:
    """The decode and prefill kernels' per-step metadata, to upload in one copy with the rest.

    `keys` [S]: the row of each sequence's chunk table (its lane in the pool's
    tables, or its row of a streamed step's translated tables).
    """
    dec = cells.decode
    pre = ~dec
    blk_seq, blk_m0 = query_blocks(cells.ns[pre].tolist())
    q_rows, sessions, lengths = decode_rows(cells, keys)
    return [
        q_rows, sessions, lengths,
        torch.tensor(blk_seq, dtype=torch.int64), torch.tensor(blk_m0, dtype=torch.int64),
        keys[pre], cells.starts[pre], cells.ns[pre], cells.rows[pre],
    ]


def batches(cells: StepCells, views: list[torch.Tensor]) -> tuple[DecodeBatch, PrefillBatch]:
    """The kernels' batches over the device views of `batch_parts`, in its order."""
    dec = cells.decode
    longest = int(cells.ends[dec].max()) if bool(dec.any()) else 0
    return DecodeBatch(views[0], views[1], views[2], longest), PrefillBatch(*views[3:9])


class GpuTableAttention:
    """The AttentionContext of one engine step over a pool on a CUDA device."""

    def __init__(self, pool: KvPool, seqs: list[SeqSpec], scale: float) -> None:
        self._setup(pool, scale)
        cells = step_cells(pool, seqs)
        parts = [cells.write, *batch_parts(cells, cells.lanes)]
        packed = torch.cat(parts).to(pool.device, non_blocking=True)  # one copy a step, no wait
        views = list(packed.split([p.numel() for p in parts]))
        self.write_cells = views[0]
        self.decode, self.prefill = batches(cells, views[1:])

    def _setup(self, pool: KvPool, scale: float) -> None:
        self.pool = pool
        self.fmt = pool.fmt
        self.scale = scale
        self.plain = isinstance(pool.fmt, PlainFormat)
        self.rotate_v = isinstance(pool.fmt, K8V4Format) and pool.fmt.rotate
        self.padded = False  # rows no kernel writes (a prompt graph's padding) must read as zeros

    @classmethod
    def for_graph(cls, pool: KvPool, meta: torch.Tensor, scale: float) -> GpuTableAttention:
        """A decode-only context reading its metadata from fixed device rows, for CUDA graphs.

        `meta` [4, lanes] int64 holds query rows, lanes, lengths (start + 1)
        and write cells; the caller refills it before each replay. The context
        splits are planned for the pool's longest context, so one capture
        serves every length (each lane spreads its own length over the splits).
        """
        self = cls.__new__(cls)
        self._setup(pool, scale)
        self.write_cells = meta[3]
        self.decode = DecodeBatch(meta[0], meta[1], meta[2], pool.max_chunks * pool.chunk_size)
        empty = meta.new_empty(0)
        self.prefill = PrefillBatch(empty, empty, empty, empty, empty, empty)
        return self

    @classmethod
    def for_prompt_graph(cls, pool: KvPool, write_cells: torch.Tensor, prefill: PrefillBatch,
                         scale: float) -> GpuTableAttention:
        """A context of one lane's prompt rows read from fixed device tensors, for a captured
        prompt step (engine/prompt_graphs.py): `write_cells` [B] (padding rows: the trash
        chunk's), `prefill` one sequence whose query blocks cover the B rows and whose `n` says
        how many are tokens; blocks past n read no keys and padding rows come out as zeros."""
        self = cls.__new__(cls)
        self._setup(pool, scale)
        self.write_cells = write_cells
        empty = write_cells.new_empty(0)
        self.decode = DecodeBatch(empty, empty, empty, 0)
        self.prefill = prefill
        self.padded = True
        return self

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        """Store k, v [T, Hkv, D] at the step's cells; causal attention of q [T, Hq, D] -> [T, Hq, D]."""
        if window is not None:
            raise NotImplementedError(WINDOW_UNSUPPORTED)
        kh, vh = _layer_halves(self.pool, layer)
        if self.plain:
            write_plain(kh.data, vh.data, self.write_cells, k, v)
        else:
            write_quantized(kh, vh, self.write_cells, k, v, self.rotate_v)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = (torch.zeros if self.padded else torch.empty)(q.shape, dtype=q.dtype, device=q.device)
        tables, chunk = self.pool.tables_device, self.pool.chunk_size
        decode_attention(q, out, self.decode, kh, vh, tables, chunk, self.scale, self.rotate_v)
        prefill_attention(q, out, self.prefill, kh, vh, tables, chunk, self.scale, self.rotate_v)
        return out  # k8v4: the kernels rotate the output back (`fmt.finish_output`) themselves
