"""Qwen3-Next against transformers: from a folder and from a GGUF file, whole and in parts.

The tiny models (`tiny_models.py`) have three gated DeltaNet layers and one
gated-attention layer, value heads twice the key heads and key and value head
sizes apart (8 and 12), so a swapped head, a mixed-up q/k/v/z row or a
forgotten transform shows in the logits. LONG (40 tokens) is read in one
piece or in parts, the recurrent state carried between the parts through the
test StateContext (`dense_context.DenseStates`), then decoded one token a
step (the recurrent form of the delta rule). The GGUF files are written the
way llama.cpp's converter writes them (`gguf_export.py`): its names, its
metadata and its transforms of the DeltaNet tensors and the norms.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dense_context import DenseContext, DenseStates, greedy, prompt_logits, run
from gguf import GGMLQuantizationType as Q
from gguf_export import DEFAULT_TYPES, write_gguf
from tiny_models import PROMPT, hf_greedy, hf_logits, save_tiny, tiny_hf_model
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from strata.errors import ModelLoadError
from strata.models import load_model
from strata.models.config import config_from_gguf
from strata.models.deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule
from strata.models.loader import LoadedModel

LONG = PROMPT + [9, 250, 31, 77, 77, 140, 2, 18, 199, 60, 5, 43, 222, 101, 36, 88, 170, 11, 64, 3]
NEW = 8
KINDS = ["qwen3_next", "qwen3_next_dense"]
TOL = dict(atol=1e-4, rtol=1e-4)
PARTS_TOL = dict(atol=5e-4, rtol=1e-3)


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory) -> tuple[str, torch.nn.Module, LoadedModel]:
    """(kind, the transformers model, Strata's load of its saved folder), in float32."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, path)
    return request.param, hf, load_model(str(path), device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def reference(tiny) -> tuple[torch.Tensor, list[int]]:
    """transformers' logits over LONG and its NEW greedy tokens after it."""
    _, hf, _ = tiny
    return hf_logits(hf, LONG), hf_greedy(hf, LONG, NEW)


@torch.inference_mode()
def parts_logits(loaded: LoadedModel, ids: list[int], cuts: list[int],
                 zero_layer: int | None = None) -> torch.Tensor:
    """Logits of `ids` read in steps ending at `cuts`, the state carried between them; with
    `zero_layer`, that layer's state is dropped before every part after the first."""
    ctx = DenseContext(loaded.config)
    states = DenseStates(loaded.model.state_layers(), loaded.device)
    out, start = [], 0
    for end in cuts:
        if zero_layer is not None:
            states.zero("0", zero_layer)
        out.append(loaded.model.compute_logits(run(loaded.model, ids[start:end], start, ctx, states)))
        start = end
    return torch.cat(out)


def test_config_reads_the_linear_layers(tiny) -> None:
    kind, _, loaded = tiny
    cfg = loaded.config
    assert cfg.arch == "qwen3next" and cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (2, 4)
    assert (cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel) == (8, 12, 4)
    assert (cfg.head_dim, cfg.rope_dim) == (16, 4) and cfg.attn_output_gate
    assert (cfg.num_experts, cfg.shared_expert_ffn) == ((4, 48) if kind == "qwen3_next" else (0, 0))
    assert set(loaded.model.state_layers()) == {0, 1, 2}


def test_logits_and_greedy_match_transformers(tiny, reference) -> None:
    _, _, loaded = tiny
    ref_logits, ref_tokens = reference
    torch.testing.assert_close(prompt_logits(loaded, LONG), ref_logits, **TOL)
    assert greedy(loaded, LONG, NEW) == ref_tokens


@pytest.mark.parametrize("cuts", [[13, 40], [1, 2, 9, 10, 33, 40], [39, 40]],
                         ids=["two", "ragged", "last-token"])
def test_prompt_in_parts_matches_the_whole(tiny, reference, cuts: list[int]) -> None:
    """Parts of any length (one token included) continue the state as one read does. A part
    is its own chunked read, so the float32 sums run in another order than the whole's: a few
    logits of the 10,240 land 2e-4 apart on some CPUs (AVX-512 hosts), hence PARTS_TOL."""
    _, _, loaded = tiny
    whole = prompt_logits(loaded, LONG)
    parts = parts_logits(loaded, LONG, cuts)
    torch.testing.assert_close(parts, whole, **PARTS_TOL)
    torch.testing.assert_close(parts, reference[0], **PARTS_TOL)


@pytest.mark.parametrize("layer", [0, 2])
def test_a_dropped_state_shows(tiny, reference, layer: int) -> None:
    """The negative control: one layer's state zeroed between parts changes the logits after the
    cut far beyond the tolerance, and nothing before it."""
    _, _, loaded = tiny
    cut = 13
    dropped = parts_logits(loaded, LONG, [cut, 40], zero_layer=layer)
    torch.testing.assert_close(dropped[:cut], reference[0][:cut], **TOL)
    assert (dropped[cut:] - reference[0][cut:]).abs().amax() > 0.05


@torch.inference_mode()
def test_decode_steps_match_reading_the_tokens_at_once(tiny, reference) -> None:
    """Logits of the decoded tokens (one a step: the recurrent form) equal those of the prompt
    and the same tokens read as one prompt (the chunked form)."""
    _, _, loaded = tiny
    tokens = reference[1]
    ids = LONG + tokens
    stepped = parts_logits(loaded, ids, list(range(len(LONG), len(ids) + 1)))
    torch.testing.assert_close(stepped, prompt_logits(loaded, ids), **TOL)


def _random_rule_inputs(b: int, t: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k [B, T, 2, 8]; v [B, T, 4, 12]; g (log decay) and beta [B, T, 4]; a state [B, 4, 8, 12]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, 2, 8, generator=gen) for _ in range(2))
    v = torch.randn(b, t, 4, 12, generator=gen)
    g = -torch.rand(b, t, 4, generator=gen) * 2  # decays between exp(-2) and 1
    beta = torch.rand(b, t, 4, generator=gen)
    state = torch.randn(b, 4, 8, 12, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("t,chunk", [(37, 16), (64, 64), (5, 64), (1, 16)])
def test_chunked_rule_equals_the_recurrent_one(t: int, chunk: int) -> None:
    """The chunked delta rule (padded last block, several blocks, a given start state) gives the
    recurrent form's outputs and final state, and both give transformers' recurrent reference."""
    q, k, v, g, beta, state = _random_rule_inputs(2, t)
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    out_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    torch.testing.assert_close(out_c, out_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_c, s_r, atol=1e-5, rtol=1e-5)
    out_hf, s_hf = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out_r, out_hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_r, s_hf, atol=1e-5, rtol=1e-5)


def test_rule_in_pieces_equals_one_piece() -> None:
    """Splitting the tokens and passing the state on is the same as one call, in either form;
    starting the second piece from zeros instead is not (the control)."""
    q, k, v, g, beta, state = _random_rule_inputs(1, 30, seed=1)
    whole, s_whole = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk=8)
    first, s_mid = chunk_gated_delta_rule(q[:, :11], k[:, :11], v[:, :11], g[:, :11], beta[:, :11], state, chunk=8)
    rest, s_end = recurrent_gated_delta_rule(q[:, 11:], k[:, 11:], v[:, 11:], g[:, 11:], beta[:, 11:], s_mid)
    torch.testing.assert_close(torch.cat((first, rest), dim=1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_end, s_whole, atol=1e-5, rtol=1e-5)
    fresh, _ = recurrent_gated_delta_rule(q[:, 11:], k[:, 11:], v[:, 11:], g[:, 11:], beta[:, 11:], None)
    assert (fresh - whole[:, 11:]).abs().amax() > 0.05


@pytest.fixture(scope="module")
def from_gguf(tiny, tmp_path_factory) -> LoadedModel:
    """The same tiny model written as a float32 GGUF file the way llama.cpp's converter does,
    loaded by Strata. (llama.cpp itself refuses a qwen3next file without experts; the dense
    one keeps llama's ffn_gate/ffn_up/ffn_down names.)"""
    kind, hf, _ = tiny
    path = write_gguf(hf, tmp_path_factory.mktemp("gguf") / f"{kind}.gguf", "qwen3next", types={})
    return load_model(str(path), device="cpu", dtype="float32", progress=False)


def test_gguf_config_is_the_folders(tiny, from_gguf) -> None:
    """Everything the model is built from comes out of the GGUF metadata as from config.json."""
    _, _, folder = tiny
    keys = ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel", "head_dim", "rotary_dim", "attn_output_gate",
            "num_heads", "num_kv_heads", "num_experts", "experts_per_token", "expert_ffn",
            "shared_expert_ffn", "norm_topk_prob", "rope_theta", "tie_word_embeddings")
    assert {k: getattr(from_gguf.config, k) for k in keys} == {k: getattr(folder.config, k) for k in keys}


