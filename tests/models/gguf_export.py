"""Write a tiny transformers model as a GGUF file, the way llama.cpp's converter lays it out.

That means llama.cpp's tensor names, llama's Q/K rows permuted for its RoPE
kernel, Llama 3 rope scaling as a `rope_freqs.weight` tensor, Gemma's norm
weights stored as 1 + w with its sandwich norms' own names, Qwen3-Next's
DeltaNet tensors transformed as llama.cpp's converter does it
(`_qwen3next_tensors`), and some tensors quantized, so loading it exercises
every path of the GGUF loader.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType
from gguf.quants import quantize

LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}

# gemma3's names where they differ from llama's (gguf-py's ATTN_POST_NORM, FFN_PRE_NORM, FFN_POST_NORM)
GEMMA3_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}

# qwen3next's names where they differ from llama's (gguf-py's ATTN_POST_NORM and SSM_* tensors)
QWEN3NEXT_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "linear_attn.in_proj_ba": "ssm_ba",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
}

# the quantized types of this test file: at least one of each block family
DEFAULT_TYPES = {
    "attn_q.weight": Q.Q8_0,
    "attn_k.weight": Q.Q8_0,
    "ffn_down.weight": Q.Q8_0,
    "ffn_gate.weight": Q.Q4_0,
    "token_embd.weight": Q.F16,
}


def _tensors(model: torch.nn.Module, arch: str, legacy: bool = False) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 data) of every tensor; transformers 5 holds a layer's experts as
    fused [E, 2I, H] gate/up and [E, H, I] down parameters, which llama.cpp stores as
    ffn_gate_exps, ffn_up_exps and ffn_down_exps."""
    out = []
    for hf_name, t in model.state_dict().items():
        data = t.detach().float().numpy()
        if ".mlp.experts.gate_up_proj" in hf_name:
            layer = hf_name.split(".")[2]
            gate, up = np.split(data, 2, axis=1)
            out += [(f"blk.{layer}.ffn_gate_exps.weight", gate), (f"blk.{layer}.ffn_up_exps.weight", up)]
        elif ".mlp.experts.down_proj" in hf_name:
            out.append((f"blk.{hf_name.split('.')[2]}.ffn_down_exps.weight", data))
        elif hf_name.endswith("mlp.shared_expert_gate.weight"):
            out.append((gguf_name(hf_name), data.reshape(-1)))  # llama.cpp keeps it as a vector
        elif arch == "gemma3" and hf_name.endswith("norm.weight"):
            out.append((gguf_name(hf_name, arch), data + 1))  # llama.cpp's converter adds Gemma's 1
        elif arch == "qwen3next":
            out += _qwen3next_tensors(hf_name, data, model.config, legacy)
        else:
            out.append((gguf_name(hf_name, arch), data))
    return out


def _qwen3next_tensors(hf_name: str, data: np.ndarray, cfg, legacy: bool) -> list[tuple[str, np.ndarray]]:
    """What llama.cpp's converter (`Qwen3NextModel.modify_tensors`) makes of one tensor.

    A_log becomes ssm_a = -exp(A_log), dt_bias ssm_dt.bias, the [C, 1, K] convolution [C, K];
    every norm but the DeltaNet's gated one is stored as 1 + w; in_proj_qkvz (per key head: q, k,
    then its value heads' v and z rows) becomes attn_qkv (all q rows, all k, all v) and
    attn_gate (all z rows), or with `legacy` (the converter's first version) ssm_in as it is."""
    layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
    if hf_name.endswith(".linear_attn.A_log"):
        return [(f"blk.{layer}.ssm_a", -np.exp(data))]
    if hf_name.endswith(".linear_attn.dt_bias"):
        return [(f"blk.{layer}.ssm_dt.bias", data)]
    if hf_name.endswith(".linear_attn.conv1d.weight"):
        return [(gguf_name(hf_name, "qwen3next"), data.squeeze(1))]
    if hf_name.endswith(".linear_attn.in_proj_qkvz.weight") and legacy:
        return [(f"blk.{layer}.ssm_in.weight", data)]
    if hf_name.endswith(".linear_attn.in_proj_qkvz.weight"):
        hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        group = cfg.linear_num_value_heads // hk * dv
        q, k, v, z = np.split(data.reshape(hk, -1, data.shape[1]), np.cumsum([dk, dk, group]), axis=1)
        flat = [x.reshape(-1, data.shape[1]) for x in (q, k, v, z)]
        return [(f"blk.{layer}.attn_qkv.weight", np.concatenate(flat[:3])),
                (f"blk.{layer}.attn_gate.weight", flat[3])]
    name = gguf_name(hf_name, "qwen3next")
    if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
        return [(name, data + 1)]
    return [(name, data)]


