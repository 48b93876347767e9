"""Model architectures (llama, qwen2, qwen3) and weight loading from GGUF or HF folders."""

from strata.attention.base import AttentionContext
from strata.models.base import ModelConfig
from strata.models.loader import LoadedModel, load_model

__all__ = ["AttentionContext", "LoadedModel", "ModelConfig", "load_model"]
