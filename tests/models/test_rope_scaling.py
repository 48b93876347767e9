"""YaRN and dynamic NTK RoPE scaling against transformers, from a folder and from a GGUF file.

YaRN is static, so logits and greedy tokens match transformers at every length.
Dynamic NTK is not (transformers recomputes its base for each forward's length);
Strata fixes the base vLLM fixes, transformers' at max_position_embeddings x
factor tokens, so the two agree on a prompt of exactly that length.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from dense_context import greedy, prompt_logits
from gguf_export import write_gguf
from tiny_models import COMMON, hf_greedy, hf_logits, tiny_hf_from_config
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from strata.errors import ModelLoadError
from strata.models import load_model
from strata.models.config import config_from_gguf, config_from_hf
from strata.models.rope import attention_factor, inverse_frequencies, trained_context

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
# every optional key given: no attention factor from the log rule, another ramp, its ends not rounded
YARN_TUNED = {**YARN, "attention_factor": 1.0, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}
YARN_GGUF = {k: v for k, v in YARN_TUNED.items() if k != "truncate"}  # GGUF has no truncate: always rounded
DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
DYNAMIC_TRAINED = 64  # max_position_embeddings of the dynamic configs: the base is fixed for 128
ARCHS = ("llama", "qwen2", "qwen3")


def hf_config(arch: str, rope: dict, **over) -> object:
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    extra = {"head_dim": 32} if arch == "qwen3" else {}
    return cls(**{**COMMON, **over}, **extra, rope_parameters=dict(rope))


def long_prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, COMMON["vocab_size"], (n,), generator=g).tolist()


def save_and_load(hf, folder):
    hf.save_pretrained(folder, safe_serialization=True)
    return load_model(str(folder), device="cpu", dtype="float32", progress=False)


def drop_scaling(folder) -> None:
    """The folder's config.json with its rope scaling removed (the same weights, plain RoPE)."""
    f = folder / "config.json"
    d = json.loads(f.read_text())
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    d.pop("rope_scaling", None)
    f.write_text(json.dumps(d))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rope", [YARN, YARN_TUNED], ids=["yarn", "yarn_tuned"])
def test_yarn_matches_transformers_past_the_original_length(arch: str, rope: dict, tmp_path) -> None:
    hf = tiny_hf_from_config(hf_config(arch, rope))
    loaded = save_and_load(hf, tmp_path)
    assert loaded.config.rope_scaling["rope_type"] == "yarn"
    ids = long_prompt(200)  # past the original 64 positions, within the stretched 256
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(prompt_logits(loaded, ids), ref, atol=1e-4, rtol=1e-4)
    assert greedy(loaded, ids, 16) == hf_greedy(hf, ids, 16)

    drop_scaling(tmp_path)  # negative control: plain RoPE on the same weights is not this model
    plain = load_model(str(tmp_path), device="cpu", dtype="float32", progress=False)
    assert (prompt_logits(plain, ids) - ref).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_dynamic_matches_transformers_where_their_bases_meet(arch: str, tmp_path) -> None:
    """At max_position_embeddings x factor tokens transformers picks the base Strata keeps."""
    hf = tiny_hf_from_config(hf_config(arch, DYNAMIC, max_position_embeddings=DYNAMIC_TRAINED))
    loaded = save_and_load(hf, tmp_path)
    ids = long_prompt(DYNAMIC_TRAINED * 2)
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(prompt_logits(loaded, ids), ref, atol=1e-4, rtol=1e-4)

    drop_scaling(tmp_path)
    plain = load_model(str(tmp_path), device="cpu", dtype="float32", progress=False)
    plain.model.set_max_positions(len(ids))  # past its 64 trained positions, as -c 128 would
    assert (prompt_logits(plain, ids) - ref).abs().max() > 1e-2


def test_dynamic_base_is_vllms_fixed_one_at_every_length(tmp_path) -> None:
    """The frequencies are the formula's, written out here: base * (f*f - f + 1)^(d / (d - 2))."""
    hf = tiny_hf_from_config(hf_config("qwen3", DYNAMIC, max_position_embeddings=DYNAMIC_TRAINED))
    cfg = save_and_load(hf, tmp_path).config
    d, f = 32, 2.0
    base = 10000.0 * (f * f - f + 1) ** (d / (d - 2))
    want = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    torch.testing.assert_close(inverse_frequencies(cfg).double(), want, rtol=1e-6, atol=0)
    plain = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    assert not torch.allclose(inverse_frequencies(cfg).double(), plain)  # the control: not the default
    assert trained_context(cfg) == DYNAMIC_TRAINED * 2 and attention_factor(cfg) == 1.0


