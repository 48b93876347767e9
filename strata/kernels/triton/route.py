"""A MoE router's softmax, top k and renormalisation in one launch (`models/moe.route` on CUDA).

In torch the routing of a step is five or six launches a layer (softmax in
float32, top-k, the sum and the division of the renormalisation, the cast);
a one-lane decode step of a 48-layer MoE model spends more time launching
them than computing. Here one program per token does it all, as `route`
does it: the softmax in float32 (CUDA's expf, the max subtracted first),
the k largest probabilities in descending order (the lower expert first
among equals), optionally divided by their sum, then rounded to the dtype.
A token's result depends on its own row only; the sums run in another
order than torch's, so a weight can differ from torch's in its last float32
bit (tests/gpu/test_moe_kernels.py bounds it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.triton.gemv import DTYPES, INTERPRET
from strata.kernels.triton.numerics import exp

MAX_EXPERTS = 1024  # a row of logits is one tile


@triton.jit
def _route_kernel(logits, ids, weights, E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                  KP: tl.constexpr, NORMALISE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    x = tl.load(logits + t * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.where(e < E, exp(x - tl.max(x, 0)), 0.0)
    prob = tl.math.div_rn(p, tl.sum(p, 0))
    prob = tl.where(e < E, prob, -1.0)
    j = tl.arange(0, KP)
    chosen = tl.zeros([KP], tl.int64)
    top = tl.zeros([KP], tl.float32)
    for r in tl.static_range(K):
        best = tl.max(prob, 0)
        at = tl.min(tl.where(prob == best, e, EP), 0)
        chosen = tl.where(j == r, at, chosen)
        top = tl.where(j == r, best, top)
        prob = tl.where(e == at, -1.0, prob)
    if NORMALISE:
        total = tl.sum(tl.where(j == 0, top, 0.0), 0)
        for r in tl.static_range(1, K):  # in rank order, as a sequential sum
            total += tl.sum(tl.where(j == r, top, 0.0), 0)
        top = tl.math.div_rn(top, total)
    tl.store(ids + t * K + j, chosen, mask=j < K)
    tl.store(weights + t * K + j, top.to(weights.dtype.element_ty), mask=j < K)


def takes(logits: torch.Tensor, k: int) -> bool:
    """Whether `route` takes these router logits [T, E]: CUDA (or the CPU under the interpreter),
    a dtype of DTYPES, contiguous, 1 <= k <= E <= MAX_EXPERTS."""
    return ((logits.is_cuda or (INTERPRET and logits.device.type == "cpu")) and logits.dim() == 2
            and logits.dtype in DTYPES and logits.is_contiguous() and 1 <= k <= logits.shape[1] <= MAX_EXPERTS)


def route(logits: torch.Tensor, k: int, normalise: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (expert ids [T, k] int64, weights [T, k] in `dtype`), as
    `models/moe.route` (checked by `takes`)."""
    if not takes(logits, k):
        raise ValueError(f"route: logits {tuple(logits.shape)} {logits.dtype} on {logits.device}, k = {k}")
    t, e = logits.shape
    ids = torch.empty((t, k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((t, k), dtype=dtype, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, ids, weights, E=e, EP=triton.next_power_of_2(e), K=k,
                            KP=triton.next_power_of_2(max(k, 2)), NORMALISE=normalise, num_warps=4)
    return ids, weights
