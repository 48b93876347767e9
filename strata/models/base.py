"""What every architecture shares: its configuration.

A model module never owns K/V. Each attention layer computes q, k, v (after
RoPE and any q/k norm) and hands them to `AttentionContext.attend`
(`strata/attention/base.py`), which
writes k, v into the KV pool through the chunk tables and returns the
attention output. That keeps the pool, the cell formats, streaming and the
GPU kernels out of model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    arch: str  # registry key: "llama", "qwen2", "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF-style dict, e.g. {"rope_type": "llama3", ...}
    # Per-frequency divisors of the rotary inverse frequencies, as a GGUF's
    # `rope_freqs.weight` carries Llama 3 scaling (llama.cpp's convention).
    rope_freq_factors: list[float] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (qwen3)
    rotary_dim: int = 0  # leading dimensions of a head that RoPE rotates; 0: all (head_dim)
    attn_output_gate: bool = False  # q_proj also gives a per-head sigmoid gate on the output (qwen3next)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Mixture of experts (`moe.py`); num_experts 0: every layer's MLP is dense.
    num_experts: int = 0
    experts_per_token: int = 0  # top-k
    expert_ffn: int = 0  # one expert's intermediate size
    norm_topk_prob: bool = True  # the k chosen weights rescaled to sum to 1
    shared_expert_ffn: int = 0  # a shared expert with a sigmoid gate beside the routed ones (qwen2_moe)
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP in a MoE model
    # Sliding-window attention (gemma3): the listed layers' queries see their last
    # `sliding_window` keys, themselves included, and rotate with their own RoPE base.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None  # the sliding layers' RoPE base (never scaled); None: rope_theta
    query_pre_attn_scalar: float | None = None  # attention scale = its -1/2 power; None: head_dim's
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)

    # Linear-attention layers (gated DeltaNet, `deltanet.py`); layer_types empty: all full attention.
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" or "linear_attention"
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    # A multi-token-prediction head (Qwen3-Next's `mtp.*`, `mtp.py`): 1 where the checkpoint
    # stores one (its first layer is used), else 0.
    mtp_layers: int = 0

    def linear(self, layer: int) -> bool:
        """Whether `layer` is a linear-attention (recurrent) layer."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def rope_dim(self) -> int:
        """The rotated dimensions of a head."""
        return self.rotary_dim or self.head_dim

    def sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def window(self, layer: int) -> int | None:
        """The keys `layer`'s queries see (None: all before them)."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5
