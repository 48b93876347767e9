"""The decoder every supported architecture shares: RMSNorm, attention, SwiGLU, the stack.

Architectures differ only in switches on `ModelConfig` (q/k/v bias, q/k
norm, a sparse MLP of experts where the config has them: `moe.py`), so one implementation serves them all and an architecture module is a
short description (see `architecture.py`). Q/K/V and gate/up projections are
fused into one matmul each: fewer, larger kernels per layer and per token.

Parameter names follow Hugging Face's where nothing is fused, which keeps the
weight-name maps in `naming.py` short.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from strata.attention.base import AttentionContext
from strata.kv.state import StateContext, StateDtypes, StateShapes
from strata.models import ops
from strata.models.base import ModelConfig
from strata.models.blocks import BlockLinear
from strata.models.dense import MLP, Linear, stable_linear
from strata.models.moe import SparseMLP
from strata.models.rope import apply_rope, config_tables


class RMSNorm(nn.Module):
    """Normalise in float32, cast back, then scale: Hugging Face's exact order of rounding."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Projections, q/k norm and RoPE; the attention itself belongs to the context.

    q, k and v reach `ctx.attend` contiguous (free for a decode step's single
    row), so a context may view or copy them without checking strides.
    """

    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.qk_heads = cfg.num_heads + cfg.num_kv_heads
        self.q_size = cfg.num_heads * cfg.head_dim
        qkv_rows = (self.qk_heads + cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, qkv_rows, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.window = cfg.window(layer_index)  # None, or a sliding layer's window

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        out = self.attend(self.qkv_proj.forward(x), cos, sin, ctx)
        return self.o_proj.forward(out)

    def attend(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext,
        roped: bool = False,
    ) -> torch.Tensor:
        """The fused projection [T, width] -> attention output [T, q_size] (o_proj's input).

        roped: q and k in qkv are rotated already (the one-row product did it); one row only.
        """
        q, k, v = self.project(qkv, cos, sin, roped)
        return ctx.attend(self.layer_index, q, k, v, window=self.window).reshape(qkv.shape[0], self.q_size)

    def project(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, roped: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection [T, width] -> q [T, Hq, D], k and v [T, Hkv, D], contiguous, q and
        k normed (where the config says so) and rotated."""
        t = qkv.shape[0]
        hq = self.num_heads
        if roped:
            kv = self.num_kv_heads * self.head_dim
            q, k, v = qkv.view(-1).split((self.q_size, kv, kv))  # one row: contiguous pieces
            q = q.view(1, hq, self.head_dim)
            k = k.view(1, self.num_kv_heads, self.head_dim)
            v = v.view(1, self.num_kv_heads, self.head_dim)
        elif self.q_norm is not None and self.k_norm is not None:
            qkv = qkv.view(t, -1, self.head_dim)
            qk = qkv[:, : self.qk_heads]
            qk = torch.cat((self.q_norm.forward(qk[:, :hq].contiguous()),
                            self.k_norm.forward(qk[:, hq:].contiguous())), dim=1)
            qk = apply_rope(qk, cos, sin)  # q and k heads rotated together: one set of ops
            q = qk[:, :hq].contiguous()
            k = qk[:, hq:].contiguous()
            v = qkv[:, self.qk_heads :].contiguous()
        else:
            q, k, v = ops.rope_qkv(qkv, cos, sin, hq, self.num_kv_heads, self.head_dim)
        return q, k, v


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP.

    Submodules are called through `.forward`: no hooks are used, and skipping
    nn.Module's call machinery saves about 1 ms per token on the CPU.
    """

    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | SparseMLP
        if cfg.sparse(layer_index):
            self.mlp = SparseMLP(cfg.hidden_size, cfg.num_experts, cfg.experts_per_token, cfg.expert_ffn,
                                 cfg.norm_topk_prob, cfg.shared_expert_ffn)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self._blocks_plan: tuple[Any, ...] | None = None  # `_cpu_blocks`: made on the first call

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext,
        states: StateContext | None = None,
    ) -> torch.Tensor:
        """states: the step's recurrent state, which attention layers do not read (the stack
        hands every layer the same arguments)."""
        if h.is_cuda and h.shape[0] == 1 and isinstance(self.mlp, MLP):  # one CUDA row: the products
            attn, mlp = self.self_attn, self.mlp  # carry the small ops (not where they are invariant)
            lins = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            g = ops.row_kernels(h, *lins)
            if g is not None:
                return self._forward_row(g, h, cos, sin, ctx)
            if all(isinstance(m, BlockLinear) and m.takes_row(h) for m in lins):
                return self._forward_row_blocks(h, cos, sin, ctx)
        block_layer = self._cpu_blocks(h)
        if block_layer is not None:
            return self._forward_blocks_cpu(block_layer, h, cos, sin, ctx)
        a = self.self_attn.forward(self.input_layernorm.forward(h), cos, sin, ctx)
        post = self.post_attention_layernorm
        h, x = ops.add_rms_norm(h, a, post.weight, post.eps)  # the residual add and the next norm
        return h + self.mlp.forward(x)

    def _cpu_blocks(self, h: torch.Tensor) -> Any:
        """This layer's C++ `BlockLayer` (`kernels/cpu/csrc/block_layer.cpp`) when it runs as C++
        calls on the CPU (`_forward_blocks_cpu`): every projection GGUF blocks, a dense MLP, no
        q/k norm, the norms in h's dtype; else None. Made on the first call, again after a move
        (`_apply`)."""
        plan = self._blocks_plan
        if plan is None:
            plan = self._blocks_plan = self._make_block_layer()
        if not plan or h.device.type != "cpu" or h.dtype != plan[1]:
            return None
        return plan[0]

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """`.to()` and its kind replace the tensors a BlockLayer holds: made again on next use."""
        self._blocks_plan = None
        return super()._apply(fn, recurse)

    def _make_block_layer(self) -> tuple[Any, ...]:
        """(the C++ BlockLayer, the norms' dtype, which h must have), or () where it does not apply."""
        attn, mlp, pre, post = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        lins = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
        if not (isinstance(mlp, MLP) and attn.q_norm is None and all(
                isinstance(m, BlockLinear) and m.device.type == "cpu" and not m.packed for m in lins)
                and all(m.bias is None for m in lins[1:])):
            return ()
        k = ops.cpu_kernels(pre.weight)
        if k is None:
            return ()
        seg = [([b for _, b in m.segments()], [int(q) for q, _ in m.segments()]) for m in lins]
        layer = k.BlockLayer(pre.weight, pre.eps, seg[0], attn.qkv_proj.bias, attn.num_heads, attn.num_kv_heads,
                             seg[1], post.weight, post.eps, seg[2], seg[3])
        return (layer, pre.weight.dtype)

    def _forward_blocks_cpu(self, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            ctx: AttentionContext) -> torch.Tensor:
        """The layer through its C++ `BlockLayer`: the same C++ functions in the same order as the
        modules' path, so the same bits, without a dozen Python calls a layer between them. One
        call where the context lets attention be done in place (`InPlaceCells`), else the
        projections, the context's `attend` and the rest."""
        attn = self.self_attn
        h = h.contiguous()
        offer = getattr(ctx, "cells_in_place", None)  # an optional part of a context (attention/base.py)
        cells = offer(attn.layer_index, h.dtype) if offer is not None else None
        if cells is not None:
            return layer.forward(h, cos, sin, cells.k, cells.v, cells.write_cells, cells.cells, cells.row_seq,
                                 cells.row_pos, cells.scale, attn.window or 0)
        q, k, v = layer.project(h, cos, sin)
        out = ctx.attend(attn.layer_index, q, k, v, window=attn.window).reshape(h.shape[0], attn.q_size)
        return layer.tail(h, out.contiguous())

    def _forward_row(self, g: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     ctx: AttentionContext) -> torch.Tensor:
        """One CUDA row (a one-lane decode step): four matrix-vector products (`kernels/triton/gemv.py`)
        that carry both norms, RoPE, the SwiGLU product and both residual adds."""
        attn, mlp = self.self_attn, self.mlp
        pre, post = self.input_layernorm, self.post_attention_layernorm
        # RoPE in the product's epilogue, unless q/k norms come between (Qwen3)
        rope = None if attn.q_norm is not None else (cos.view(-1), sin.view(-1), attn.qk_heads,
                                                     attn.head_dim)
        qkv = g.gemv(h, attn.qkv_proj.weight, attn.qkv_proj.bias, norm_weight=pre.weight,
                     eps=pre.eps, rope=rope)
        out = attn.attend(qkv, cos, sin, ctx, roped=rope is not None)
        h = g.gemv(out, attn.o_proj.weight, residual=h)
        act = g.gemv(h, mlp.gate_up_proj.weight, norm_weight=post.weight, eps=post.eps, silu=True)
        return g.gemv(act, mlp.down_proj.weight, residual=h)


    def _forward_row_blocks(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            ctx: AttentionContext) -> torch.Tensor:
        """One CUDA row over GGUF blocks (`blocks.py`): the same folds, RoPE left to attention."""
        attn, mlp = self.self_attn, self.mlp
        pre, post = self.input_layernorm, self.post_attention_layernorm
        qkv = attn.qkv_proj.row(h, norm_weight=pre.weight, eps=pre.eps)
        out = attn.attend(qkv, cos, sin, ctx, roped=False)
        h = attn.o_proj.row(out, residual=h)
        act = mlp.gate_up_proj.row(h, norm_weight=post.weight, eps=post.eps, silu=True)
        return mlp.down_proj.row(act, residual=h)


class DecoderModel(nn.Module):
    """Token ids and positions in, final-normed hidden states out; logits on demand.

    Built on the meta device by the loader and filled with `assign=True`; the
    RoPE tables (not weights) are made afterwards by `set_max_positions`. An
    architecture with other layers or norms (`gemma3.py`) names its classes in
    `layer_class` and `norm_class`.
    """

    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.batch_invariant = False  # `set_batch_invariant`
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def set_batch_invariant(self, on: bool) -> None:
        """On CUDA, compute every product (and the head's logits) with the kernel whose rows do not
        depend on how many rows share the launch (`--batch-invariant`): a lane's output is then the
        same alone, among other lanes, and with drafts. No effect on the CPU, which is built so."""
        self.batch_invariant = on
        for m in self.modules():
            if isinstance(m, (Linear, BlockLinear)):
                m.set_invariant(on)

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        """Layer `layer_index` of the stack: an architecture with other layers overrides this."""
        return self.layer_class(cfg, layer_index)

    def state_layers(self) -> dict[int, StateShapes]:
        """The layers that carry fixed-size state between steps (recurrent or sliding-window), with
        their per-lane state shapes (`kv/state.py`); none here: every layer keeps K/V."""
        return {}

    def state_dtypes(self) -> dict[int, StateDtypes]:
        """layer -> name -> dtype of the states in `state_layers` that are not float32."""
        return {}

    def cuts_within_steps(self) -> bool:
        """Whether every state layer keeps its state at rows inside a step (`StateContext.cuts`),
        so a checkpoint needs no step boundary (engine/checkpoints.py)."""
        return False

    def states_capturable(self) -> bool:
        """Whether a decode step's state layers read and write their lanes' slots on the device
        alone (no host reads of the step's slots), so a CUDA graph can capture the step."""
        return not self.state_layers()

    def pool_layers(self) -> list[int]:
        """The layers whose K/V live in the KV pool: every layer without fixed-size state (the
        pool allocates cells for these only)."""
        stateful = self.state_layers()
        return [i for i in range(len(self.layers)) if i not in stateful]

    @property
    def max_positions(self) -> int:
        """Positions the RoPE tables cover; a forward with a larger position fails."""
        return int(self.rope_cos.shape[0])

    def set_max_positions(self, n: int) -> None:
        """(Re)build the RoPE tables for positions 0..n-1 on the weights' device and dtype."""
        w = self.norm.weight  # the ends' device and the compute dtype (the embedding may be blocks)
        self.rope_cos, self.rope_sin = self.rope_for(n, w.device, w.dtype)

    def rope_for(self, n: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables (cos, sin) of positions 0..n-1 on `device`: what a stage on another device
        than the embedding passes to `run_layers`."""
        return config_tables(self.config, n, dtype, device)

    # The three seams a layer split stands on: the first stage embeds, every stage runs its
    # layer range, the last one finishes with the head. `forward` is the three on one device.
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] long -> hidden [T, hidden_size], the input of layer 0."""
        return self.embed_tokens(input_ids)

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                   start: int = 0, end: int | None = None,
                   rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                   states: StateContext | None = None) -> torch.Tensor:
        """Layers [start, end) over hidden h [T, hidden_size] at `positions` [T] (long).

        rope: the (cos, sin) tables on h's device (`rope_for`); None: the model's own.
        states: the step's recurrent state (its sequences' row spans), which the layers in
        `state_layers` need; None for a model without such layers.
        """
        cos_table, sin_table = (self.rope_cos, self.rope_sin) if rope is None else rope
        cos = cos_table[positions].unsqueeze(1)
        sin = sin_table[positions].unsqueeze(1)
        for layer in self.layers[start:end]:
            h = layer.forward(h, cos, sin, ctx, states)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The last layer's hidden [N, hidden_size] -> float32 logits [N, vocab] (final norm, then
        the output projection)."""
        return self.compute_logits(self.norm.forward(h))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
        states: StateContext | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] long -> hidden [T, hidden_size] after the final norm."""
        return self.norm.forward(self.run_layers(self.embed(input_ids), positions, ctx, states=states))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab]."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if isinstance(head, BlockLinear):
            return head.logits(hidden)
        if self.batch_invariant and isinstance(head, (Linear, nn.Embedding)):  # float32 logits summed
            # the same way at any number of rows
            logits = ops.invariant_product(hidden, head.weight, out_dtype=torch.float32)
            if logits is not None:
                return logits
        g = ops.row_kernels(hidden, head)
        if g is not None:
            return g.gemv(hidden, head.weight, out_dtype=torch.float32)
        if self.lm_head is None:  # tied: the embedding is the output head
            return stable_linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head.forward(hidden).float()
