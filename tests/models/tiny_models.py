"""Tiny random transformers models of each architecture, and their greedy output.

Weights are drawn larger than transformers' init (and norms and biases are
not left at 1 and 0), so logits are peaked enough for greedy decoding to be
decided by the weights rather than by rounding, and so a wrongly mapped
norm or bias cannot go unnoticed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so head_dim 16's frequencies fall in all three bands (kept, blended, slowed)
    "original_max_position_embeddings": 64,
}

GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
}
QWEN3_NEXT: dict[str, Any] = dict(
    **{**COMMON, "num_hidden_layers": 4}, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
    linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)

CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE),
    "llama_linear": lambda: LlamaConfig(
        **COMMON, rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}
    ),
    "llama_plain": lambda: LlamaConfig(
        **COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
    ),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32),
    # 8 experts, 2 a token, renormalised; every layer sparse
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=64, norm_topk_prob=True),
    # not renormalised, a gated shared expert, and layer 1 dense (mlp_only_layers)
    "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=3,
                                        moe_intermediate_size=64, shared_expert_intermediate_size=96,
                                        mlp_only_layers=[1]),
    # llama's attention, 4 experts, 2 a token, always renormalised; experts named w1/w3/w2
    "mixtral": lambda: MixtralConfig(**{**COMMON, "intermediate_size": 64}, num_local_experts=4,
                                     num_experts_per_tok=2, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 10000.0}),
    # 3 DeltaNet layers then gated attention (head 16, a quarter rotated); value heads twice the
    # key heads; 4 experts, 2 a token, a gated shared expert in every layer
    "qwen3_next": lambda: Qwen3NextConfig(**QWEN3_NEXT, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "qwen3_next_dense": lambda: Qwen3NextConfig(**QWEN3_NEXT, num_experts=0),
    # transformers' GGUF loader ignores qwen3's key_length and assumes 128
    "qwen3_hd128": lambda: Qwen3Config(**COMMON, head_dim=128),
    # 5 sliding layers (window 8, so PROMPT crosses it) and 1 global; local and global RoPE bases
    # apart, linear scaling on the global one; a query scalar that is not head_dim; capped logits
    "gemma3": lambda: Gemma3TextConfig(**{**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1,
                                          "num_hidden_layers": 6},
                                       head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                                       final_logit_softcapping=3.0, rope_parameters=GEMMA3_ROPE),
}

PROMPT = [1, 17, 200, 33, 5, 90, 91, 255, 4, 64, 128, 7, 7, 42, 100, 3, 250, 12, 61, 8]


def tiny_hf_model(kind: str, seed: int = 0) -> torch.nn.Module:
    return tiny_hf_from_config(CONFIGS[kind](), seed)


def tiny_hf_from_config(config: Any, seed: int = 0) -> torch.nn.Module:
    """A random model of `config` with the weights drawn as the module docstring says."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model.eval()


def save_tiny(kind: str, folder: Path, seed: int = 0) -> torch.nn.Module:
    model = tiny_hf_model(kind, seed)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def save_byte_tokenizer(folder: Path) -> None:
    """A 256-token byte-level BPE without merges: one token per byte, fits vocab 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(folder)


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """n greedy tokens; EOS neither stops nor is suppressed (min_new_tokens would mask it)."""
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    tokens = out[0, len(ids) :].tolist()
    assert len(tokens) == n
    return tokens