def test_gguf_transforms_are_undone(tiny, from_gguf) -> None:
    """Each parameter read from the file is the transformers model's: in_proj_qkvz rebuilt from
    attn_qkv and attn_gate, A_log from ssm_a, the norms from 1 + w, the convolution unsqueezed."""
    _, hf, _ = tiny
    ours = dict(from_gguf.model.named_parameters())
    theirs = hf.state_dict()
    for name in ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight", "linear_attn.conv1d.weight",
                 "linear_attn.dt_bias", "linear_attn.A_log", "linear_attn.norm.weight", "linear_attn.out_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"):
        torch.testing.assert_close(ours[f"layers.1.{name}"], theirs[f"model.layers.1.{name}"],
                                   atol=1e-6, rtol=1e-6, msg=name)
    for name in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        torch.testing.assert_close(ours[f"layers.3.{name}"], theirs[f"model.layers.3.{name}"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours["norm.weight"], theirs["model.norm.weight"], atol=1e-6, rtol=1e-6)


def test_gguf_matches_the_folder_and_transformers(tiny, reference, from_gguf) -> None:
    """Logits and greedy tokens of the GGUF load: the folder load's and transformers', whole and
    in parts."""
    _, _, folder = tiny
    ref_logits, ref_tokens = reference
    ours = prompt_logits(from_gguf, LONG)
    torch.testing.assert_close(ours, prompt_logits(folder, LONG), atol=5e-5, rtol=1e-4)  # A_log via exp and log
    torch.testing.assert_close(ours, ref_logits, **TOL)
    torch.testing.assert_close(parts_logits(from_gguf, LONG, [1, 17, 40]), ref_logits, **TOL)
    assert greedy(from_gguf, LONG, NEW) == ref_tokens


def test_legacy_ssm_in_gguf_matches(tiny, reference, tmp_path) -> None:
    """A file of the converter's first version (in_proj_qkvz kept whole as ssm_in, in Hugging
    Face's row order) gives transformers' logits too."""
    kind, hf, _ = tiny
    path = write_gguf(hf, tmp_path / "legacy.gguf", "qwen3next", types={}, legacy=True)
    loaded = load_model(str(path), device="cpu", dtype="float32", progress=False)
    torch.testing.assert_close(prompt_logits(loaded, LONG), reference[0], **TOL)


# block types for the DeltaNet's and the experts' tensors too (ssm_out's 48 columns are no
# whole Q8_0 blocks: it stays F32, as llama.cpp's quantizer would leave it)
QUANTIZED = {**DEFAULT_TYPES, "attn_qkv.weight": Q.Q8_0, "attn_gate.weight": Q.Q8_0, "ssm_ba.weight": Q.Q8_0,
             "ffn_gate_exps.weight": Q.Q8_0, "ffn_up_exps.weight": Q.Q4_0, "ffn_down_exps.weight": Q.Q8_0,
             "ffn_gate_shexp.weight": Q.Q8_0, "attn_v.weight": Q.Q8_0, "attn_output.weight": Q.Q8_0}


def test_quantized_gguf_blocks_match_dense(tmp_path) -> None:
    """A quantized file with `--weights gguf` (the attention, MLP, DeltaNet and expert blocks
    multiplied in place; in_proj_qkvz's block rows reordered from two tensors as its dense rows
    are) gives the logits of the same file dequantized, and each DeltaNet projection held as
    blocks reads out (an identity through the float32 product) as the dense weight exactly."""
    path = str(write_gguf(tiny_hf_model("qwen3_next"), tmp_path / "q.gguf", "qwen3next", types=QUANTIZED))
    dense = load_model(path, device="cpu", dtype="float32", weights="dense", progress=False)
    blocks = load_model(path, device="cpu", dtype="float32", weights="gguf", progress=False)
    assert blocks.weights == "gguf"
    assert type(blocks.model.layers[3].self_attn.qkv_proj).__name__ == "BlockLinear"
    delta, want = blocks.model.layers[0].linear_attn, dense.model.layers[0].linear_attn
    for name in ("in_proj_qkvz", "in_proj_ba"):
        lin = getattr(delta, name)
        assert type(lin).__name__ == "BlockLinear", name
        read = lin.forward(torch.eye(lin.in_features))  # row j of the identity reads column j
        assert torch.equal(read.T, getattr(want, name).weight), name
    assert type(delta.out_proj).__name__ == "Linear"  # ssm_out is F32 here: no blocks to keep
    qkvz = delta.in_proj_qkvz.forward(torch.eye(delta.in_proj_qkvz.in_features)).T
    assert not torch.equal(qkvz, grouped_qkvz_undone(want.in_proj_qkvz.weight, blocks))  # the order matters
    torch.testing.assert_close(prompt_logits(blocks, LONG), prompt_logits(dense, LONG), atol=1e-3, rtol=1e-3)


def grouped_qkvz_undone(weight: torch.Tensor, loaded) -> torch.Tensor:
    """The negative control's rows: llama.cpp's order (q, k, v, z stacked), the order the file's
    two tensors have before the join."""
    cfg = loaded.config
    hk = cfg.linear_num_key_heads
    key, value = hk * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
    per_head = weight.reshape(hk, -1, weight.shape[1])
    sizes = (key // hk, key // hk, value // hk, value // hk)
    return torch.cat([p.reshape(-1, weight.shape[1]) for p in per_head.split(sizes, dim=1)])


def _load_error(path) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path), device="cpu", dtype="float32", progress=False)
    assert info.value.path == str(path) and "\n" not in info.value.problem
    return info.value


