"""GGUF files: metadata, tensor layout, and dequantization in vectorized torch."""

from strata.gguf.dequant import FOREIGN_TYPES, SUPPORTED_TYPES, dequantize
from strata.gguf.file import GGUFFile, TensorInfo

__all__ = ["FOREIGN_TYPES", "GGUFFile", "SUPPORTED_TYPES", "TensorInfo", "dequantize"]
