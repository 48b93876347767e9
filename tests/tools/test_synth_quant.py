"""tools/synth.py's quantized files: llama.cpp's Q4_K_M recipe, finite weights of a sane size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.default_model import default_model_path
from strata.gguf import GGUFFile
from tools.synth import SHAPES, copy_tokenizer_fields, tensor_plan, write_gguf


def test_q4_k_m_plan_follows_llama_cpp() -> None:
    plan = {name: t for name, _, t in tensor_plan(SHAPES["llama-3.1-8b"], 49152, "Q4_K_M")}
    six = [i for i in range(32) if plan[f"blk.{i}.ffn_down.weight"] == 14]  # Q6_K
    # use_more_bits for 32 layers: the first 4, the last 4, and every third between
    assert six == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert all(plan[f"blk.{i}.attn_v.weight"] == plan[f"blk.{i}.ffn_down.weight"] for i in range(32))
    assert plan["output.weight"] == 14 and plan["token_embd.weight"] == 12  # Q6_K, Q4_K
    assert plan["blk.5.attn_q.weight"] == 12 and plan["blk.5.attn_norm.weight"] == 0


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q8_0", "Q4_1"])
def test_quantized_file_loads_with_finite_small_weights(tmp_path, quant: str) -> None:
    path = tmp_path / f"{quant}.gguf"
    info = write_gguf(path, SHAPES["tiny"], copy_tokenizer_fields(str(default_model_path())),
                      quant=quant, pool=1 << 20)
    f = GGUFFile(path)
    assert f.metadata["general.file_type"] == {"Q4_K_M": 15, "Q8_0": 7, "Q6_K": 18, "Q4_1": 3}[quant]
    assert info["bytes"] >= sum(t.nbytes for t in f.tensors.values())
    for name in ("blk.0.attn_v.weight", "blk.1.ffn_up.weight"):  # Q4_K_M: Q6_K, Q4_K
        w = f.load(name)
        assert torch.isfinite(w).all() and 0.005 < float(w.std()) < 0.05, name
        assert abs(float(w.mean())) < 0.003, name  # centred, like a trained model's
    assert np.unique(f.raw("blk.0.ffn_up.weight")).size > 200  # random codes, not a constant
