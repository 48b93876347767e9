"""Gated DeltaNet on CUDA through flash-linear-attention's Triton kernels (`fla-core`, module `fla`).

The torch code in `deltanet.py` loops in Python over a prompt's 64-token
blocks and over the step's sequences; on a GPU that is launch-bound. FLA
reads all of a step's sequences in one launch per kernel, as varlen rows
(`cu_seqlens`), each starting from its own state. Strata's layouts map
onto FLA's directly:

- the step's row spans are FLA's `cu_seqlens` (one batch row, sequences end to end);
- the delta rule's state [N, Hv, Dk, Dv] float32 is FLA's default K-first
  `initial_state` / final state, so a lane's slot loads and saves as is;
- value head j reads key head j // (Hv / Hk) in both (FLA's grouped values);
- the convolution's tail [N, C, K-1] is FLA's conv state [N, C, K] without
  its oldest column, which FLA's forward never reads.

Which kernel a row takes depends only on its own span, never on its
company: one-row spans (decode) take the fused recurrent kernel, longer
spans the chunked one, as the torch path splits them. FLA computes a
sequence's rows in blocks aligned to its own start, so a lane's result
does not depend on the other sequences of the step.

The torch path stays the reference (tests/gpu/test_gpu_deltanet.py), the
CPU's path and float32's (FLA's float32 products are TF32). `backend_for`
picks: FLA where the tensors are bf16 or fp16 on CUDA and `fla` imports
(`pip install strata[gpu]`, which `./run` does on NVIDIA machines), the
torch code otherwise; it logs its choice once.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from strata.uploads import upload

log = logging.getLogger(__name__)
CONV_CHUNK = 64  # rows a program of FLA's causal_conv1d takes (its default chunk_size)
RULE_CHUNK = 64  # rows of a block of FLA's chunked delta rule (passed as its chunk_size)


@dataclass(frozen=True)
class FlaKernels:
    """The three FLA entry points the layer uses (imported only on CUDA)."""

    version: str
    conv: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    chunk: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    recurrent: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@functools.cache
def fla_kernels() -> FlaKernels | None:
    """FLA's kernels, or None where it does not import (logged once, with the reason)."""
    try:
        import fla
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except Exception as e:  # a missing package, or triton failing to load: the torch path still works
        log.warning("gated DeltaNet on CUDA: flash-linear-attention does not import (%s: %s); the "
                    "layers run the torch reference, slowly (pip install 'strata[gpu]')",
                    type(e).__name__, e)
        return None
    return FlaKernels(getattr(fla, "__version__", "?"), causal_conv1d, chunk_gated_delta_rule,
                      fused_recurrent_gated_delta_rule)


FLA_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _announce(path: str, device_type: str, dtype: torch.dtype) -> None:
    """One log line per path, device type and dtype: which code runs the DeltaNet layers."""
    if path == "fla":
        kernels = fla_kernels()
        log.info("gated DeltaNet on %s in %s: flash-linear-attention %s Triton kernels (conv1d, "
                 "chunked and fused recurrent delta rule)", device_type, dtype,
                 kernels.version if kernels else "?")
    else:
        why = " (FLA's products would run in TF32)" if device_type == "cuda" and dtype == torch.float32 else ""
        log.info("gated DeltaNet on %s in %s: the torch reference (deltanet.py)%s", device_type, dtype, why)


def backend_for(device: torch.device, dtype: torch.dtype) -> str:
    """'fla' where the layer's tensors are bf16 or fp16 on CUDA and `fla` imports, else 'torch'.

    float32 keeps the torch path on CUDA too: FLA's chunked kernels take Triton's TF32 dots
    for float32 inputs, and float32 is where the GPU is held to the CPU's greedy tokens
    (docs/GPU.md, tests/gpu/test_gpu_hybrid.py). The CPU never imports `fla`.
    """
    usable = device.type == "cuda" and dtype in FLA_DTYPES
    path = "fla" if usable and fla_kernels() is not None else "torch"
    _announce(path, device.type, dtype)
    return path


@dataclass(frozen=True)
class VarlenLayout:
    """A step's spans as FLA's varlen batches: the one-row spans (decode) and the longer ones.

    `single` / `multi`: the sequences of each kind; `single_rows`: their rows; `multi_rows`: the
    longer spans' rows end to end, None where that is all rows in order (no gather needed);
    `cu_all`, `cu_multi`: cumulative row counts of every span / of the longer ones (int64, on
    the device, with CPU copies for FLA's host-side chunk counts); `conv_chunks`: the
    convolution's (sequence, block) pairs over blocks of `CONV_CHUNK` rows, which FLA would
    otherwise build and keep in a cache of its own that forgets them (a captured graph would
    then read freed memory); `multi_chunks`: the same for the longer spans over blocks of
    `RULE_CHUNK` rows, given to the chunked delta rule (FLA would build them at each call and
    copy them to the device with a wait for the stream).
    """

    num_rows: int
    single: torch.Tensor | None
    single_rows: torch.Tensor | None
    multi: torch.Tensor | None
    multi_rows: torch.Tensor | None
    cu_all: torch.Tensor
    cu_all_cpu: torch.Tensor
    cu_multi: torch.Tensor | None
    cu_multi_cpu: torch.Tensor | None
    conv_chunks: torch.Tensor
    multi_chunks: torch.Tensor | None