@pytest.mark.parametrize("missing", ["blk.1.ssm_a", "blk.0.attn_gate.weight", "blk.2.ssm_dt.bias",
                                     "blk.3.attn_q_norm.weight"])
def test_gguf_missing_tensor_is_named(tmp_path, missing: str) -> None:
    path = write_gguf(tiny_hf_model("qwen3_next_dense"), tmp_path / "t.gguf", "qwen3next", types={},
                      skip=(missing,))
    assert _load_error(path).problem == f"missing tensor {missing}"


def test_gguf_bad_tensor_shape_is_named(tmp_path) -> None:
    """A convolution of kernel 3 where the metadata says 4: one line naming the tensor and shapes."""
    conv = np.zeros((80, 3), dtype=np.float32)
    path = write_gguf(tiny_hf_model("qwen3_next_dense"), tmp_path / "t.gguf", "qwen3next", types={},
                      raw={"ssm_conv1d.weight": (conv, Q.F32)})
    problem = _load_error(path).problem
    assert problem == "tensor blk.0.ssm_conv1d.weight has shape [80, 3], the config needs [80, 1, 4]"


def _meta(**extra) -> dict:
    base = {"general.architecture": "qwen3next", "embedding_length": 64, "block_count": 8,
            "feed_forward_length": 128, "attention.head_count": 4, "attention.head_count_kv": 2,
            "attention.key_length": 16, "rope.dimension_count": 4, "vocab_size": 256,
            "ssm.conv_kernel": 4, "ssm.state_size": 8, "ssm.group_count": 2, "ssm.time_step_rank": 4,
            "ssm.inner_size": 48}
    merged = {**base, **extra}
    return {k if k.startswith("general.") else f"qwen3next.{k}": v for k, v in merged.items() if v is not None}


