"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention with q/k/v biases, routed
experts whose top-k weights are not renormalised, and a shared expert scaled by a sigmoid gate."""

from strata.models.architecture import Architecture

ARCH = Architecture(name="qwen2moe", hf_model_types=("qwen2_moe",), gguf_norm_topk=False)
