"""Qwen2 / Qwen2.5: the plain decoder with a bias on the q, k and v projections."""

from strata.models.architecture import Architecture

ARCH = Architecture(name="qwen2", hf_model_types=("qwen2",), attention_bias=True)
