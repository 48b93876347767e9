"""ModelConfig from a Hugging Face config.json or from GGUF metadata.

Everything a loaded model cannot honour (an unknown architecture, a rope
scaling kind, sliding windows outside gemma3, MLP biases) is refused here
with a ModelLoadError, before any weight is read.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, NoReturn

from strata.errors import ModelLoadError
from strata.models import registry
from strata.models.architecture import Architecture
from strata.models.base import ModelConfig
from strata.models.rope import SUPPORTED_ROPE_TYPES, rope_type


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _check_rope(path: str, scaling: dict[str, Any] | None, original: Any = None) -> dict[str, Any] | None:
    """The scaling dict a ModelConfig keeps (None: plain RoPE). `original`: a config's top-level
    original_max_position_embeddings, which transformers puts in a llama3 or yarn dict."""
    kind = rope_type(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        _unsupported_rope(path, kind)
    if kind == "default" or scaling is None:
        return None
    factor = scaling.get("factor")
    if kind in ("linear", "llama3", "dynamic") and factor is None:
        raise ModelLoadError(path, f"rope scaling {kind!r} lacks its factor")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0):
        raise ModelLoadError(path, f"rope scaling {kind!r} has factor {factor!r}, not a positive number")
    out = {"rope_type": kind, **{k: v for k, v in scaling.items() if k not in ("type", "rope_type", "rope_theta")}}
    if kind in ("llama3", "yarn") and original is not None:
        out["original_max_position_embeddings"] = int(original)
    return out


def _unsupported_rope(path: str, kind: str) -> NoReturn:
    scalings = ", ".join(k for k in SUPPORTED_ROPE_TYPES if k != "default")
    raise ModelLoadError(path, f"rope scaling {kind!r} is not supported (supported: {scalings})")


def _hf_architecture(path: str, d: dict[str, Any]) -> Architecture:
    model_type = str(d.get("model_type", ""))
    arch = registry.by_hf_model_type(model_type)
    if arch is None:
        named = model_type or ", ".join(d.get("architectures") or []) or "(none given)"
        raise ModelLoadError(
            path, f"unsupported architecture {named}; supported: {registry.supported()}"
        )
    return arch


def config_from_hf(path: str, d: dict[str, Any]) -> tuple[Architecture, ModelConfig]:
    """Read a config.json dict (transformers 4.x or 5.x layout)."""
    arch = _hf_architecture(path, d)

    def need(key: str) -> Any:
        if d.get(key) is None:
            raise ModelLoadError(path, f"config.json lacks {key!r}")
        return d[key]

    act = d.get("hidden_activation") or d.get("hidden_act") or arch.activation
    if act != arch.activation:
        raise ModelLoadError(path, f"activation {act!r} is not supported (only {arch.activation})")
    if d.get("mlp_bias"):
        raise ModelLoadError(path, "MLP biases are not supported")
    if d.get("use_sliding_window"):
        raise ModelLoadError(path, "sliding-window attention is not supported")
    if d.get("use_bidirectional_attention"):
        raise ModelLoadError(path, "bidirectional attention is not supported")
    if d.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(path, "attention logit soft-capping is not supported")
    params = d.get("rope_parameters") or {}
    local: dict[str, Any] = {}
    if "full_attention" in params or "sliding_attention" in params:  # per layer type (gemma3)
        local = params.get("sliding_attention") or {}
        params = params.get("full_attention") or {}
    if rope_type(local) != "default":
        raise ModelLoadError(path, f"rope scaling {rope_type(local)!r} on sliding layers is not supported")
    partial = float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    if partial != 1.0 and not arch.partial_rotary:
        raise ModelLoadError(path, "partial rotary embeddings are not supported")
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    scaling = _check_rope(path, d.get("rope_scaling") or params or None, d.get("original_max_position_embeddings"))

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    bias = arch.attention_bias
    if bias is None and d.get("attention_bias") is None:
        bias = bool(d.get("qkv_bias", False))  # qwen2_moe's spelling
    layers = int(need("num_hidden_layers"))
    ffn = int(need("intermediate_size"))
    scalar = d.get("query_pre_attn_scalar")
    cap = d.get("final_logit_softcapping")
    head_dim = int(d.get("head_dim") or arch.default_head_dim or hidden // heads)
    cfg = ModelConfig(
        arch=arch.name,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
        attn_output_gate=arch.attn_output_gate,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", arch.hf_tied)),
        attention_bias=bool(d.get("attention_bias", False)) if bias is None else bias,
        qk_norm=arch.qk_norm,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos_list(d.get("eos_token_id")),
        query_pre_attn_scalar=None if scalar is None else float(scalar),
        final_logit_softcap=None if cap is None else float(cap),
        **_hf_sliding(path, d, arch, layers, local),
        **_hf_experts(path, d, arch, ffn, layers),
        **_hf_linear_attention(path, d, layers),
    )
    return arch, cfg


def _every_nth_global(layers: int, n: int) -> tuple[int, ...]:
    """Layers that slide when every n-th is global (transformers' and llama.cpp's pattern)."""
    return tuple(i for i in range(layers) if n and (i + 1) % n)


def _hf_sliding(path: str, d: dict[str, Any], arch: Architecture, layers: int,
                local: dict[str, Any]) -> dict[str, Any]:
    """The sliding-window fields of a config.json: `layer_types`, else the architecture's
    pattern (or the config's `sliding_window_pattern`); none without a window."""
    window = d.get("sliding_window")
    if not arch.sliding_pattern or window is None:
        return {}
    types = d.get("layer_types")
    if types is None:
        sliding = _every_nth_global(layers, int(d.get("sliding_window_pattern") or arch.sliding_pattern))
    else:
        if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
            raise ModelLoadError(path, f"layer_types {types} is not one of sliding_attention or "
                                       f"full_attention for each of {layers} layers")
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    theta = local.get("rope_theta", d.get("rope_local_base_freq", arch.local_rope_theta))
    return dict(sliding_window=int(window), sliding_layers=sliding,
                rope_local_theta=None if theta is None else float(theta))


def _gguf_sliding(path: str, a: str, get: Any, arch: Architecture, layers: int) -> dict[str, Any]:
    """The sliding-window fields of GGUF metadata: `{a}.attention.sliding_window`, the layers from
    `.sliding_window_pattern` (every n-th global, or one flag a layer) or the architecture's."""
    window = get("attention.sliding_window")
    if not window:
        return {}
    pattern = get("attention.sliding_window_pattern", arch.sliding_pattern)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers:
            raise ModelLoadError(path, f"{a}.attention.sliding_window_pattern has {len(pattern)} "
                                       f"entries for {layers} layers")
        sliding = tuple(i for i, flag in enumerate(pattern) if flag)
    else:
        sliding = _every_nth_global(layers, int(pattern))
    theta = get("rope.freq_base_swa", arch.local_rope_theta)
    return dict(sliding_window=int(window), sliding_layers=sliding,
                rope_local_theta=None if theta is None else float(theta))


def _hf_linear_attention(path: str, d: dict[str, Any], layers: int) -> dict[str, Any]:
    """The gated DeltaNet fields of a config.json (qwen3_next's layer_types and linear_*); none
    for a model of full-attention layers only."""
    types = tuple(str(t) for t in d.get("layer_types") or ())
    if "linear_attention" not in types:
        return {}
    if len(types) != layers or not set(types) <= {"linear_attention", "full_attention"}:
        raise ModelLoadError(path, f"layer_types {list(types)} is not one of linear_attention or "
                                   f"full_attention for each of {layers} layers")
    dims = {k: int(d.get(k) or 0) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                            "linear_key_head_dim", "linear_value_head_dim",
                                            "linear_conv_kernel_dim")}
    if not all(dims.values()) or dims["linear_num_value_heads"] % dims["linear_num_key_heads"]:
        raise ModelLoadError(path, f"linear-attention sizes {dims} are incomplete or the value heads "
                                   f"are not a multiple of the key heads")
    return dict(layer_types=types, linear_num_key_heads=dims["linear_num_key_heads"],
                linear_num_value_heads=dims["linear_num_value_heads"],
                linear_key_head_dim=dims["linear_key_head_dim"],
                linear_value_head_dim=dims["linear_value_head_dim"],
                linear_conv_kernel=dims["linear_conv_kernel_dim"])


