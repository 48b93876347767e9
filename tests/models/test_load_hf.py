"""Each architecture from a Hugging Face folder agrees with transformers: logits, greedy tokens."""

from __future__ import annotations

import pytest
import torch
from dense_context import greedy, prompt_logits
from tiny_models import CONFIGS, PROMPT, hf_greedy, hf_logits, save_byte_tokenizer, save_tiny
from transformers import AutoTokenizer

from strata.models import load_model


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_folder_matches_transformers(kind: str, tmp_path) -> None:
    hf = save_tiny(kind, tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32", progress=False)

    ours = prompt_logits(loaded, PROMPT)
    ref = hf_logits(hf, PROMPT)
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert greedy(loaded, PROMPT, 32) == hf_greedy(hf, PROMPT, 32)


def test_config_and_metadata(tmp_path) -> None:
    save_tiny("qwen3", tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32", progress=False)
    cfg = loaded.config
    assert (cfg.arch, cfg.head_dim, cfg.qk_norm, cfg.num_kv_heads) == ("qwen3", 32, True, 2)
    assert cfg.eos_token_ids == [2]
    assert loaded.name == tmp_path.name
    assert len(loaded.identity) == 64
    assert loaded.model.embed_tokens.weight.dtype == torch.float32


def test_rope_tables_cover_the_context(tmp_path) -> None:
    """Tables span max_position_embeddings and can be rebuilt longer (same values below)."""
    save_tiny("llama", tmp_path)
    model = load_model(str(tmp_path), device="cpu", dtype="float32", progress=False).model
    assert model.max_positions == 256
    cos = model.rope_cos.clone()
    model.set_max_positions(300)
    assert model.max_positions == 300 and torch.equal(model.rope_cos[:256], cos)


def test_folder_tokenizer(tmp_path) -> None:
    save_tiny("llama_plain", tmp_path)
    assert load_model(str(tmp_path), device="cpu", progress=False).tokenizer is None
    save_byte_tokenizer(tmp_path)
    tok = load_model(str(tmp_path), device="cpu", progress=False).tokenizer
    text = "Strata, déjà vu!"
    assert tok is not None
    assert tok.encode(text) == AutoTokenizer.from_pretrained(tmp_path).encode(text)
    assert tok.decode(tok.encode(text)) == text


def test_bfloat16_weights_are_used_in_place(tmp_path) -> None:
    """Loading in the file's own dtype maps the safetensors data instead of copying it."""
    hf = save_tiny("llama_plain", tmp_path)
    hf.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path), device="cpu", dtype="auto", progress=False)
    assert loaded.dtype == torch.bfloat16
    w = loaded.model.layers[0].mlp.down_proj.weight
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, hf.model.layers[0].mlp.down_proj.weight)
    assert _mapped_from(w, tmp_path / "model.safetensors")
    assert greedy(loaded, PROMPT, 8) == hf_greedy(hf, PROMPT, 8)


def _mapped_from(t: torch.Tensor, file) -> bool:
    """Whether the tensor's memory lies in a mapping of `file` (Linux /proc)."""
    ptr = t.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return len(fields) > 5 and fields[5] == str(file)
    return False


def test_sharded_checkpoint(tmp_path) -> None:
    hf = save_tiny("qwen2", tmp_path / "one")
    hf.save_pretrained(tmp_path / "shards", safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "shards" / "model.safetensors.index.json").is_file()
    one = load_model(str(tmp_path / "one"), device="cpu", dtype="float32", progress=False)
    shards = load_model(str(tmp_path / "shards"), device="cpu", dtype="float32", progress=False)
    assert torch.equal(prompt_logits(one, PROMPT), prompt_logits(shards, PROMPT))
