"""Qwen3-Next (Qwen3-Next-80B-A3B): gated DeltaNet layers with a gated attention layer every fourth.

Three of every four layers are linear attention (`deltanet.py`): a fixed-size
recurrent state per sequence instead of K/V. The others are full attention
whose q_proj also yields a per-head output gate (attention output times
sigmoid(gate) before o_proj), with q/k norms and RoPE on only the first
quarter of each head (partial_rotary_factor 0.25). Every RMSNorm outside the
DeltaNet's output gate is zero-centred: it scales by 1 + weight. The MLPs are
Qwen2-MoE's: routed experts plus a shared expert with a sigmoid gate
(`moe.SparseMLP`), or dense SwiGLU where the config says so. A folder may
carry a multi-token-prediction head (`mtp.py`): one more gated-attention layer.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from strata.attention.base import AttentionContext
from strata.kv.state import StateContext, StateShapes
from strata.models import ops
from strata.models.architecture import Architecture
from strata.models.base import ModelConfig
from strata.models.deltanet import GatedDeltaNet
from strata.models.dense import MLP, Linear
from strata.models.layers import DecoderModel, RMSNorm
from strata.models.moe import SparseMLP
from strata.models.mtp import MtpHead
from strata.models.rope import apply_partial_rope


class ZeroCentredRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + weight), all in float32 before the cast back (HF's order)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.zero_rms_norm(x, self.weight, self.eps)

    def add_forward(self, h: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + a, its norm): the residual sum and the next sublayer's input, one launch on CUDA."""
        return ops.add_zero_rms_norm(h, a, self.weight, self.eps)


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj's rows are, per head, the query then the gate."""

    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kv = cfg.num_kv_heads * cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, 2 * self.q_size + 2 * kv, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = ZeroCentredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        kv = self.num_kv_heads * d
        qg, k, v = self.qkv_proj.forward(x).split((2 * self.q_size, kv, kv), dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * d).split((d, d), dim=-1)
        q = apply_partial_rope(self.q_norm.forward(q.contiguous()), cos, sin).contiguous()
        k = apply_partial_rope(self.k_norm.forward(k.reshape(t, -1, d)), cos, sin).contiguous()
        v = v.reshape(t, -1, d).contiguous()
        out = ctx.attend(self.layer_index, q, k, v).reshape(t, self.q_size)
        return self.o_proj.forward(out * torch.sigmoid(gate.reshape(t, self.q_size)))


class Qwen3NextLayer(nn.Module):
    """Pre-norm residual block: a DeltaNet (`linear_attn`) or gated attention (`self_attn`), then
    the MLP."""

    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.linear_attn = GatedDeltaNet(cfg, layer_index) if cfg.linear(layer_index) else None
        self.self_attn = None if cfg.linear(layer_index) else GatedAttention(cfg, layer_index)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | SparseMLP
        if cfg.sparse(layer_index):
            self.mlp = SparseMLP(cfg.hidden_size, cfg.num_experts, cfg.experts_per_token, cfg.expert_ffn,
                                 cfg.norm_topk_prob, cfg.shared_expert_ffn)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext,
                states: StateContext | None = None) -> torch.Tensor:
        x = self.input_layernorm.forward(h)
        if self.linear_attn is not None:
            mixed = self.linear_attn.forward(x, states)
        else:
            assert self.self_attn is not None
            mixed = self.self_attn.forward(x, cos, sin, ctx)
        h, x = self.post_attention_layernorm.add_forward(h, mixed)
        return h + self.mlp.forward(x)


class Qwen3NextModel(DecoderModel):
    """The shared decoder's embedding, head and RoPE tables around Qwen3-Next's layers."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mtp: MtpHead | None = None
        if cfg.mtp_layers:  # one full-attention layer after the model's, its K/V a pool layer of its own
            index = cfg.num_layers
            full = dataclasses.replace(cfg, layer_types=cfg.layer_types + ("full_attention",))
            self.mtp = MtpHead(cfg, Qwen3NextLayer(full, index), index, ZeroCentredRMSNorm)

    def mtp_step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 ctx: AttentionContext) -> torch.Tensor:
        """The MTP head over entries at `positions` [T]: the tokens `input_ids` [T] (each at its
        position + 1) and `hidden` [T, H] -> the head's normed output [T, H] (`MtpHead.run`)."""
        if self.mtp is None:
            raise ValueError("this checkpoint carries no MTP head")
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        return self.mtp.run(self.embed(input_ids), hidden, cos, sin, ctx)

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return Qwen3NextLayer(cfg, layer_index)

    def state_layers(self) -> dict[int, StateShapes]:
        return {i: layer.linear_attn.state_shapes() for i, layer in enumerate(self.layers)
                if layer.linear_attn is not None}

    def cuts_within_steps(self) -> bool:
        """Every state layer is a DeltaNet, which computes a prompt piece in parts at its cuts
        (`GatedDeltaNet.mix_cut`)."""
        return True

    def states_capturable(self) -> bool:
        """The DeltaNet layers gather and scatter their slots by a device index (a decode step's
        spans make no host tensors: `deltanet.py`, `deltanet_fla.varlen_layout`)."""
        return True


ARCH = Architecture(
    name="qwen3next",
    hf_model_types=("qwen3_next",),
    qk_norm=True,
    default_head_dim=256,
    partial_rotary=True,
    attn_output_gate=True,
    model_class=Qwen3NextModel,
    # llama.cpp's converter stores the zero-centred norms as 1 + w; the DeltaNet's tensors
    # (its gated norm as it is) are mapped in `naming.py`
    gguf_layer_names=(("post_attention_layernorm.weight", "post_attention_norm.weight"),),
    gguf_norm_offset=1.0,
    mtp=True,
)
