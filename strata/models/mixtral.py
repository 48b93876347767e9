"""Mixtral (8x7B, 8x22B): Llama's attention and a sparse MLP of 8 experts, 2 a token.

The router's top-2 weights are always renormalised, every layer is sparse and
there is no shared expert. The checkpoints name a layer's MLP
`block_sparse_moe` and an expert's matrices w1 (gate), w3 (up) and w2 (down);
llama.cpp converts the model to its `llama` architecture with an expert count,
which the llama record reads the same way.
"""

from strata.models.architecture import Architecture

ARCH = Architecture(name="mixtral", hf_model_types=("mixtral",), hf_norm_topk=True,
                    hf_experts=("block_sparse_moe", "w1", "w3", "w2"))
