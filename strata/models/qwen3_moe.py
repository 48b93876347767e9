"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, a sparse MLP in every layer.

128 routed experts, 8 a token, their weights renormalised (llama.cpp fixes
that for this architecture; config.json says `norm_topk_prob`), no shared
expert. `moe.py` computes the sparse MLP.
"""

from strata.models.architecture import Architecture

ARCH = Architecture(name="qwen3moe", hf_model_types=("qwen3_moe",), qk_norm=True, default_head_dim=128)
