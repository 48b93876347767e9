"""Mixture-of-experts models (qwen3_moe, qwen2_moe) against transformers, from GGUF files too.

transformers' own GGUF reader ignores the expert sizes, so the oracle for a
quantized file is the original model with each quantized tensor replaced by
its `gguf.quants` decoding: the same weights the file holds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dense_context import greedy, prompt_logits
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from gguf_export import write_gguf
from tiny_models import PROMPT, hf_greedy, hf_logits, tiny_hf_model

from strata.errors import ModelLoadError
from strata.models import load_model
from strata.models.moe import SparseMLP, combine_loop, route

ARCH_OF = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}  # llama.cpp: mixtral is llama
TYPES = {"ffn_gate_exps.weight": Q.Q8_0, "ffn_up_exps.weight": Q.Q4_0, "ffn_down_exps.weight": Q.Q8_0,
         "attn_q.weight": Q.Q8_0}


def _as_stored(hf: torch.nn.Module) -> torch.nn.Module:
    """hf with the tensors TYPES quantizes replaced by their decoded values, in place."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".mlp.experts.gate_up_proj" in name:
                gate, up = p.detach().float().numpy().copy().reshape(p.shape[0], 2, -1, p.shape[2]).transpose(1, 0, 2, 3)
                for i, (part, kind) in enumerate(((gate, Q.Q8_0), (up, Q.Q4_0))):
                    back = dequantize(quantize(np.ascontiguousarray(part), kind), kind)
                    p[:, i * part.shape[1] : (i + 1) * part.shape[1]] = torch.from_numpy(back.reshape(part.shape))
            elif ".mlp.experts.down_proj" in name or "self_attn.q_proj.weight" in name:
                data = p.detach().float().numpy()
                p.copy_(torch.from_numpy(dequantize(quantize(data, Q.Q8_0), Q.Q8_0).reshape(data.shape)))
    return hf


@pytest.mark.parametrize("kind", sorted(ARCH_OF))
def test_quantized_gguf_matches_its_weights(kind: str, tmp_path) -> None:
    hf = tiny_hf_model(kind)
    write_gguf(hf, tmp_path / "moe.gguf", ARCH_OF[kind], types=TYPES)
    loaded = load_model(str(tmp_path / "moe.gguf"), device="cpu", dtype="float32", progress=False)
    ref = _as_stored(hf)
    torch.testing.assert_close(prompt_logits(loaded, PROMPT), hf_logits(ref, PROMPT), atol=1e-4, rtol=1e-4)
    assert greedy(loaded, PROMPT, 24) == hf_greedy(ref, PROMPT, 24)
    cfg = loaded.config
    assert (cfg.num_experts, cfg.expert_ffn) == ((4, 64) if kind == "mixtral" else (8, 64))
    if kind == "mixtral":  # a llama file with experts: renormalised top 2
        assert (cfg.arch, cfg.norm_topk_prob, cfg.experts_per_token) == ("llama", True, 2)
    elif kind == "qwen2_moe":  # llama.cpp's rule for this architecture: weights not renormalised
        assert (cfg.norm_topk_prob, cfg.shared_expert_ffn, cfg.dense_layers) == (False, 96, (1,))
    else:
        assert (cfg.norm_topk_prob, cfg.experts_per_token, cfg.dense_layers) == (True, 2, ())


def test_config_fields_from_a_folder(tmp_path) -> None:
    hf = tiny_hf_model("qwen2_moe")
    hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32", progress=False)
    cfg = loaded.config
    assert (cfg.arch, cfg.num_experts, cfg.experts_per_token, cfg.attention_bias) == ("qwen2moe", 8, 3, True)
    assert isinstance(loaded.model.layers[0].mlp, SparseMLP)
    assert not isinstance(loaded.model.layers[1].mlp, SparseMLP)  # mlp_only_layers


def test_bf16_matches_transformers_bf16_exactly(tmp_path) -> None:
    """The routing, the per-expert products and the ordered combine round as transformers does."""
    hf = tiny_hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="bfloat16", progress=False)
    layer, mlp = hf.model.layers[0].mlp, loaded.model.layers[0].mlp
    layer.to(torch.bfloat16)
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(mlp.forward(x), layer(x[None])[0])