def test_gguf_metadata_follows_llama_cpp() -> None:
    """Without full_attention_interval every 4th layer attends (llama.cpp's default); a value head
    size is inner_size / time_step_rank; missing or inconsistent sizes are one clear error."""
    _, cfg = config_from_gguf("x.gguf", _meta(), [], None)
    assert [i for i in range(8) if not cfg.linear(i)] == [3, 7] and cfg.linear_value_head_dim == 12
    assert (cfg.rope_dim, cfg.linear_key_head_dim, cfg.linear_num_key_heads) == (4, 8, 2)
    _, cfg = config_from_gguf("x.gguf", _meta(full_attention_interval=2), [], None)
    assert [i for i in range(8) if not cfg.linear(i)] == [1, 3, 5, 7]
    with pytest.raises(ModelLoadError, match="lacks qwen3next.ssm.inner_size"):
        config_from_gguf("x.gguf", _meta(**{"ssm.inner_size": None}), [], None)
    with pytest.raises(ModelLoadError, match="multiple of the key heads"):
        config_from_gguf("x.gguf", _meta(**{"ssm.time_step_rank": 3}), [], None)
    with pytest.raises(ModelLoadError, match="rope.dimension_count 3"):
        config_from_gguf("x.gguf", _meta(**{"rope.dimension_count": 3}), [], None)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_projections_load_and_stay_close(tmp_path, weights: str) -> None:
    """--weights int8/int4 (int8 is the CPU's bf16 default for a folder) quantizes the DeltaNet
    layers' projections as it does attention's, instead of failing on a layer without
    self_attn (int4 where torch's packing takes the rows, int8 elsewhere). Against float32:
    int8 adds little to bf16's own error (large on this random model), int4 stays finite."""
    from strata.models.quantize import Int4Linear, Int8Linear

    path = tmp_path / "m"
    save_tiny("qwen3_next", path)
    exact = prompt_logits(load_model(str(path), device="cpu", dtype="float32", weights="dense",
                                     progress=False), LONG).float()
    dense = prompt_logits(load_model(str(path), device="cpu", dtype="bfloat16", weights="dense",
                                     progress=False), LONG).float()
    quant = load_model(str(path), device="cpu", dtype="bfloat16", weights=weights, progress=False)
    delta = next(layer.linear_attn for layer in quant.model.layers if layer.linear_attn is not None)
    assert isinstance(delta.in_proj_qkvz, Int4Linear if weights == "int4" else Int8Linear)
    assert isinstance(delta.in_proj_ba, Int8Linear)  # 2 x value heads rows: no int4 packing
    got = prompt_logits(quant, LONG).float()
    assert torch.isfinite(got).all()
    if weights == "int8":
        rel = lambda x: float((x - exact).norm() / exact.norm())  # noqa: E731
        assert rel(got) < 1.5 * rel(dense)
