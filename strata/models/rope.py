"""Rotary position embeddings: inverse frequencies (with scaling) and lookup tables.

The tables hold cos and a sign-folded sin for every position, in the compute
dtype, so a forward step gathers its rows by position once and each attention
layer spends four elementwise ops on RoPE. The arithmetic mirrors Hugging
Face's `rotate_half` form (products rounded to the compute dtype, then
summed), so results match it bit for bit in every dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from strata.models.base import ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The scaling kind of an HF-style dict (old configs say "type")."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """float32 [rope_dim / 2]: the rotation speed of each pair of rotated dimensions."""
    d = cfg.rope_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_freq_factors is not None:
        inv = inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    kind = rope_type(cfg.rope_scaling)
    scaling = cfg.rope_scaling or {}
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        inv = _llama3(inv, scaling, cfg.max_position_embeddings)
    elif kind != "default":
        raise ValueError(f"rope scaling {kind!r} is not supported")
    return inv


def _llama3(inv: torch.Tensor, s: dict[str, Any], max_positions: int) -> torch.Tensor:
    """Llama 3.1: slow the low frequencies by `factor`, keep the high ones, blend between."""
    factor = float(s["factor"])
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", max_positions))
    wavelen = 2 * math.pi / inv
    slowed = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, blended, slowed)


def rope_tables(
    inv_freq: torch.Tensor, n_positions: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin, each [n_positions, rope_dim] in `dtype`.

    The sin table's first half is negated so that `apply_rope` needs a roll
    instead of a negate-and-concatenate.
    """
    inv = inv_freq.to(device=device, dtype=torch.float32)
    pos = torch.arange(n_positions, device=device, dtype=torch.float32)
    freqs = pos[:, None] * inv[None, :]
    cos = freqs.cos()
    sin = freqs.sin()
    cos_table = torch.cat((cos, cos), dim=-1).to(dtype)
    sin_table = torch.cat((-sin, sin), dim=-1).to(dtype)
    return cos_table, sin_table


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated; cos/sin [T, 1, D] rows of `rope_tables`."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with only its first cos.shape[-1] dimensions rotated (a partial rotary factor),
    the rest passed through."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
