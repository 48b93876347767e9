"""GGUF files written like llama.cpp's converter load and agree with transformers."""

from __future__ import annotations

import pytest
import torch
from dense_context import greedy, prompt_logits
from gguf_export import write_gguf
from tiny_models import PROMPT, hf_greedy, hf_logits, tiny_hf_model
from transformers import AutoModelForCausalLM

from strata.models import load_model

ARCH_OF = {"llama_plain": "llama", "qwen2": "qwen2", "qwen3_hd128": "qwen3"}


@pytest.mark.parametrize("kind", sorted(ARCH_OF))
def test_quantized_gguf_matches_transformers_gguf(kind: str, tmp_path) -> None:
    """Same file (Q8_0, Q4_0, F16, F32 tensors; llama Q/K permuted) through both loaders."""
    write_gguf(tiny_hf_model(kind), tmp_path / "tiny.gguf", ARCH_OF[kind])
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    loaded = load_model(str(tmp_path / "tiny.gguf"), device="cpu", dtype="float32", progress=False)

    assert loaded.config.arch == ARCH_OF[kind]
    torch.testing.assert_close(
        prompt_logits(loaded, PROMPT), hf_logits(ref, PROMPT), atol=1e-4, rtol=1e-4
    )
    assert greedy(loaded, PROMPT, 32) == hf_greedy(ref, PROMPT, 32)


@pytest.mark.parametrize("kind", ["llama", "llama_linear"])
def test_gguf_rope_scaling_matches_transformers(kind: str, tmp_path) -> None:
    """Llama 3 scaling as a rope_freqs tensor, linear scaling as metadata; float32 weights.

    transformers' GGUF loader drops both, so the oracle is the original model.
    """
    hf = tiny_hf_model(kind)
    write_gguf(hf, tmp_path / "tiny.gguf", "llama", types={})
    loaded = load_model(str(tmp_path / "tiny.gguf"), device="cpu", dtype="float32", progress=False)

    cfg = loaded.config
    if kind == "llama":
        assert cfg.rope_freq_factors is not None and max(cfg.rope_freq_factors) == 8.0
    else:
        assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    torch.testing.assert_close(
        prompt_logits(loaded, PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4
    )
    assert greedy(loaded, PROMPT, 32) == hf_greedy(hf, PROMPT, 32)


def test_gguf_identity_follows_layout(tmp_path) -> None:
    """Same layout, same identity; another tensor type, another identity."""
    hf = tiny_hf_model("llama_plain")
    a = load_model(str(write_gguf(hf, tmp_path / "a.gguf", "llama")), device="cpu", progress=False)
    b = load_model(str(write_gguf(hf, tmp_path / "b.gguf", "llama")), device="cpu", progress=False)
    c = load_model(
        str(write_gguf(hf, tmp_path / "c.gguf", "llama", types={})), device="cpu", progress=False
    )
    assert a.identity == b.identity != c.identity
    assert a.dtype == torch.bfloat16 and a.model.norm.weight.dtype == torch.bfloat16
    assert a.name == "a"
