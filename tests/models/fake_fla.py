"""flash-linear-attention's three entry points as the torch reference computes them, sequence by
sequence, with FLA's signatures: on the CPU the FLA glue of `deltanet.py` and `deltanet_fla.py`
(varlen layouts, block lists, tails, cut rounds) then runs and is held to the torch path bit for bit.

Each call also checks what FLA would otherwise compute itself: the (sequence, block) lists given
as `chunk_indices` must be the ones FLA's `prepare_chunk_indices` builds from `cu_seqlens`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.models.deltanet import causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_rule
from strata.models.deltanet_fla import FlaKernels


def _bounds(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None) -> list[int]:
    bounds = cu_seqlens.tolist()
    assert cu_seqlens_cpu is None or cu_seqlens_cpu.tolist() == bounds
    return bounds


def _check_blocks(bounds: list[int], chunk_indices: torch.Tensor | None, block: int) -> None:
    """FLA's own list: (sequence, block) for each block of `block` rows of each sequence."""
    want = [[i, c] for i in range(len(bounds) - 1) for c in range(-(-(bounds[i + 1] - bounds[i]) // block))]
    assert chunk_indices is not None and chunk_indices.tolist() == want, (chunk_indices, want)


def conv(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor, output_final_state: bool,
         activation: str, backend: str, cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None = None,
         chunk_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's causal_conv1d: x [1, T, C], weight [C, K], initial_state [N, C, K] (column 0 unread)."""
    assert activation == "silu" and output_final_state
    bounds = _bounds(cu_seqlens, cu_seqlens_cpu)
    _check_blocks(bounds, chunk_indices, 64)
    outs, finals = [], []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        o, tail = causal_conv1d(x[:, lo:hi], weight, initial_state[i : i + 1, :, 1:].float())
        outs.append(o)
        finals.append(F.pad(tail, (1, 0)).to(x.dtype))
    return torch.cat(outs, dim=1), torch.cat(finals)


def chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          initial_state: torch.Tensor, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
          cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None = None,
          chunk_indices: torch.Tensor | None = None, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's chunk_gated_delta_rule over varlen rows [1, T, ...], one state per sequence."""
    assert output_final_state and use_qk_l2norm_in_kernel
    bounds = _bounds(cu_seqlens, cu_seqlens_cpu)
    _check_blocks(bounds, chunk_indices, chunk_size)
    outs, finals = [], []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        o, s = chunk_gated_delta_rule(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi],
                                      initial_state[i : i + 1])
        outs.append(o)
        finals.append(s)
    return torch.cat(outs, dim=1), torch.cat(finals)


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial_state: torch.Tensor, output_final_state: bool,
              use_qk_l2norm_in_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's fused_recurrent_gated_delta_rule over a batch of one-row sequences [B, 1, ...]."""
    assert output_final_state and use_qk_l2norm_in_kernel
    return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state)


KERNELS = FlaKernels("torch stand-in", conv, chunk, recurrent)
