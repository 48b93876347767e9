"""Which stored tensors make each parameter of `DecoderModel`.

A fused parameter (qkv_proj, gate_up_proj) is several stored tensors stacked
along rows, so each parameter maps to a list of `Part`s: the stored name, how
many rows it contributes, and an optional fix-up applied after loading (the
llama Q/K row order of GGUF files). A row order that spans the parts (a
Qwen3-Next DeltaNet's q|k|v and z tensors back into Hugging Face's per-head
groups) is a part's `join`, applied to the stacked parameter.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from strata.models.architecture import Architecture
from strata.models.base import ModelConfig

Fix = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Part:
    name: str  # the tensor's name in the file
    rows: int  # rows it fills in the parameter (dim 0)
    fix: Fix | None = None
    # the stored tensor has the slot's values in another shape (one expert's [I, H] matrix is a
    # row of [E, I, H]; a [H] gate vector is the [1, H] weight): read, then reshaped
    reshape: bool = False
    exact: bool = False  # read in float32, fixed, then cast: the fix must not round in the compute dtype
    # a row order across the parts, applied to the whole parameter once they are stacked: rows
    # move whole, so the file's block rows take it too (`block_install`)
    join: Fix | None = None


_LAYER = re.compile(r"layers\.(\d+)\.(.+)")

_HF_LAYER = {
    "input_layernorm.weight": ["input_layernorm.weight"],
    "post_attention_layernorm.weight": ["post_attention_layernorm.weight"],
    "pre_feedforward_layernorm.weight": ["pre_feedforward_layernorm.weight"],  # gemma3's sandwich norms
    "post_feedforward_layernorm.weight": ["post_feedforward_layernorm.weight"],
    "self_attn.o_proj.weight": ["self_attn.o_proj.weight"],
    "self_attn.q_norm.weight": ["self_attn.q_norm.weight"],
    "self_attn.k_norm.weight": ["self_attn.k_norm.weight"],
    "mlp.down_proj.weight": ["mlp.down_proj.weight"],
    "self_attn.qkv_proj.weight": [f"self_attn.{p}_proj.weight" for p in "qkv"],
    "self_attn.qkv_proj.bias": [f"self_attn.{p}_proj.bias" for p in "qkv"],
    "mlp.gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.shared.gate_up_proj.weight": ["mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"],
    "mlp.shared.down_proj.weight": ["mlp.shared_expert.down_proj.weight"],
    "mlp.shared_gate.weight": ["mlp.shared_expert_gate.weight"],
    **{f"linear_attn.{n}": [f"linear_attn.{n}"] for n in (
        "in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight",
        "out_proj.weight")},
}
# a sparse layer's experts: one stored matrix per expert, stacked (`Part.reshape`); the names
# come from `Architecture.hf_experts`
_HF_EXPERTS = {"mlp.experts.gate": 1, "mlp.experts.up": 2, "mlp.experts.down": 3}

_GGUF_LAYER = {
    "input_layernorm.weight": ["attn_norm.weight"],
    "post_attention_layernorm.weight": ["ffn_norm.weight"],
    "self_attn.o_proj.weight": ["attn_output.weight"],
    "self_attn.q_norm.weight": ["attn_q_norm.weight"],
    "self_attn.k_norm.weight": ["attn_k_norm.weight"],
    "mlp.down_proj.weight": ["ffn_down.weight"],
    "self_attn.qkv_proj.weight": ["attn_q.weight", "attn_k.weight", "attn_v.weight"],
    "self_attn.qkv_proj.bias": ["attn_q.bias", "attn_k.bias", "attn_v.bias"],
    "mlp.gate_up_proj.weight": ["ffn_gate.weight", "ffn_up.weight"],
    "mlp.router.weight": ["ffn_gate_inp.weight"],
    "mlp.experts.gate": ["ffn_gate_exps.weight"],  # [E, I, H] tensors: all experts in one
    "mlp.experts.up": ["ffn_up_exps.weight"],
    "mlp.experts.down": ["ffn_down_exps.weight"],
    "mlp.shared.gate_up_proj.weight": ["ffn_gate_shexp.weight", "ffn_up_shexp.weight"],
    "mlp.shared.down_proj.weight": ["ffn_down_shexp.weight"],
}
_GGUF_VECTORS = {"mlp.shared_gate.weight": "ffn_gate_inp_shexp.weight"}  # stored as [H]
# a gated DeltaNet's tensors as llama.cpp's converter names them (gguf-py's SSM_* names);
# in_proj_qkvz is two tensors there and A_log is stored transformed (`_gguf_linear_attention`)
_GGUF_LINEAR = {
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}

_GGUF_TOP = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _rows(cfg: ModelConfig, rest: str, rows: int, n: int) -> list[int]:
    """Row counts of the n parts of a parameter with `rows` rows."""
    if rest.startswith("self_attn.qkv_proj"):
        kv = cfg.num_kv_heads * cfg.head_dim
        q = cfg.num_heads * cfg.head_dim
        return [2 * q if cfg.attn_output_gate else q, kv, kv]  # the output gate's rows ride with q
    return [rows // n] * n


def hf_parts(param: str, rows: int, cfg: ModelConfig, arch: Architecture) -> list[Part]:
    """Parts of `param` in a Hugging Face checkpoint (names under "model."; an MTP head's, whose
    layer is named as a model layer, under "mtp.")."""
    if param.startswith("mtp."):
        return [dataclasses.replace(p, name="mtp." + p.name.removeprefix("model."))
                for p in hf_parts(param.removeprefix("mtp."), rows, cfg, arch)]
    if param == "lm_head.weight":
        return [Part("lm_head.weight", rows)]
    m = _LAYER.fullmatch(param)
    if m is None:
        return [Part(f"model.{param}", rows)]
    layer, rest = m.groups()
    moe = arch.hf_experts
    if rest in _HF_EXPERTS:
        return [Part(f"model.layers.{layer}.{moe[0]}.experts.{e}.{moe[_HF_EXPERTS[rest]]}.weight", 1, reshape=True)
                for e in range(rows)]
    if rest == "mlp.router.weight":
        return [Part(f"model.layers.{layer}.{moe[0]}.gate.weight", rows)]
    names = _HF_LAYER[rest]
    counts = _rows(cfg, rest, rows, len(names))
    return [Part(f"model.layers.{layer}.{n}", r) for n, r in zip(names, counts, strict=True)]


def unpermute_rows(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order.

    Its converter stores each head's rows as interleaved (even, odd) pairs for
    its own RoPE kernel; Hugging Face's layout keeps the two halves apart.
    Works on weights [rows, in] and biases [rows].
    """
    rows = t.shape[0]
    half = rows // n_heads // 2
    rest = t.shape[1:]
    return t.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def _norm_offset(arch: Architecture) -> Fix:
    """llama.cpp stores Gemma's norm weights w as the factor 1 + w: back to w."""
    return lambda t: t - arch.gguf_norm_offset


