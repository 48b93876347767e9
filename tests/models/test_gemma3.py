"""Gemma 3 against transformers: from a folder and from a GGUF file, through the KV pool.

The tiny model has 5 sliding layers (window 8) and one global one; PROMPT
(20 tokens) crosses the window, so the window, the two RoPE bases, the
sandwich norms and the query scalar all show in the logits.
"""

from __future__ import annotations

import json

import pytest
import torch
from dense_context import greedy, prompt_logits
from gguf_export import write_gguf
from tiny_models import PROMPT, hf_greedy, hf_logits, save_byte_tokenizer, save_tiny, tiny_hf_model

from strata.attention.reference import TableAttention
from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from strata.errors import ModelLoadError
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.state import StatePool
from strata.kv.step import SeqSpec
from strata.kv.stream import StreamedPool
from strata.models import load_model
from strata.models.config import config_from_gguf
from strata.models.loader import LoadedModel

WINDOW = 8


@torch.inference_mode()
def _pool_run(loaded: LoadedModel, ids: list[int], cuts: list[int], n_new: int,
              kernel: bool | None, fmt: str = "fp32") -> tuple[torch.Tensor, list[int]]:
    """The prompt read in steps ending at `cuts`: the global layer through the pool
    (`TableAttention`, the C++ kernel or the torch path), the sliding ones through the state
    pool; then n_new greedy tokens one a step: (prompt logits, tokens)."""
    cfg, model = loaded.config, loaded.model
    pool = KvPool(make_format(fmt, cfg.num_kv_heads, cfg.head_dim), model.pool_layers(), 1, 64, 8, None)
    states = StatePool(model.state_layers(), 1, "cpu", model.state_dtypes())

    def step(tokens: list[int], start: int) -> torch.Tensor:
        seq = SeqSpec(0, start, len(tokens))
        assert pool.reserve(0, seq.end)
        ctx = TableAttention(pool, [seq], cfg.attn_scale, kernel=kernel)
        hidden = model(torch.tensor(tokens), torch.arange(start, seq.end), ctx,
                       states=states.step([(0, seq.n)], [0], [start == 0]))
        return model.compute_logits(hidden)

    logits, start = [], 0
    for end in cuts:
        logits.append(step(ids[start:end], start))
        start = end
    out = [int(logits[-1][-1].argmax())]
    while len(out) < n_new:
        out.append(int(step(out[-1:], start)[0].argmax()))
        start += 1
    return torch.cat(logits), out


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> tuple[torch.nn.Module, str]:
    path = tmp_path_factory.mktemp("gemma3")
    return save_tiny("gemma3", path), str(path)


def test_config_reads_the_layer_types(folder) -> None:
    _, path = folder
    cfg = load_model(path, device="cpu", dtype="float32", progress=False).config
    assert (cfg.arch, cfg.sliding_window, cfg.sliding_layers) == ("gemma3", WINDOW, (0, 1, 2, 3, 4))
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (
        10000.0, 100.0, {"rope_type": "linear", "factor": 2.0})
    assert cfg.attn_scale == 24**-0.5 and cfg.final_logit_softcap == 3.0 and cfg.tie_word_embeddings


@pytest.mark.parametrize("kernel", [None, False], ids=["cpu-kernel", "torch"])
@pytest.mark.parametrize("cuts", [[20], [11, 20], [3, 8, 9, 20]], ids=["whole", "halves", "parts"])
def test_pool_steps_match_transformers(folder, kernel: bool | None, cuts: list[int]) -> None:
    """The prompt in one piece or in parts (some ending inside the first window), then decode
    steps: logits and greedy tokens of transformers, on both attention paths."""
    hf, path = folder
    loaded = load_model(path, device="cpu", dtype="float32", progress=False)
    logits, tokens = _pool_run(loaded, PROMPT, cuts, 16, kernel)
    torch.testing.assert_close(logits, hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4)
    assert tokens == hf_greedy(hf, PROMPT, 16)


def test_bf16_reads_in_parts_give_the_bits_of_one_read(folder) -> None:
    """Exactness through the window state: in bfloat16 on the C++ kernels, a prompt read in parts
    (some ending inside the first window, the window's cells then coming from the state) gives
    every row the bits of the prompt read at once, and the same decode tokens."""
    _, path = folder
    loaded = load_model(path, device="cpu", dtype="bfloat16", weights="dense", progress=False)
    whole, tokens = _pool_run(loaded, PROMPT, [20], 12, None, "bf16")
    for cuts in ([11, 20], [3, 8, 9, 20], list(range(1, 21))):
        logits, got = _pool_run(loaded, PROMPT, cuts, 12, None, "bf16")
        assert torch.equal(logits, whole) and got == tokens


def test_the_window_matters(folder, tmp_path) -> None:
    """A window that never binds changes nothing before position 8 and the logits after it."""
    hf, path = folder
    wide = tmp_path / "wide"
    save_tiny("gemma3", wide)
    cfg_file = wide / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "sliding_window": 1000}))
    loaded = load_model(str(wide), device="cpu", dtype="float32", progress=False)
    ours, ref = prompt_logits(loaded, PROMPT), hf_logits(hf, PROMPT)
    torch.testing.assert_close(ours[:WINDOW], ref[:WINDOW], atol=1e-4, rtol=1e-4)
    assert (ours[WINDOW:] - ref[WINDOW:]).abs().amax() > 0.05


