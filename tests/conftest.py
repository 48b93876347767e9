"""Shared fixtures: the embedded default model and a tiny random model with its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata.default_model import default_model_path


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_gguf: Path) -> Path:
    """A 2-layer random llama in Hugging Face format, with the default model's tokenizer.

    The real tokenizer (49,152 tokens) keeps text and chat templates realistic;
    the random weights keep every forward cheap.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    tok = AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    tok.save_pretrained(out)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init, so logits are far from ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir: Path):
    """The tiny model loaded once (dense bfloat16 on the CPU), shared by engine tests."""
    from strata.models import load_model

    return load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16", progress=False)
