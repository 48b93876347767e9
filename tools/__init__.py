"""Helpers that are not part of the product: synthetic GGUF files, llama.cpp builds."""