def test_gguf_matches_transformers(tmp_path) -> None:
    """A float32 file laid out like llama.cpp's (norms as 1 + w, gemma3's names): the original
    model's logits and greedy tokens, through the dense context and through the pool."""
    hf = tiny_hf_model("gemma3")
    path = write_gguf(hf, tmp_path / "tiny.gguf", "gemma3", types={})
    loaded = load_model(str(path), device="cpu", dtype="float32", progress=False)
    cfg = loaded.config
    assert (cfg.sliding_window, cfg.sliding_layers, cfg.rope_local_theta) == (WINDOW, (0, 1, 2, 3, 4), 100.0)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0} and cfg.final_logit_softcap == 3.0
    torch.testing.assert_close(cfg.attn_scale, 24**-0.5)
    ref = hf_logits(hf, PROMPT)
    torch.testing.assert_close(prompt_logits(loaded, PROMPT), ref, atol=1e-4, rtol=1e-4)
    assert greedy(loaded, PROMPT, 16) == hf_greedy(hf, PROMPT, 16)
    logits, tokens = _pool_run(loaded, PROMPT, [11, 20], 16, None)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    assert tokens == hf_greedy(hf, PROMPT, 16)


def test_quantized_gguf_blocks_match_dense(tmp_path) -> None:
    """Q8_0 / Q4_0 / F16 tensors multiplied in their blocks (the embedding and the tied head
    too) give the logits of the same file dequantized."""
    hf = tiny_hf_model("gemma3")
    path = str(write_gguf(hf, tmp_path / "tiny.gguf", "gemma3"))
    dense = load_model(path, device="cpu", dtype="float32", weights="dense", progress=False)
    blocks = load_model(path, device="cpu", dtype="float32", weights="gguf", progress=False)
    assert blocks.weights == "gguf"
    torch.testing.assert_close(prompt_logits(blocks, PROMPT), prompt_logits(dense, PROMPT),
                               atol=1e-3, rtol=1e-3)


def _gguf_meta(**extra) -> dict:
    base = {"general.architecture": "gemma3", "gemma3.embedding_length": 64, "gemma3.block_count": 12,
            "gemma3.feed_forward_length": 128, "gemma3.attention.head_count": 2,
            "gemma3.attention.key_length": 32, "gemma3.vocab_size": 256,
            "gemma3.attention.sliding_window": 512}
    return {**base, **{f"gemma3.{k}": v for k, v in extra.items()}}


def test_gguf_defaults_follow_llama_cpp() -> None:
    """Without the keys llama.cpp's converter leaves out: every 6th layer global, local base
    10000, the scale from head_dim (hidden / heads for the 62-layer 27B)."""
    _, cfg = config_from_gguf("x.gguf", _gguf_meta(), ["output_norm.weight"], None)
    assert cfg.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10) and cfg.rope_local_theta == 10000.0
    assert cfg.attn_scale == 32**-0.5 and cfg.window(5) is None and cfg.window(0) == 512
    _, big = config_from_gguf("x.gguf", _gguf_meta(block_count=62), [], None)
    assert big.query_pre_attn_scalar == 32
    flags = [True, False] * 6
    _, listed = config_from_gguf("x.gguf", _gguf_meta(**{"attention.sliding_window_pattern": flags}), [], None)
    assert listed.sliding_layers == (0, 2, 4, 6, 8, 10)
    with pytest.raises(ModelLoadError, match="soft-capping"):
        config_from_gguf("x.gguf", _gguf_meta(attn_logit_softcapping=50.0), [], None)


@pytest.mark.parametrize("resident", [None, 64], ids=["resident", "streamed"])
def test_engine_greedy_matches_transformers(folder, tmp_path, resident: int | None) -> None:
    """Two lanes through the engine, prompts read in chunks of 6 tokens: transformers' tokens;
    with --kv-resident the global layer's K/V stream like any pool layer's (one block of 64
    cells on the device for two lanes of up to 64 positions)."""
    hf, _ = folder
    path = tmp_path / "served"
    save_tiny("gemma3", path)
    save_byte_tokenizer(path)
    prompts = [PROMPT, PROMPT[::-1][:13] + PROMPT]
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", weights="dense", parallel=2,
                       max_context=64, prefill_chunk=6, kv_resident=resident)
    with Engine(cfg) as eng:
        handles = [eng.generate(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                   for p in prompts]
        got = [h.result().token_ids for h in handles]
        pool = eng.pool
        stream = eng.stats().get("kv_stream")
    assert got == [hf_greedy(hf, p, 12) for p in prompts]
    assert pool.layer_ids == (5,)  # the global layer only: the sliding ones keep their window
    if resident is not None:
        assert isinstance(pool, StreamedPool) and stream["misses"] > 0
