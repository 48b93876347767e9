"""The engine's AttentionContext on a CUDA pool: Triton kernels over the chunk tables.

Same constructor and `attend` as `TableAttention` (the torch reference and
the oracle in tests), so the runner picks one or the other by the pool's
device (`context_class`). Everything a step's kernels need besides the pool
(rows, sessions, lengths, write cells) is computed once per step on the host
and copied to the device in one transfer; the chunk tables themselves are
read by the kernels from the pool's fixed device copy.
"""

from __future__ import annotations

import functools
import weakref

import torch

from strata.attention.reference import SeqSpec, TableAttention
from strata.kv.formats import K8V4Format, PlainFormat
from strata.kv.pool import KvPool

try:  # the CPU path must not need Triton
    from strata.kernels.triton.decode import DecodeBatch, decode_attention
    from strata.attention.layout import Half, halves, supported
    from strata.kernels.triton.prefill import PrefillBatch, prefill_attention, query_blocks
    from strata.kernels.triton.write import write_plain, write_quantized

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the installation
    HAVE_TRITON = False

# Per pool, per layer: the (K, V) kernel views of its storage, made once.
_HALVES: weakref.WeakKeyDictionary[KvPool, list[tuple[Half, Half]]] = weakref.WeakKeyDictionary()


INTERPRETED_SMS = 132  # a CPU pool runs the kernels under TRITON_INTERPRET=1 (tests): plan as on an H200


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETED_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _layer_halves(pool: KvPool, layer: int) -> tuple[Half, Half]:
    views = _HALVES.get(pool)
    if views is None:
        views = [halves(pool.fmt, st) for st in pool.layers]
        _HALVES[pool] = views
    return views[layer]


def context_class(pool: KvPool) -> type:
    """GpuTableAttention for a CUDA pool in a format the kernels read; else the torch reference."""
    if pool.device.type == "cuda" and HAVE_TRITON and supported(pool.fmt):
        return GpuTableAttention
    return TableAttention


class GpuTableAttention:
    """The AttentionContext of one engine step over a pool on a CUDA device."""

    def __init__(
        self, pool: KvPool, seqs: list[SeqSpec], num_heads: int, scale: float, dtype: torch.dtype
    ) -> None:
        self._setup(pool, num_heads, scale, dtype)
        ns = torch.tensor([s.n for s in seqs], dtype=torch.int64)
        starts = torch.tensor([s.start for s in seqs], dtype=torch.int64)
        sessions = torch.tensor([s.session for s in seqs], dtype=torch.int64)
        rows = torch.cumsum(ns, 0) - ns
        t = int(ns.sum()) if seqs else 0
        # write cells of every new token, through the host copy of the tables
        tok_sess = torch.repeat_interleave(sessions, ns)
        tok_pos = torch.arange(t, dtype=torch.int64) - torch.repeat_interleave(rows - starts, ns)
        chunk = pool.chunk_size
        write = pool.tables[tok_sess, tok_pos // chunk] * chunk + tok_pos % chunk
        dec = ns == 1
        pre = ~dec
        blk_seq, blk_m0 = query_blocks(ns[pre].tolist())
        parts = [
            write,
            rows[dec], sessions[dec], starts[dec] + 1,
            torch.tensor(blk_seq, dtype=torch.int64), torch.tensor(blk_m0, dtype=torch.int64),
            sessions[pre], starts[pre], ns[pre], rows[pre],
        ]
        packed = torch.cat(parts).to(pool.device)  # one host-to-device copy per step
        views = packed.split([p.numel() for p in parts])
        self.write_cells = views[0]
        self.decode = DecodeBatch(views[1], views[2], views[3],
                                  int(starts[dec].max()) + 1 if bool(dec.any()) else 0)
        self.prefill = PrefillBatch(*views[4:])

    def _setup(self, pool: KvPool, num_heads: int, scale: float, dtype: torch.dtype) -> None:
        self.pool = pool
        self.fmt = pool.fmt
        self.scale = scale
        self.dtype = dtype
        self.num_heads = num_heads
        self.plain = isinstance(pool.fmt, PlainFormat)
        self.rotate_v = isinstance(pool.fmt, K8V4Format) and pool.fmt.rotate
        self.sms = _sms(pool.device)

    @classmethod
    def for_graph(cls, pool: KvPool, meta: torch.Tensor, num_heads: int, scale: float,
                  dtype: torch.dtype) -> GpuTableAttention:
        """A decode-only context reading its metadata from fixed device rows, for CUDA graphs.

        `meta` [4, lanes] int64 holds query rows, sessions, lengths (start + 1)
        and write cells; the caller refills it before each replay. The context
        splits are planned for the pool's longest context, so one capture
        serves every length (each lane spreads its own length over the splits).
        """
        self = cls.__new__(cls)
        self._setup(pool, num_heads, scale, dtype)
        self.write_cells = meta[3]
        self.decode = DecodeBatch(meta[0], meta[1], meta[2], pool.max_chunks * pool.chunk_size)
        empty = meta.new_empty(0)
        self.prefill = PrefillBatch(empty, empty, empty, empty, empty, empty)
        return self

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v [T, Hkv, D] at the step's cells; causal attention of q [T, Hq, D] -> [T, Hq, D]."""
        kh, vh = _layer_halves(self.pool, layer)
        if self.plain:
            write_plain(kh.data, vh.data, self.write_cells, k, v)
        else:
            write_quantized(kh, vh, self.write_cells, k, v, self.rotate_v)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        tables, chunk = self.pool.tables_device, self.pool.chunk_size
        decode_attention(q, out, self.decode, kh, vh, tables, chunk, self.scale, self.sms,
                         self.rotate_v)
        prefill_attention(q, out, self.prefill, kh, vh, tables, chunk, self.scale, self.rotate_v)
        return out  # k8v4: the kernels rotate the output back (`fmt.finish_output`) themselves