def _add_qwen3next(w: GGUFWriter, cfg, head_dim: int) -> None:
    """The converter's `set_gguf_parameters` additions: Mamba's keys for the DeltaNet sizes, the
    interval of full-attention layers, and the rotated part of a head as the RoPE dimension."""
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(getattr(cfg, "full_attention_interval", None) or 4)
    w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.25)))


def _add_experts(w: GGUFWriter, cfg) -> None:
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if not experts:
        return
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = {"gemma3": {**LAYER_NAMES, **GEMMA3_NAMES},
             "qwen3next": {**LAYER_NAMES, **QWEN3NEXT_NAMES}}.get(arch, LAYER_NAMES)
    return f"blk.{layer}.{names[module]}.{kind}"


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's two rotary halves become interleaved row pairs."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_freq_factors(cfg) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs.weight for Llama 3 scaling."""
    p = cfg.rope_parameters
    dim = cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (p["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _add_gemma3(w: GGUFWriter, cfg) -> None:
    """The window and its layers, the local RoPE base, the attention scale and the logit cap.

    llama.cpp's converter writes only the window and the cap and fixes the rest for the
    architecture; the layers are left to that rule (every 6th global) when they follow it."""
    w.add_sliding_window(cfg.sliding_window)
    pattern = [t == "sliding_attention" for t in cfg.layer_types]
    if pattern != [bool((i + 1) % 6) for i in range(cfg.num_hidden_layers)]:
        w.add_sliding_window_pattern(pattern)
    w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    w.add_attention_scale(cfg.query_pre_attn_scalar**-0.5)
    if cfg.final_logit_softcapping is not None:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)


def _add_yarn(w: GGUFWriter, rope: dict) -> None:
    """YaRN's keys as llama.cpp's converter writes them: the optional ones only when given."""
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("attention_factor") is not None:
        w.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
    if rope.get("beta_fast") is not None:
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    if rope.get("beta_slow") is not None:
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def copy_tokenizer(w: GGUFWriter, path: str) -> None:
    """Every `tokenizer.*` entry of another GGUF, except the BOS and EOS ids the writer sets."""
    from gguf import GGUFReader, GGUFValueType

    for field in GGUFReader(path).fields.values():
        if not field.name.startswith("tokenizer.") or field.name.endswith(("bos_token_id", "eos_token_id")):
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), kind, sub)


def write_gguf(
    model: torch.nn.Module,
    path: Path,
    arch: str,
    types: dict[str, Q] | None = None,
    raw: dict[str, tuple[np.ndarray, Q]] | None = None,
    skip: tuple[str, ...] = (),
    legacy: bool = False,
    tokenizer_from: str | None = None,
) -> Path:
    """`types`: tensor-name suffix -> GGML type (F32 otherwise); `raw`: tensors written as
    given bytes; `skip`: full tensor names left out; `legacy`: an older converter's layout
    (qwen3next's ssm_in); `tokenizer_from`: a GGUF whose tokenizer the file carries (the model's
    vocabulary must be its size)."""
    types = DEFAULT_TYPES if types is None else types
    raw = raw or {}
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.rope_parameters
    if arch == "qwen3next":
        _add_qwen3next(w, cfg, head_dim)
    else:
        w.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        _add_gemma3(w, cfg)
        rope = rope["full_attention"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    _add_experts(w, cfg)
    if tokenizer_from is not None:
        copy_tokenizer(w, tokenizer_from)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_freq_factors(cfg))
    elif rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        _add_yarn(w, rope)
    tied = cfg.tie_word_embeddings
    for name, data in _tensors(model, arch, legacy):
        if tied and name == "output.weight":
            continue
        if name in skip:
            continue
        if arch == "llama" and ".attn_q." in name:
            data = permute_rows(data, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            data = permute_rows(data, cfg.num_key_value_heads)
        suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if suffix in raw:
            blob, kind = raw[suffix]
            w.add_tensor(name, blob, raw_dtype=kind)
            continue
        kind = types.get(suffix, Q.F32)
        if kind == Q.F32:
            w.add_tensor(name, data)
        elif kind == Q.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
