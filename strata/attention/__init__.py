"""Attention backends: where the KV pool (`strata/kv/`) meets the kernels (`strata/kernels/`).

`base` declares the contract every backend keeps; `reference` is the torch
reference (and the C++ kernel on the CPU), `triton_pool` the Triton kernels
over a pool on the device, `triton_stream` the Triton kernels over a
streamed pool's device block cache; `select.backend_for` is the one rule
that picks among them.
"""