def test_a_token_does_not_depend_on_its_company(tmp_path) -> None:
    hf = tiny_hf_model("qwen2_moe")
    hf.save_pretrained(tmp_path)
    mlp = load_model(str(tmp_path), device="cpu", dtype="bfloat16", progress=False).model.layers[0].mlp
    x = torch.randn(33, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        together = mlp.forward(x)
        alone = torch.cat([mlp.forward(x[i : i + 1]) for i in range(33)])
        assert torch.equal(together, alone)
        # negative control: the test sees a change in one expert where tokens use it
        ids, _ = mlp.route(x)
        mlp.experts.down[int(ids[0, 0])] *= 1.01
        changed = (mlp.forward(x) != together).any(dim=1)
        assert changed[0] and changed.sum() < 33


def test_combine_adds_in_expert_order() -> None:
    """Rounded after each add, smallest expert id first, whatever the slot order."""
    x = torch.ones(1, 4, dtype=torch.bfloat16)
    outs = {0: torch.full((1, 4), 1.0), 1: torch.full((1, 4), 2.0**-8), 2: torch.full((1, 4), 2.0**-8)}
    w = torch.ones(1, 3, dtype=torch.bfloat16)
    def product(e, rows):
        return outs[e].to(torch.bfloat16).expand(rows.shape[0], -1)
    a = combine_loop(x, torch.tensor([[1, 2, 0]]), w, product)  # (2^-8 + 2^-8) + 1 in bf16
    assert torch.all(a == 1.0)  # 0 first: 1 + 2^-8 rounds to 1, twice
    assert torch.all(combine_loop(x, torch.tensor([[0, 1, 2]]), w, product) == a)


def test_route_renormalises_only_when_asked() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    ids, w = route(logits, 2, True, torch.float32)
    assert ids.tolist() == [[3, 2]] and abs(float(w.sum()) - 1.0) < 1e-6
    _, raw = route(logits, 2, False, torch.float32)
    assert float(raw.sum()) < 0.95


def test_bad_expert_counts_are_refused(tmp_path) -> None:
    import json

    hf = tiny_hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_experts_per_tok"] = 9
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="num_experts_per_tok 9"):
        load_model(str(tmp_path), device="cpu", progress=False)


def test_gguf_blocks_mode_keeps_experts_as_blocks(tmp_path) -> None:
    """--weights gguf holds the experts as the file's blocks and computes what dense computes;
    an expert cache over those blocks gives their bits."""
    from strata.models.block_experts import BlockExperts
    from strata.models.experts import CacheStats, install_expert_cache

    write_gguf(tiny_hf_model("qwen3_moe"), tmp_path / "moe.gguf", "qwen3moe", types=TYPES)
    path = str(tmp_path / "moe.gguf")
    dense = load_model(path, device="cpu", dtype="float32", weights="dense", progress=False)
    blocks = load_model(path, device="cpu", dtype="float32", weights="gguf", progress=False)
    assert isinstance(blocks.model.layers[0].mlp.experts, BlockExperts)
    torch.testing.assert_close(prompt_logits(blocks, PROMPT), prompt_logits(dense, PROMPT), atol=2e-4, rtol=2e-4)
    want = prompt_logits(blocks, PROMPT)
    host = load_model(path, device="cpu", dtype="float32", weights="gguf", progress=False, experts_on_host=True)
    install_expert_cache(host.model, 1, torch.device("cpu"), CacheStats())
    assert torch.equal(prompt_logits(host, PROMPT), want)


def test_cpu_kernel_loop_equals_the_python_loop(tmp_path) -> None:
    """`experts_dense` / `experts_blocks` (C++) give combine_loop's bits, dense and in blocks."""
    from strata.kernels.cpu.loader import cpu_kernel
    from strata.models.moe import swiglu

    k = cpu_kernel()
    assert k is not None, "the CPU kernels did not build"
    write_gguf(tiny_hf_model("qwen3_moe"), tmp_path / "moe.gguf", "qwen3moe", types=TYPES)
    for weights in ("dense", "gguf"):
        loaded = load_model(str(tmp_path / "moe.gguf"), device="cpu", dtype="bfloat16", weights=weights,
                            progress=False)
        mlp = loaded.model.layers[0].mlp
        x = torch.randn(13, 64, dtype=torch.bfloat16)
        ids, w = mlp.route(x)
        ex = mlp.experts
        if weights == "dense":
            ref = combine_loop(x, ids, w, lambda e, r: swiglu(r, ex.gate[e], ex.up[e], ex.down[e]))
        else:
            ref = combine_loop(x, ids, w, lambda e, r: ex.math._swiglu(e, r, ex.tensors()))
        got = ex.forward(x, ids, w)
        assert torch.equal(got, ref), weights
        w2 = w.clone()
        w2[0, 0] += 0.25  # negative control: a changed weight shows
        assert not torch.equal(ex.forward(x, ids, w2), ref)
