"""The sparse MLP of mixture-of-experts models: a router picks k of E SwiGLU experts per token.

Qwen3-MoE, Qwen2-MoE and Mixtral route the same way (a softmax over the router's
logits in float32, the top k, optionally renormalised to sum to 1, then
rounded to the compute dtype); Qwen2-MoE adds a shared expert that every
token takes, scaled by a sigmoid gate. The arithmetic follows Hugging Face's
so its models are an oracle (on CUDA the routing runs as one kernel whose
float32 sums may differ from torch's in a last bit): each expert's output is multiplied by its
weight in the compute dtype and the k products are summed in ascending
expert order, rounding after each add (its `index_add_` over experts in
turn). A token's result depends only on its own row, never on which other
tokens share the step: the batch invariance the dense layers keep.

Where the experts' weights live is the holder's business: `Experts` holds
all of them on the compute device as dense tensors (`block_experts.BlockExperts`
as the GGUF file's blocks), `experts.ExpertCache` keeps them in host RAM with
the hot ones in device slots; each holder's `ExpertMath` multiplies. The
products go to the fused Triton kernels (`kernels/triton/moe.py`) for CUDA
tensors they take, to one C++ call on the CPU (`kernels/cpu/csrc/experts.cpp`),
else to `combine_loop`, the reference both follow: a loop over the experts a
step uses, each product a matmul whose rows do not depend on how many rows
there are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from strata.models import ops
from strata.models.dense import MLP, Linear, stable_linear

try:  # the CPU machines and CI have no Triton
    from strata.kernels.triton import moe as triton_moe
    from strata.kernels.triton import route as triton_route
except ImportError:
    triton_moe = triton_route = None  # type: ignore[assignment]

Product = Callable[[int, torch.Tensor], torch.Tensor]  # (expert, rows [n, H]) -> SwiGLU rows [n, H]


class ExpertMath(Protocol):
    """How a holder's experts are multiplied, given the tensors to read (its own, or a cache's
    slots): `DenseMath` here, `block_experts.BlockMath`."""

    def config(self, tensors: Sequence[torch.Tensor], tokens: int, k: int, dtype: torch.dtype) -> object: ...

    def pairs(self, rows: torch.Tensor, tensors: Sequence[torch.Tensor], slots: torch.Tensor,
              config: object) -> torch.Tensor: ...

    def all(self, x: torch.Tensor, tensors: Sequence[torch.Tensor], ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor: ...

    def combine(self, y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...

    def maps(self, x: torch.Tensor, slots: Sequence[torch.Tensor]) -> bool: ...

    def mapped(self, x: torch.Tensor, slots: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor],
               table: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, config: object) -> torch.Tensor: ...


def route(logits: torch.Tensor, k: int, normalise: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (expert ids [T, k] int64, weights [T, k] in `dtype`); on CUDA in
    one launch (`kernels/triton/route.py`: the same steps, its float32 sums in its own order)."""
    if triton_route is not None and logits.is_cuda and triton_route.takes(logits, k):
        return triton_route.route(logits, k, normalise, dtype)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(dtype)


def combine_loop(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, product: Product) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), one expert at a time in ascending order.

    The tokens of an expert are gathered and multiplied together; each token has at most one
    slot per expert, so the adds into a row never collide and their order is the experts'.
    """
    out = torch.zeros_like(x)
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist(), strict=True):
        pairs = order[start : start + n]
        start += n
        tokens = pairs // k
        y = product(e, x.index_select(0, tokens))
        out.index_add_(0, tokens, y * weights.reshape(-1)[pairs, None])
    return out


def combine_ordered(y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The k expert outputs of each token, y [T * k, H], summed as `combine_loop` sums them
    (weighted in the dtype, ascending expert id, rounded after each add)."""
    t, k = ids.shape
    rank = torch.argsort(ids, dim=1)
    rows = y.view(t, k, -1).gather(1, rank[..., None].expand(-1, -1, y.shape[-1]))
    w = weights.gather(1, rank)
    out = rows[:, 0] * w[:, :1]
    for j in range(1, k):
        out = out + rows[:, j] * w[:, j : j + 1]
    return out


def combine_pairs(y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T * k, H] summed per token as `combine_loop` sums (the fused kernel on CUDA)."""
    if triton_moe is not None and triton_moe.takes(y):
        return triton_moe.combine(y, ids, weights)
    return combine_ordered(y, ids, weights)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) of one expert held as dense matrices, rounding as HF's expert."""
    g = stable_linear(x, gate)
    u = stable_linear(x, up)
    return stable_linear(F.silu(g) * u, down)