def grouped_qkvz(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """A DeltaNet's in_proj_qkvz rows from llama.cpp's order back to Hugging Face's.

    llama.cpp's converter stores all q rows, then all k, v (its attn_qkv tensor) and z (attn_gate);
    Hugging Face keeps, per key head, its q and k rows and then the v and z rows of the value heads
    that read it.
    """
    hk = cfg.linear_num_key_heads
    key, value = hk * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
    pieces = t.split((key, key, value, value), dim=0)
    return torch.cat([p.reshape(hk, -1, *t.shape[1:]) for p in pieces], dim=1).reshape(t.shape)


def _gguf_linear_attention(rest: str, layer: str, rows: int, cfg: ModelConfig,
                           stored: Collection[str]) -> list[Part]:
    """Parts of a DeltaNet parameter: the converter's transforms undone.

    It splits in_proj_qkvz into attn_qkv and attn_gate in its own row order (older files keep it
    whole, in Hugging Face's order, as ssm_in), stores A_log as ssm_a = -exp(A_log) and the
    convolution's [C, 1, K] weight as [C, K]; the rest is as stored.
    """
    blk = f"blk.{layer}."
    if rest == "linear_attn.in_proj_qkvz.weight":
        if blk + "ssm_in.weight" in stored:
            return [Part(blk + "ssm_in.weight", rows)]
        value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        return [Part(blk + "attn_qkv.weight", rows - value),
                Part(blk + "attn_gate.weight", value, join=lambda t: grouped_qkvz(t, cfg))]
    name = blk + _GGUF_LINEAR[rest]
    if rest == "linear_attn.A_log":
        return [Part(name, rows, lambda t: torch.log(-t), exact=True)]
    return [Part(name, rows, reshape=rest == "linear_attn.conv1d.weight")]


def gguf_parts(param: str, rows: int, cfg: ModelConfig, arch: Architecture,
               stored: Collection[str] = ()) -> list[Part]:
    """Parts of `param` in a GGUF file (llama.cpp's names); `stored`: the file's tensor names,
    where a parameter has more than one way to be stored."""
    offset = bool(arch.gguf_norm_offset) and param.endswith("norm.weight")
    if param in _GGUF_TOP:
        return [Part(_GGUF_TOP[param], rows, _norm_offset(arch) if offset else None, exact=offset)]
    m = _LAYER.fullmatch(param)
    if m is None:
        raise KeyError(param)
    layer, rest = m.groups()
    if rest.startswith("linear_attn."):  # its gated norm is a plain scale: stored without the offset
        return _gguf_linear_attention(rest, layer, rows, cfg, stored)
    if rest in _GGUF_VECTORS:
        return [Part(f"blk.{layer}.{_GGUF_VECTORS[rest]}", rows, reshape=True)]
    own = dict(arch.gguf_layer_names)
    names = [own[rest]] if rest in own else _GGUF_LAYER[rest]
    if offset:
        return [Part(f"blk.{layer}.{names[0]}", rows, _norm_offset(arch), exact=True)]
    counts = _rows(cfg, rest, rows, len(names))
    fixes: list[Fix | None] = [None] * len(names)
    if arch.gguf_qk_permuted and rest.startswith("self_attn.qkv_proj"):
        fixes[0] = lambda t: unpermute_rows(t, cfg.num_heads)
        fixes[1] = lambda t: unpermute_rows(t, cfg.num_kv_heads)
    return [Part(f"blk.{layer}.{n}", r, f) for n, r, f in zip(names, counts, fixes, strict=True)]
