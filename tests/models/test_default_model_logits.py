"""The embedded SmolLM2 GGUF through Strata agrees with transformers loading the same file."""

from __future__ import annotations

import functools

import gguf
import pytest
import torch
from dense_context import greedy, prompt_logits
from tiny_models import hf_greedy, hf_logits
from transformers import AutoModelForCausalLM

import strata.gguf  # noqa: F401  (subclasses gguf.GGUFReader: import it before the memoizing below)
from strata.default_model import default_model_path
from strata.models import load_model

# "What is the capital of France?" through SmolLM2's chat template (system
# prompt included, generation prompt added), as its own tokenizer encodes it.
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
    411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198,
    1, 520, 9531, 198]  # fmt: skip


@pytest.mark.slow
def test_default_model_matches_transformers(monkeypatch) -> None:
    # transformers rebuilds gguf's tensor-name table for every module it maps
    # and parses the file twice (config, then weights): most of its load time.
    # Both are pure reads, so memoize them.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
    path = default_model_path()
    loaded = load_model(None, device="cpu", dtype="float32", progress=False)
    ref = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(chat)) == PROMPT
    cfg = loaded.config
    assert (cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 9, 3)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == [2]
    ours = prompt_logits(loaded, PROMPT)
    theirs = hf_logits(ref, PROMPT)
    torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=1e-3)
    assert greedy(loaded, PROMPT, 4) == hf_greedy(ref, PROMPT, 4)
