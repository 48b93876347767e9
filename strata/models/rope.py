"""Rotary position embeddings: inverse frequencies (with scaling) and lookup tables.

The tables hold cos and a sign-folded sin for every position, in the compute
dtype, so a forward step gathers its rows by position once and each attention
layer spends four elementwise ops on RoPE. The arithmetic mirrors Hugging
Face's `rotate_half` form (products rounded to the compute dtype, then
summed), so results match it bit for bit in every dtype.

Scaling kinds: `linear` (positions divided by the factor), `llama3` (low
frequencies slowed, high ones kept, a blend between), `yarn` (the same
three bands by rotation count, plus an attention factor on cos and sin) and
`dynamic` (NTK: a larger base). transformers recomputes a dynamic base for
the current sequence length on every forward, but Strata keeps K rotated in
the pool, so a base that changed with the length would leave the cached
keys rotated by another one. Strata follows vLLM instead: one fixed base,
the one transformers would pick at `max_position_embeddings * factor`
tokens, for every position (llama.cpp has no dynamic kind).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from strata.models.base import ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The scaling kind of an HF-style dict (old configs say "type")."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def is_scaled(cfg: ModelConfig) -> bool:
    """Whether the model's RoPE is stretched: a scaling kind, or llama.cpp's rope_freqs factors."""
    return cfg.rope_scaling is not None or cfg.rope_freq_factors is not None


def trained_context(cfg: ModelConfig) -> int:
    """Tokens the model is meant to see: max_position_embeddings, or what its scaling stretches
    the original length to (yarn: original x factor, dynamic: max_position_embeddings x
    factor, as vLLM counts them); linear and llama3 configs already give the stretched length."""
    kind = rope_type(cfg.rope_scaling)
    s = cfg.rope_scaling or {}
    if kind == "yarn":
        return max(cfg.max_position_embeddings, int(_yarn_original(cfg, s) * _yarn_factor(cfg, s)))
    if kind == "dynamic":
        return int(cfg.max_position_embeddings * float(s["factor"]))
    return cfg.max_position_embeddings


def attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's `attention_factor` (given, or from the factor
    and `mscale`/`mscale_all_dim` as transformers derives it); 1 for every other kind."""
    s = cfg.rope_scaling or {}
    if rope_type(s) != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = _yarn_factor(cfg, s)
    mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all:
        return _mscale(factor, float(mscale)) / _mscale(factor, float(mscale_all))
    return _mscale(factor, 1.0)


def _mscale(factor: float, mscale: float) -> float:
    """The YaRN paper's attention temperature: 0.1 * mscale * ln(factor) + 1 (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """float32 [rope_dim / 2]: the rotation speed of each pair of rotated dimensions."""
    d = cfg.rope_dim
    kind = rope_type(cfg.rope_scaling)
    scaling = cfg.rope_scaling or {}
    if kind == "yarn":
        return _yarn(cfg, scaling)
    theta = _dynamic_base(cfg, scaling) if kind == "dynamic" else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_freq_factors is not None:
        inv = inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        inv = _llama3(inv, scaling, cfg.max_position_embeddings)
    elif kind not in ("default", "dynamic"):
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


def _yarn_factor(cfg: ModelConfig, s: dict[str, Any]) -> float:
    """YaRN's stretch: `factor`, or (left out, as DeepSeek-V3 does) the lengths' ratio."""
    if s.get("factor") is not None:
        return float(s["factor"])
    return cfg.max_position_embeddings / _yarn_original(cfg, s)


def _yarn_original(cfg: ModelConfig, s: dict[str, Any]) -> int:
    return int(s.get("original_max_position_embeddings") or cfg.max_position_embeddings)


def _yarn(cfg: ModelConfig, s: dict[str, Any]) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than `beta_slow` times over the original length are
    interpolated (slowed by the factor), those turning more than `beta_fast` times are kept,
    a linear ramp between (its ends rounded outwards unless `truncate` is false)."""
    d, base = cfg.rope_dim, cfg.rope_theta
    factor = _yarn_factor(cfg, s)
    original = _yarn_original(cfg, s)
    fast = float(s.get("beta_fast") or 32)
    slow = float(s.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # a ramp of width zero would divide by zero
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of each dimension left at its original speed
    periods = base ** (torch.arange(0, d, 2).float() / d)
    return (1.0 / (factor * periods)) * (1 - kept) + (1.0 / periods) * kept


def _dynamic_base(cfg: ModelConfig, s: dict[str, Any]) -> float:
    """Dynamic NTK's base, fixed where vLLM fixes it: transformers' formula at a sequence of
    max_position_embeddings x factor tokens, theta * (factor^2 - factor + 1)^(d / (d - 2))."""
    factor, d = float(s["factor"]), cfg.rope_dim
    longest = cfg.max_position_embeddings * factor
    stretch = factor * longest / cfg.max_position_embeddings - (factor - 1)
    return cfg.rope_theta * stretch ** (d / (d - 2))


def config_tables(cfg: ModelConfig, n_positions: int, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE tables of a model config: its frequencies and its attention factor."""
    return rope_tables(inverse_frequencies(cfg), n_positions, dtype, device, attention_factor(cfg))


def rope_tables(
    inv_freq: torch.Tensor, n_positions: int, dtype: torch.dtype, device: torch.device,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin, each [n_positions, rope_dim] in `dtype`, times `scale` (YaRN's
    attention factor; multiplied in float32 before the cast, as transformers does).

    The sin table's first half is negated so that `apply_rope` needs a roll
    instead of a negate-and-concatenate.
    """
    inv = inv_freq.to(device=device, dtype=torch.float32)
    pos = torch.arange(n_positions, device=device, dtype=torch.float32)
    freqs = pos[:, None] * inv[None, :]
    cos = freqs.cos()
    sin = freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
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
