"""Llama (SmolLM2, Llama 2, Llama 3 with its rope scaling): the plain decoder.

llama.cpp interleaves the two rotary halves of each Q/K head when it converts
this architecture, so the GGUF loader undoes that permutation.
"""

from strata.models.architecture import Architecture

ARCH = Architecture(name="llama", hf_model_types=("llama",), gguf_qk_permuted=True)
