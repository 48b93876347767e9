"""What an architecture module declares: how it differs from the shared decoder.

Adding an architecture means one module that builds an `Architecture` and one
line in `registry.py`. The switches here are all the loader and the decoder
need; an architecture whose layers differ more can pass its own `model_class`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from strata.models.layers import DecoderModel


@dataclass(frozen=True)
class Architecture:
    name: str  # registry key; also GGUF's general.architecture
    hf_model_types: tuple[str, ...]  # config.json "model_type" values it serves
    attention_bias: bool | None = None  # fixed bias on q/k/v; None: read config.json
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE
    default_head_dim: int | None = None  # when config.json omits head_dim; None: hidden / heads
    gguf_qk_permuted: bool = False  # llama.cpp's converter reorders Q/K rows for its RoPE
    # Mixture of experts: whether a GGUF file's top-k weights are renormalised when the file does
    # not say (`{arch}.expert_weights_norm`); llama.cpp fixes it per architecture.
    gguf_norm_topk: bool = True
    hf_norm_topk: bool | None = None  # fixed for the architecture; None: config.json's norm_topk_prob
    # an HF checkpoint's names of a sparse layer: the MLP's module, then each expert's gate, up
    # and down matrices (Qwen: mlp.experts.{e}.gate_proj; Mixtral: block_sparse_moe.experts.{e}.w1)
    hf_experts: tuple[str, str, str, str] = ("mlp", "gate_proj", "up_proj", "down_proj")
    partial_rotary: bool = False  # its attention honours a partial rotary factor (rotary_dim < head_dim)
    attn_output_gate: bool = False  # q_proj's rows interleave each head's query and output gate
    model_class: type[DecoderModel] = DecoderModel
    activation: str = "silu"  # the MLP's gate activation, as config.json names it
    hf_tied: bool = False  # tie_word_embeddings where config.json omits it (transformers' default)
    # GGUF layer tensor names that differ from llama's (`naming.py`), (parameter, stored name) pairs
    gguf_layer_names: tuple[tuple[str, str], ...] = ()
    gguf_norm_offset: float = 0.0  # llama.cpp stores norm weights w as w + offset (Gemma: 1)
    # Sliding-window layers where a config.json or GGUF file does not list them (transformers and
    # llama.cpp fix them per architecture): every n-th layer global (0: none slide), and the
    # sliding layers' RoPE base
    sliding_pattern: int = 0
    local_rope_theta: float | None = None
    # a GGUF file's query_pre_attn_scalar (no key holds it) from (layers, hidden, heads, head_dim)
    gguf_query_scalar: Callable[[int, int, int, int], float] | None = None
    mtp: bool = False  # its folders may store a multi-token-prediction head under mtp.* (`mtp.py`)