def test_yarn_attention_factor_and_trained_context() -> None:
    """Qwen3's long-context recipe: factor 4 over 32,768 tokens; the log rule for the factor."""
    d = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 40960,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    _, cfg = config_from_hf("q", d)
    assert trained_context(cfg) == 131072
    assert attention_factor(cfg) == pytest.approx(0.1 * math.log(4.0) + 1)
    # a top-level original_max_position_embeddings wins, as in transformers; no factor: their ratio
    _, cfg = config_from_hf("q", {**d, "original_max_position_embeddings": 8192,
                                  "rope_scaling": {"rope_type": "yarn"}})
    assert cfg.rope_scaling["original_max_position_embeddings"] == 8192
    assert trained_context(cfg) == 40960 and attention_factor(cfg) == pytest.approx(0.1 * math.log(5.0) + 1)
    _, plain = config_from_hf("q", {**d, "rope_scaling": None})
    assert trained_context(plain) == 40960 and attention_factor(plain) == 1.0


@pytest.mark.parametrize("scaling, problem", [
    ({"rope_type": "dynamic"}, "rope scaling 'dynamic' lacks its factor"),
    ({"rope_type": "yarn", "factor": 0}, "rope scaling 'yarn' has factor 0, not a positive number"),
    ({"rope_type": "longrope", "factor": 2.0}, "rope scaling 'longrope' is not supported"),
])
def test_bad_scaling_is_refused(scaling: dict, problem: str) -> None:
    d = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "rope_scaling": scaling}
    with pytest.raises(ModelLoadError, match=problem):
        config_from_hf("m", d)


@pytest.mark.parametrize("rope", [YARN, YARN_GGUF], ids=["yarn", "yarn_tuned"])
def test_gguf_yarn_matches_transformers(rope: dict, tmp_path) -> None:
    """The keys llama.cpp's converter writes (`qwen2.rope.scaling.*`) give the model back.

    transformers' GGUF loader drops YaRN, so the oracle is the original model."""
    hf = tiny_hf_from_config(hf_config("qwen2", rope))
    path = write_gguf(hf, tmp_path / "tiny.gguf", "qwen2", types={})
    loaded = load_model(str(path), device="cpu", dtype="float32", progress=False)
    assert loaded.config.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}
    ids = long_prompt(200)
    torch.testing.assert_close(prompt_logits(loaded, ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
    assert trained_context(loaded.config) == 256


def _gguf_metadata(**rope) -> dict:
    meta = {"general.architecture": "qwen2", "qwen2.embedding_length": 64, "qwen2.block_count": 2,
            "qwen2.feed_forward_length": 128, "qwen2.attention.head_count": 4, "qwen2.vocab_size": 256,
            "qwen2.context_length": 40960}
    return {**meta, **{f"qwen2.rope.scaling.{k}": v for k, v in rope.items()}}


def test_gguf_yarn_keys() -> None:
    _, cfg = config_from_gguf("f", _gguf_metadata(type="yarn", factor=4.0, original_context_length=32768),
                              [], None)
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert trained_context(cfg) == 131072
    _, none = config_from_gguf("f", _gguf_metadata(), [], None)
    assert none.rope_scaling is None and trained_context(none) == 40960


@pytest.mark.parametrize("rope, problem", [
    ({"type": "yarn"}, "lacks qwen2.rope.scaling.factor"),
    ({"type": "yarn", "factor": 4.0, "yarn_ext_factor": 0.5}, "qwen2.rope.scaling.yarn_ext_factor 0.5 is not"),
    ({"type": "yarn", "factor": 4.0, "yarn_log_multiplier": 0.1}, "yarn_log_multiplier 0.1 is not supported"),
    ({"type": "longrope", "factor": 4.0}, "rope scaling 'longrope' is not supported"),
])
def test_gguf_yarn_refusals(rope: dict, problem: str) -> None:
    with pytest.raises(ModelLoadError, match=problem):
        config_from_gguf("f", _gguf_metadata(**rope), [], None)