def varlen_layout(spans: tuple[tuple[int, int], ...], device: torch.device) -> VarlenLayout:
    """The layout of one step (cached: every DeltaNet layer of the step asks for the same).

    A decode step's layout (one row a sequence, at most one per lane count) is kept for the
    process: a captured CUDA graph (engine/graphs.py) reads its tensors at every replay, so
    they must never be freed and their memory reused.
    """
    if all(span == (i, 1) for i, span in enumerate(spans)):
        return _decode_layout(len(spans), device)
    return _layout(spans, device)


@functools.cache
def _decode_layout(rows: int, device: torch.device) -> VarlenLayout:
    return _layout(tuple((i, 1) for i in range(rows)), device)


@functools.lru_cache(maxsize=16)
def _layout(spans: tuple[tuple[int, int], ...], device: torch.device) -> VarlenLayout:
    return build_layout(spans, device)


def build_layout(spans: tuple[tuple[int, int], ...], device: torch.device) -> VarlenLayout:
    """`varlen_layout` made anew, uncached: a captured prompt step's own (`kv/state.py: PadRows`)."""
    num_rows = 0
    for start, n in spans:
        if start != num_rows or n < 1:
            raise ValueError(f"spans must cover the step's rows in order, got {list(spans)}")
        num_rows += n

    lengths = torch.tensor([n for _, n in spans], dtype=torch.int64)
    cu_all_cpu = F.pad(lengths.cumsum(0), (1, 0))
    single = [i for i, (_, n) in enumerate(spans) if n == 1]
    multi = [i for i, (_, n) in enumerate(spans) if n > 1]
    single_t = single_rows = multi_t = multi_rows = cu_multi = cu_multi_cpu = multi_chunks = None
    if single:
        single_t = upload(single, device)
        single_rows = upload([spans[i][0] for i in single], device)
    if multi:
        multi_t = upload(multi, device)
        if single:
            multi_rows = upload([r for i in multi for r in range(spans[i][0], spans[i][0] + spans[i][1])], device)
        cu_multi_cpu = F.pad(lengths[multi].cumsum(0), (1, 0))
        cu_multi = cu_multi_cpu.to(device, non_blocking=True)
        multi_chunks = upload(_block_pairs([spans[i][1] for i in multi], RULE_CHUNK), device).view(-1, 2)
    chunks = upload(_block_pairs([n for _, n in spans], CONV_CHUNK), device).view(-1, 2)
    return VarlenLayout(num_rows, single_t, single_rows, multi_t, multi_rows,
                        cu_all_cpu.to(device, non_blocking=True), cu_all_cpu, cu_multi, cu_multi_cpu, chunks,
                        multi_chunks)


def _block_pairs(lengths: list[int], block: int) -> list[int]:
    """(sequence, block) for every block of `block` rows of each sequence, flat: FLA's
    chunk_indices once viewed as pairs."""
    return [v for i, n in enumerate(lengths) for c in range(-(-n // block)) for v in (i, c)]


def fla_conv(kernels: FlaKernels, mixed: torch.Tensor, weight: torch.Tensor, tails: torch.Tensor,
             layout: VarlenLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """`deltanet.causal_conv1d` for every span in one launch.

    mixed [T, C]; weight [C, K]; tails [N, C, K-1] float32. Returns (silu(conv) [T, C] in
    mixed's dtype, the new tails [N, C, K-1] float32).
    """
    initial = F.pad(tails, (1, 0)).to(mixed.dtype)  # FLA's column 0 (K inputs back) is never read
    out, final = kernels.conv(mixed[None], weight.to(mixed.dtype), initial_state=initial,
                              output_final_state=True, activation="silu", backend="triton",
                              cu_seqlens=layout.cu_all, cu_seqlens_cpu=layout.cu_all_cpu,
                              chunk_indices=layout.conv_chunks)
    return out[0], final[..., 1:].float()


def fla_delta_rule(kernels: FlaKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor, layout: VarlenLayout
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule of every span: q, k [T, Hk, Dk] (not normalized); v [T, Hv, Dv]; g (log
    decay), beta [T, Hv]; state [N, Hv, Dk, Dv] float32, one per span.

    Returns (out [T, Hv, Dv] in v's dtype, final states [N, Hv, Dk, Dv] float32). q and k are
    made unit length in the kernels and q scaled by Dk^-1/2, as `deltanet._prepare` does.
    """
    out = torch.empty_like(v)
    final = torch.empty_like(state)
    if layout.single is not None:  # decode: each sequence one token, a batch of length-1 rows
        rows, seqs = layout.single_rows, layout.single
        o, s = kernels.recurrent(q[rows, None], k[rows, None], v[rows, None], g=g[rows, None],
                                 beta=beta[rows, None], initial_state=state[seqs],
                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
        out[rows] = o[:, 0]
        final[seqs] = s
    if layout.multi is not None:  # prompts: varlen chunks, one batch row
        seqs = layout.multi
        rows = layout.multi_rows
        pick = (lambda x: x[None]) if rows is None else (lambda x: x[rows][None])
        o, s = kernels.chunk(pick(q), pick(k), pick(v), pick(g), pick(beta),
                             initial_state=state[seqs], output_final_state=True,
                             use_qk_l2norm_in_kernel=True, cu_seqlens=layout.cu_multi,
                             cu_seqlens_cpu=layout.cu_multi_cpu, chunk_indices=layout.multi_chunks,
                             chunk_size=RULE_CHUNK)
        if rows is None:
            out = o[0]
        else:
            out[rows] = o[0]
        final[seqs] = s
    return out, final
