"""Triton kernels for CUDA tensors.

Attention over the KV pool through its chunk tables: `decode` (one query per
lane, split along the context), `prefill` (a chunk of queries, causal),
`write` (new K/V into cells), `cells` (the table lookup and per-format
tiles), `half` (the K or V view a kernel reads), `gather` (blocks of the
pinned host store into the device block cache). A layer's other pieces:
`fused` (RMSNorm, residual add, RoPE, SiLU times up) and `gemv` (one-row
matrix-vector products that carry them). `numerics` holds the shared
device functions.
"""
