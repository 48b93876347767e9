"""Qwen3: per-head RMSNorm on q and k before RoPE; head_dim is independent of hidden size."""

from strata.models.architecture import Architecture

ARCH = Architecture(name="qwen3", hf_model_types=("qwen3",), qk_norm=True, default_head_dim=128)
