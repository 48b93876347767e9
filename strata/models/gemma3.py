"""Gemma 3 (text): the shared attention inside Gemma's own layer, norms, MLP and embedding.

What differs from the shared decoder (`layers.py`), each as Hugging Face's
`modeling_gemma3.py` computes it:

- RMSNorm scales by (1 + weight), all in float32, rounded once at the end;
  four of them a layer (before and after attention, before and after the
  MLP: "sandwich" norms) and one per head on q and k.
- the MLP gates with GELU (tanh approximation) instead of SiLU.
- embeddings are multiplied by sqrt(hidden_size) rounded to their dtype.
- five of every six layers attend within a sliding window and rotate with
  their own (local, unscaled) RoPE base; the others see everything and use
  the global base and scaling. Both RoPE tables are stacked in the model's
  one pair of tables, global first. Only the global layers keep K/V in the
  pool (`pool_layers`); a sliding layer keeps the k/v of its window as
  per-lane state (`window.py`), so Gemma 3 is a state model.
- the attention scale comes from `query_pre_attn_scalar`, and the logits may
  be soft-capped.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from strata.attention.base import AttentionContext
from strata.kv.state import StateContext, StateDtypes, StateShapes
from strata.models.architecture import Architecture
from strata.models.base import ModelConfig
from strata.models.dense import MLP
from strata.models.layers import Attention, DecoderModel, RMSNorm
from strata.models.rope import config_tables
from strata.models.window import WindowStep, window_state_shapes


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight) in float32, rounded to x's dtype once (Gemma's order, unlike
    Llama's round-then-scale)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class GeluMLP(MLP):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up in one matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(F.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(Attention):
    """The shared attention with Gemma's per-head q/k norms; a sliding layer attends over its
    window's state (`window.py`) instead of the pool."""

    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__(cfg, layer_index)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext,
                window: WindowStep | None = None) -> torch.Tensor:
        if self.window is None:
            return super().forward(x, cos, sin, ctx)
        if window is None:
            raise ValueError("a sliding-window layer needs a StateContext for its window's k/v")
        q, k, v = self.project(self.qkv_proj.forward(x), cos, sin)
        out = window.attend(self.layer_index, q, k, v).reshape(x.shape[0], self.q_size)
        return self.o_proj.forward(out)


class Gemma3Layer(nn.Module):
    """Sandwich-normed residual block: h + norm(attn(norm(h))), then the same around the MLP."""

    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Gemma3Attention(cfg, layer_index)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GeluMLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext,
        window: WindowStep | None = None,
    ) -> torch.Tensor:
        """window: the step's sliding-window state, which only a sliding layer reads."""
        a = self.self_attn.forward(self.input_layernorm.forward(h), cos, sin, ctx, window)
        h = h + self.post_attention_layernorm.forward(a)
        m = self.mlp.forward(self.pre_feedforward_layernorm.forward(h))
        return h + self.post_feedforward_layernorm.forward(m)


class Gemma3Model(DecoderModel):
    """The shared model's seams (`embed`, `run_layers`, `head`) with Gemma's differences."""

    layer_class = Gemma3Layer
    norm_class = GemmaRMSNorm

    def rope_for(self, n: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [n, 2, head_dim]: the global layers' tables, then the sliding layers'."""
        cfg = self.config
        local = dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta or cfg.rope_theta,
                                    rope_scaling=None, rope_freq_factors=None)
        g_cos, g_sin = config_tables(cfg, n, dtype, device)
        l_cos, l_sin = config_tables(local, n, dtype, device)
        return torch.stack((g_cos, l_cos), dim=1), torch.stack((g_sin, l_sin), dim=1)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = super().embed(input_ids)
        # the scale rounded to the embedding's dtype first, as Hugging Face does (bf16: 55.43 -> 55.5);
        # a Python number (a host tensor's value), not a device tensor made from one each step
        return h * float(torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype))

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                   start: int = 0, end: int | None = None,
                   rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                   states: StateContext | None = None) -> torch.Tensor:
        """The shared decoder's `run_layers`, each layer rotating with its own table; `states`
        carries the sliding layers' windows."""
        cos_table, sin_table = (self.rope_cos, self.rope_sin) if rope is None else rope
        cos = cos_table[positions]  # [T, 2, D]
        sin = sin_table[positions]
        tables = {False: (cos[:, :1], sin[:, :1]), True: (cos[:, 1:], sin[:, 1:])}  # by sliding
        layers = self.layers[start:end]
        cfg = self.config
        window = None
        if states is not None and any(layer.self_attn.window is not None for layer in layers):
            window = WindowStep(positions, states, cfg.sliding_window, cfg.attn_scale)
        for layer in layers:
            c, s = tables[layer.self_attn.window is not None]
            h = layer.forward(h, c, s, ctx, window)
        return h

    def state_layers(self) -> dict[int, StateShapes]:
        """The sliding layers: each keeps its window's k/v per lane (a ring of W cells)."""
        cfg = self.config
        if not cfg.sliding_layers:
            return {}
        assert cfg.sliding_window is not None
        return {i: window_state_shapes(cfg.sliding_window, cfg.num_kv_heads, cfg.head_dim)
                for i in cfg.sliding_layers}

    def state_dtypes(self) -> dict[int, StateDtypes]:
        """The windows' k/v in the model's dtype: the values a pool cell would hold."""
        dtype = self.norm.weight.dtype
        return {i: {"k": dtype, "v": dtype} for i in self.config.sliding_layers}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def gguf_query_scalar(layers: int, hidden: int, heads: int, head_dim: int) -> float:
    """llama.cpp's rule: Gemma 3 27B (62 layers) scales by hidden / heads, the others by head_dim."""
    return hidden // heads if layers == 62 else head_dim


ARCH = Architecture(
    name="gemma3",
    hf_model_types=("gemma3_text",),
    qk_norm=True,
    default_head_dim=256,
    model_class=Gemma3Model,
    activation="gelu_pytorch_tanh",
    hf_tied=True,
    gguf_layer_names=(
        ("post_attention_layernorm.weight", "post_attention_norm.weight"),
        ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
        ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
    ),
    gguf_norm_offset=1.0,
    sliding_pattern=6,
    local_rope_theta=10000.0,
    gguf_query_scalar=gguf_query_scalar,
)
