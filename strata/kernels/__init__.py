"""Strata's own kernels, grouped by backend: `cpu/` (C++, built by torch) and `triton/`.

Kernels import nothing of Strata above them (not the pool, the engine or the
models): they take tensors, strides and sizes. `strata/attention/` and
`strata/models/ops.py` put them behind the engine's interfaces.
"""
