"""A tiny random llama in Hugging Face format, written for tests that need real files."""

from __future__ import annotations

from pathlib import Path


def write_tiny_llama(out: Path, vocab: int, bos: int | None, eos: int | None,
                     hidden: int = 64, intermediate: int = 128, layers: int = 2) -> Path:
    """2 layers (by default), 4 heads, 2 KV heads; weights larger than the default init so logits
    avoid ties."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=bos, eos_token_id=eos,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    return out
