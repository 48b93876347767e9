"""Every kind of bad model input is one ModelLoadError naming the path and the problem."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants
from gguf_export import write_gguf
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny, tiny_hf_model

from strata.errors import ModelLoadError
from strata.models import load_model


def load_error(path) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path), device="cpu", dtype="float32", progress=False)
    err = info.value
    assert err.path == str(path) and "\n" not in err.problem
    return err


def edit_config(folder, **changes) -> None:
    f = folder / "config.json"
    cfg = json.loads(f.read_text())
    cfg.update(changes)
    f.write_text(json.dumps(cfg))


def test_missing_path(tmp_path) -> None:
    assert "no such file" in load_error(tmp_path / "nope.gguf").problem


def test_folder_without_config(tmp_path) -> None:
    assert "no config.json" in load_error(tmp_path).problem


def test_folder_without_weights(tmp_path) -> None:
    save_tiny("llama_plain", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    assert "no *.safetensors" in load_error(tmp_path).problem


def test_unsupported_architecture_in_folder(tmp_path) -> None:
    save_tiny("llama_plain", tmp_path)
    edit_config(tmp_path, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    problem = load_error(tmp_path).problem
    assert "unsupported architecture gpt2" in problem and "llama, mixtral, qwen2, qwen2moe, qwen3, qwen3moe" in problem


def test_unsupported_architecture_in_gguf(tmp_path) -> None:
    path = write_gguf(tiny_hf_model("llama_plain"), tmp_path / "t.gguf", "falcon")
    problem = load_error(path).problem
    assert "unsupported architecture falcon" in problem and "llama, mixtral, qwen2, qwen2moe, qwen3, qwen3moe" in problem


def test_unsupported_rope_scaling(tmp_path) -> None:
    save_tiny("llama_plain", tmp_path)
    edit_config(tmp_path, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                           "long_factor": [2.0] * 8, "original_max_position_embeddings": 64})
    problem = load_error(tmp_path).problem
    assert "rope scaling 'longrope' is not supported (supported: linear, llama3, yarn, dynamic)" in problem


def test_foreign_quantization_loads_with_a_warning(tmp_path, caplog) -> None:
    """A type only gguf.quants decodes (IQ4_NL) loads, with one warning line naming it."""
    # IQ4_NL: 18-byte blocks of 32 weights; ffn_down is [64, 128], so 4 blocks a row
    blob = np.random.default_rng(0).integers(0, 255, size=(64, 72), dtype=np.uint8)
    blob.reshape(64, 4, 18)[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    path = write_gguf(tiny_hf_model("llama_plain"), tmp_path / "t.gguf", "llama",
                      raw={"ffn_down.weight": (blob, Q.IQ4_NL)})
    with caplog.at_level(logging.WARNING):
        loaded = load_model(str(path), device="cpu", dtype="float32", weights="dense", progress=False)
    lines = [r.getMessage() for r in caplog.records if "IQ4_NL" in r.getMessage()]
    assert len(lines) == 1 and "gguf.quants" in lines[0]
    want = torch.from_numpy(gguf_quants.dequantize(blob, Q.IQ4_NL)).reshape(64, 128)
    assert torch.equal(loaded.model.layers[0].mlp.down_proj.weight, want)


def test_unsupported_quantization(tmp_path) -> None:
    # Q8_1 (40-byte blocks of 32, ggml's intermediate type): nothing decodes it
    blob = np.zeros((64, 4 * 40), dtype=np.uint8)
    path = write_gguf(tiny_hf_model("llama_plain"), tmp_path / "t.gguf", "llama",
                      raw={"ffn_down.weight": (blob, Q.Q8_1)})
    problem = load_error(path).problem
    assert "blk.0.ffn_down.weight" in problem and "Q8_1" in problem and "Q8_0" in problem


def test_missing_tensor_in_gguf(tmp_path) -> None:
    path = write_gguf(
        tiny_hf_model("llama_plain"), tmp_path / "t.gguf", "llama", skip=("blk.1.ffn_up.weight",)
    )
    assert load_error(path).problem == "missing tensor blk.1.ffn_up.weight"


def test_missing_tensor_in_folder(tmp_path) -> None:
    save_tiny("qwen2", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.0.self_attn.k_proj.bias"]
    save_file(weights, tmp_path / "model.safetensors")
    assert load_error(tmp_path).problem == "missing tensor model.layers.0.self_attn.k_proj.bias"


def test_shape_mismatch(tmp_path) -> None:
    save_tiny("llama_plain", tmp_path)
    edit_config(tmp_path, intermediate_size=96)
    problem = load_error(tmp_path).problem
    assert "model.layers.0.mlp.gate_proj.weight has shape [128, 64]" in problem
    assert "[96, 64]" in problem


def test_truncated_gguf(tmp_path) -> None:
    path = write_gguf(tiny_hf_model("llama_plain"), tmp_path / "t.gguf", "llama")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    load_error(path)


def test_not_a_gguf(tmp_path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("hello")
    load_error(path)


def test_broken_tokenizer(tmp_path) -> None:
    save_tiny("llama_plain", tmp_path)
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_model(str(tmp_path), device="cpu", progress=False)


def test_cuda_without_cuda(tmp_path, monkeypatch) -> None:
    save_tiny("llama_plain", tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        load_model(str(tmp_path), device="cuda", progress=False)
