"""Triton kernels that read and write the shared KV pool through its chunk tables.

`decode` (one query per lane, split along the context), `prefill` (a chunk
of queries, causal) and `write` (new K/V into the cells) all address cells
the way `strata.kv.pool` does; `cells` holds the shared table lookup and the
per-format dequantization, `layout` maps a format's runs to kernel arguments.
`strata.kv.gpu_attention` puts them behind the engine's AttentionContext.
"""
