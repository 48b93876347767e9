"""How much a KV format loses: relative RMS error of K and V after one round trip.

V is compared after `finish_output`, i.e. in the space attention sees once the
output is rotated back, so k8v4 and its unrotated twin are measured alike.
"""

from __future__ import annotations

import torch

from strata.kv.formats import FORMAT_NAMES, K8V4Format, KvFormat, make_format

# Measurement-only variants: not `--kv` values.
EXTRA_NAMES = ("k8v4_norot",)


def _make(name: str, n_kv_heads: int, head_dim: int) -> KvFormat:
    if name == "k8v4_norot":
        return K8V4Format(n_kv_heads, head_dim, rotate=False)
    return make_format(name, n_kv_heads, head_dim)


def _rel_rms(approx: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.to(torch.float64)
    err = approx.to(torch.float64) - exact
    denom = exact.square().sum().sqrt()
    return float(err.square().sum().sqrt() / denom) if denom > 0 else float(err.abs().max())


def format_error(fmt_name: str, k: torch.Tensor, v: torch.Tensor) -> dict[str, float]:
    """{'k': ..., 'v': ...}: ||x' - x|| / ||x|| for k, v [T, Hkv, D] written then read back.

    `fmt_name` is one of FORMAT_NAMES or EXTRA_NAMES.
    """
    names = FORMAT_NAMES + EXTRA_NAMES
    if fmt_name not in names:
        raise ValueError(f"unknown format {fmt_name!r}; choose one of {', '.join(names)}")
    fmt = _make(fmt_name, k.shape[1], k.shape[2])
    storage = fmt.allocate(k.shape[0], k.device)
    cells = torch.arange(k.shape[0], device=k.device)
    fmt.write(storage, cells, k, v)
    k_hat, v_hat = fmt.read(storage, cells, torch.float32)
    return {"k": _rel_rms(k_hat, k), "v": _rel_rms(fmt.finish_output(v_hat), v)}