class DenseMath:
    """The products of experts held as dense [E, I, H] / [E, H, I] tensors (gate, up, down)."""

    def config(self, tensors: Sequence[torch.Tensor], tokens: int, k: int, dtype: torch.dtype) -> object:
        """The fused kernels' launch shape for a step of `tokens` x `k` pairs over these
        experts: an expert cache passes the full layer's, so its products are the same launches'."""
        if triton_moe is None:
            return None
        e, i, h = tensors[0].shape
        return triton_moe.default_config(tokens, int(e), int(h), int(i), k, dtype)

    def pairs(self, rows: torch.Tensor, tensors: Sequence[torch.Tensor], slots: torch.Tensor,
              config: object) -> torch.Tensor:
        """rows [P, H], each with its own expert (slots [P], indices into the tensors) -> [P, H]."""
        gate, up, down = tensors
        if config is not None and triton_moe is not None and triton_moe.takes(rows, gate, up, down):
            bm, bn_gu, bn_d, warps, stages = config  # type: ignore[misc]
            a = triton_moe.align(slots.view(-1, 1), int(gate.shape[0]), bm)
            act = triton_moe.expert_gate_up(rows, gate, up, a, 1, block_n=bn_gu, warps=warps, stages=stages)
            return triton_moe.expert_down(act, down, a, 1, block_n=bn_d, warps=warps, stages=stages)
        ones = torch.ones(slots.numel(), 1, dtype=rows.dtype, device=rows.device)
        return self.all(rows, tensors, slots.view(-1, 1), ones)

    def all(self, x: torch.Tensor, tensors: Sequence[torch.Tensor], ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for every token, each expert at its own index."""
        gate, up, down = tensors
        if triton_moe is not None and triton_moe.takes(x, gate, up, down):
            return triton_moe.moe(x, gate, up, down, ids, weights)
        k = ops.cpu_kernels(x)
        if k is not None and x.is_contiguous() and all(t.device.type == "cpu" for t in tensors):
            return k.experts_dense(x, ids, weights, gate, up, down)  # combine_loop's ops, in C++
        return combine_loop(x, ids, weights, lambda e, r: swiglu(r, gate[e], up[e], down[e]))

    def combine(self, y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return combine_pairs(y, ids, weights)

    def maps(self, x: torch.Tensor, slots: Sequence[torch.Tensor]) -> bool:
        """Whether `mapped` takes rows like x over these device slots (the fused kernels do)."""
        return triton_moe is not None and triton_moe.takes(x, *slots)

    def mapped(self, x: torch.Tensor, slots: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor],
               table: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, config: object) -> torch.Tensor:
        """`all` with each expert read from its slot (table[e] >= 0) or from its pinned host copy
        (`triton_moe.HostCopies`); `config`: the full layer's launch shape, so the bits are `all`'s."""
        assert triton_moe is not None
        return triton_moe.moe(x, *slots, ids, weights, config=config,  # type: ignore[arg-type]
                              host=triton_moe.HostCopies(table, *hosts))


class Experts(nn.Module):
    """E SwiGLU experts on the compute device: gate, up [E, I, H] and down [E, H, I]."""

    def __init__(self, num: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(num, ffn, hidden))
        self.up = nn.Parameter(torch.empty(num, ffn, hidden))
        self.down = nn.Parameter(torch.empty(num, hidden, ffn))
        self.math = DenseMath()

    @property
    def num_experts(self) -> int:
        return int(self.gate.shape[0])

    def tensors(self) -> list[torch.Tensor]:
        """The expert-major tensors (what an expert cache copies slot by slot)."""
        return [self.gate, self.up, self.down]

    @property
    def graph_safe(self) -> bool:
        return triton_moe is not None and self.gate.is_cuda and triton_moe.takes(
            torch.empty(1, self.gate.shape[2], dtype=self.gate.dtype, device=self.gate.device), *self.tensors())

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.math.all(x, self.tensors(), ids, weights)


class SparseMLP(nn.Module):
    """Router, routed experts and an optional gated shared expert (one decoder layer's MLP)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, expert_ffn: int, normalise: bool,
                 shared_ffn: int = 0) -> None:
        super().__init__()
        self.router = Linear(hidden, num_experts, bias=False)
        self.experts: nn.Module = Experts(num_experts, hidden, expert_ffn)
        self.top_k = top_k
        self.normalise = normalise
        self.shared = MLP(hidden, shared_ffn) if shared_ffn else None
        self.shared_gate = Linear(hidden, 1, bias=False) if shared_ffn else None

    def hold_experts(self, experts: nn.Module) -> None:
        """Compute the routed experts with another holder of the same weights (an expert cache)."""
        self.experts = experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, k], weights [T, k] in x's dtype)."""
        return route(self.router.forward(x), self.top_k, self.normalise, x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = self.experts.forward(x, ids, weights)
        if self.shared is not None and self.shared_gate is not None:
            out = out + torch.sigmoid(self.shared_gate.forward(x)) * self.shared.forward(x)
        return out


def dense_mlp(mlp: nn.Module) -> MLP | None:
    """The dense SwiGLU of a layer's MLP: itself, a sparse MLP's shared expert, or None."""
    if isinstance(mlp, MLP):
        return mlp
    return mlp.shared if isinstance(mlp, SparseMLP) else None


def graph_safe(model: nn.Module) -> bool:
    """Whether every sparse layer computes without reading the routing on the host (what a CUDA
    graph capture needs): the fused kernels take its experts where they are."""
    for layer in model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and not getattr(experts, "graph_safe", False):
            return False
    return True