def _hf_experts(path: str, d: dict[str, Any], arch: Architecture, ffn: int, layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a config.json (qwen3_moe, qwen2_moe, mixtral); none for
    a dense model."""
    experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    if not experts:
        return {}
    k = int(d.get("num_experts_per_tok") or 0)
    if not 0 < k <= experts:
        raise ModelLoadError(path, f"num_experts_per_tok {k} is not within 1..{experts} experts")
    step = int(d.get("decoder_sparse_step") or 1)
    only_dense = {int(i) for i in d.get("mlp_only_layers") or []}
    norm = arch.hf_norm_topk if arch.hf_norm_topk is not None else bool(d.get("norm_topk_prob", False))
    return dict(num_experts=experts, experts_per_token=k,
                expert_ffn=int(d.get("moe_intermediate_size") or ffn), norm_topk_prob=norm,
                shared_expert_ffn=int(d.get("shared_expert_intermediate_size") or 0),
                dense_layers=tuple(i for i in range(layers) if i in only_dense or (i + 1) % step))


def _gguf_experts(path: str, a: str, get: Any, arch: Architecture, ffn: int, layers: int,
                  tensor_names: Collection[str]) -> dict[str, Any]:
    """The mixture-of-experts fields of GGUF metadata (`{arch}.expert_*`); none for a dense file.
    Layers without a router tensor keep a dense MLP."""
    experts = int(get("expert_count", 0) or 0)
    if not experts:
        return {}
    k = int(get("expert_used_count", 0) or 0)
    if not 0 < k <= experts:
        raise ModelLoadError(path, f"{a}.expert_used_count {k} is not within 1..{experts} experts")
    dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names)
    if dense and not ffn:
        raise ModelLoadError(path, f"layers {list(dense)} have no experts and the file gives "
                                   f"no {a}.feed_forward_length for their dense MLP")
    return dict(num_experts=experts, experts_per_token=k,
                expert_ffn=int(get("expert_feed_forward_length", ffn)),
                norm_topk_prob=bool(get("expert_weights_norm", arch.gguf_norm_topk)),
                shared_expert_ffn=int(get("expert_shared_feed_forward_length", 0) or 0), dense_layers=dense)


def gguf_architecture(path: str, metadata: dict[str, Any]) -> Architecture:
    name = str(metadata.get("general.architecture", ""))
    arch = registry.by_gguf_name(name)
    if arch is None:
        raise ModelLoadError(
            path,
            f"unsupported architecture {name or '(none given)'}; supported: {registry.supported()}",
        )
    return arch


def _uniform(path: str, key: str, value: Any) -> int:
    """GGUF allows per-layer arrays for some counts; accept them only when all equal."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ModelLoadError(path, f"{key} differs between layers, which is not supported")
        value = value[0]
    return int(value)


def config_from_gguf(
    path: str,
    metadata: dict[str, Any],
    tensor_names: Collection[str],
    rope_freq_factors: list[float] | None,
) -> tuple[Architecture, ModelConfig]:
    """Map `{arch}.*` and `tokenizer.ggml.*` metadata to a ModelConfig."""
    arch = gguf_architecture(path, metadata)
    a = arch.name

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{a}.{key}", default)

    def need(key: str) -> Any:
        if get(key) is None:
            raise ModelLoadError(path, f"GGUF metadata lacks {a}.{key}")
        return get(key)

    hidden = int(need("embedding_length"))
    layers = int(need("block_count"))
    ffn = int(get("feed_forward_length", 0) if get("expert_count") else need("feed_forward_length"))
    heads = _uniform(path, f"{a}.attention.head_count", need("attention.head_count"))
    kv_heads = _uniform(path, f"{a}.attention.head_count_kv", get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(path, "different key and value head sizes are not supported")
    rotary = int(get("rope.dimension_count", head_dim))
    if rotary != head_dim and not (arch.partial_rotary and 0 < rotary < head_dim and rotary % 2 == 0):
        raise ModelLoadError(path, f"partial rotary embeddings ({a}.rope.dimension_count {rotary} of a "
                                   f"head of {head_dim}) are not supported")

    vocab = get("vocab_size")
    if vocab is None and metadata.get("tokenizer.ggml.tokens") is not None:
        vocab = len(metadata["tokenizer.ggml.tokens"])
    if vocab is None:
        raise ModelLoadError(
            path, f"GGUF metadata gives no vocabulary size ({a}.vocab_size or tokens)"
        )

    scaling = _gguf_rope_scaling(path, a, get, rope_freq_factors)

    if get("attn_logit_softcapping") is not None:
        raise ModelLoadError(path, "attention logit soft-capping is not supported")
    scale = get("attention.scale")
    scalar = (None if arch.gguf_query_scalar is None
              else float(arch.gguf_query_scalar(layers, hidden, heads, head_dim)))
    if scale is not None:
        scalar = float(scale) ** -2
    cap = get("final_logit_softcapping")
    bias = arch.attention_bias
    cfg = ModelConfig(
        arch=a,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary if rotary != head_dim else 0,
        attn_output_gate=arch.attn_output_gate,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rope_freq_factors=rope_freq_factors,
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=("blk.0.attn_q.bias" in tensor_names) if bias is None else bias,
        qk_norm=arch.qk_norm,
        bos_token_id=_opt_int(metadata.get("tokenizer.ggml.bos_token_id")),
        eos_token_ids=list(
            dict.fromkeys(
                int(metadata[k])
                for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                if metadata.get(k) is not None
            )
        ),
        query_pre_attn_scalar=scalar,
        final_logit_softcap=None if cap is None else float(cap),
        **_gguf_sliding(path, a, get, arch, layers),
        **_gguf_experts(path, a, get, arch, ffn, layers, tensor_names),
        **_gguf_linear_attention(path, a, get, layers),
    )
    return arch, cfg


def _gguf_rope_scaling(path: str, a: str, get: Any, freq_factors: list[float] | None) -> dict[str, Any] | None:
    """`{arch}.rope.scaling.*` as the HF-style dict inverse_frequencies reads: linear (also the
    old `.rope.scale_linear`), or yarn with the keys llama.cpp's converter writes (factor,
    original_context_length, yarn_beta_fast/slow, yarn_attn_factor = HF's attention_factor).
    Llama 3's scaling comes as the rope_freqs tensor instead; GGUF has no dynamic kind."""
    kind = str(get("rope.scaling.type", "none"))
    factor = get("rope.scaling.factor", get("rope.scale_linear"))
    if kind == "linear" or (kind == "none" and factor not in (None, 1.0)):
        return {"rope_type": "linear", "factor": float(factor if factor is not None else 1.0)}
    if kind == "none":
        return None
    if kind != "yarn":
        _unsupported_rope(path, kind)
    if factor is None:
        raise ModelLoadError(path, f"rope scaling 'yarn' lacks {a}.rope.scaling.factor")
    if freq_factors is not None:
        raise ModelLoadError(path, "rope scaling 'yarn' with a rope_freqs tensor is not supported")
    for key, plain in (("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)):
        if get(f"rope.scaling.{key}") not in (None, plain):
            raise ModelLoadError(path, f"{a}.rope.scaling.{key} {get(f'rope.scaling.{key}')} is not "
                                       f"supported (only {plain})")
    out: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
    original = get("rope.scaling.original_context_length")
    if original:
        out["original_max_position_embeddings"] = int(original)
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                      ("yarn_attn_factor", "attention_factor")):
        if get(f"rope.scaling.{key}") is not None:
            out[name] = float(get(f"rope.scaling.{key}"))
    return _check_rope(path, out)


def _gguf_linear_attention(path: str, a: str, get: Any, layers: int) -> dict[str, Any]:
    """The gated DeltaNet fields of GGUF metadata (llama.cpp's `{arch}.ssm.*`); none without
    `.ssm.conv_kernel`.

    llama.cpp reuses Mamba's keys: state_size is a key head's size, group_count the key heads,
    time_step_rank the value heads and inner_size all value heads' width. Every
    `{arch}.full_attention_interval`-th layer (default 4, llama.cpp's) is full attention.
    """
    if get("ssm.conv_kernel") is None:
        return {}
    sizes = {}
    for key in ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size"):
        if get(key) is None:
            raise ModelLoadError(path, f"GGUF metadata lacks {a}.{key}")
        sizes[key] = int(get(key))
    hk, hv, inner = sizes["ssm.group_count"], sizes["ssm.time_step_rank"], sizes["ssm.inner_size"]
    if min(sizes.values()) <= 0 or hv % hk or inner % hv:
        raise ModelLoadError(path, f"linear-attention sizes {sizes} do not fit: the value heads must be a "
                                   f"multiple of the key heads and divide the inner size")
    interval = int(get("full_attention_interval", 4))
    if interval <= 0:
        raise ModelLoadError(path, f"{a}.full_attention_interval {interval} is not positive")
    types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))
    return dict(layer_types=types, linear_num_key_heads=hk, linear_num_value_heads=hv,
                linear_key_head_dim=sizes["ssm.state_size"], linear_value_head_dim=inner // hv,
                linear_conv_kernel=sizes["ssm.conv_kernel"])


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
