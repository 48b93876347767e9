"""tools/synth.py's mixture-of-experts files: llama.cpp's qwen3moe layout and a skewed router.

The files are read back by gguf-py's own reader (the reference for names, ggml-order shapes and
types), by Strata's GGUFFile and by transformers, so a layout mistake shows up as a disagreement
with a parser the writer does not share. The router test measures what the docstring promises:
the share of top-k routing the hottest quarter of experts takes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from strata.default_model import default_model_path
from strata.gguf import GGUFFile
from tools.synth import (
    SHAPES,
    Field,
    Shape,
    copy_tokenizer_fields,
    main,
    router_scales,
    router_weights,
    tensor_bytes,
    tensor_plan,
    write_gguf,
)

T = GGMLQuantizationType
TINY = SHAPES["tiny-moe"]
QWEN = SHAPES["qwen3-30b-a3b"]
PER_LAYER = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
             "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]


@pytest.fixture(scope="module")
def tokenizer() -> list[Field]:
    return copy_tokenizer_fields(str(default_model_path()))


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory, tokenizer: list[Field]) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("tiny-moe")
    files = {q: out / f"tiny-moe-{q}.gguf" for q in ("bf16", "Q4_K_M")}
    for quant, path in files.items():
        write_gguf(path, TINY, tokenizer, quant=quant, pool=1 << 20, seed=3)
    return files


def _types(plan: list[tuple[str, tuple[int, ...], int]]) -> dict[str, T]:
    return {name: T(t) for name, _, t in plan}


# ---- the plan --------------------------------------------------------------------------------
def test_qwen3_30b_a3b_tensors_and_shapes() -> None:
    plan = tensor_plan(QWEN, 151936, "bf16")
    names = [n for n, _, _ in plan]
    assert names == (["token_embd.weight"]
                     + [f"blk.{i}.{k}.weight" for i in range(48) for k in PER_LAYER]
                     + ["output_norm.weight", "output.weight"])
    shapes = {n: s for n, s, _ in plan}
    assert shapes["blk.7.attn_q.weight"] == (4096, 2048)  # 32 heads of 128, not hidden / heads
    assert shapes["blk.7.attn_k.weight"] == shapes["blk.7.attn_v.weight"] == (512, 2048)
    assert shapes["blk.7.attn_output.weight"] == (2048, 4096)
    assert shapes["blk.7.attn_q_norm.weight"] == shapes["blk.7.attn_k_norm.weight"] == (128,)
    assert shapes["blk.7.ffn_gate_inp.weight"] == (128, 2048)
    assert shapes["blk.7.ffn_gate_exps.weight"] == (128, 768, 2048)
    assert shapes["blk.7.ffn_up_exps.weight"] == (128, 768, 2048)
    assert shapes["blk.7.ffn_down_exps.weight"] == (128, 2048, 768)
    types = _types(plan)
    assert types["blk.7.ffn_gate_inp.weight"] == types["blk.7.attn_q_norm.weight"] == T.F32
    assert types["blk.7.ffn_down_exps.weight"] == types["output.weight"] == T.BF16
    params = sum(int(np.prod(s)) for _, s, _ in plan)
    assert 30.4e9 < params < 30.6e9  # the 30B of the name (30.5B with Qwen3's vocabulary)


def test_qwen3_30b_a3b_q4_k_m_follows_llama_cpp() -> None:
    types = _types(tensor_plan(QWEN, 151936, "Q4_K_M"))
    # use_more_bits for 48 layers: the first 6, the last 6, and every third between
    more = [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47]
    for i in range(48):
        bits = T.Q6_K if i in more else T.Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down_exps.weight"] == bits, i
        for kind in ("attn_q", "attn_k", "attn_output", "ffn_gate_exps", "ffn_up_exps"):
            assert types[f"blk.{i}.{kind}.weight"] == T.Q4_K, (i, kind)
        for kind in ("attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate_inp"):
            assert types[f"blk.{i}.{kind}.weight"] == T.F32, (i, kind)  # never quantized
    assert types["token_embd.weight"] == T.Q4_K and types["output.weight"] == T.Q6_K


def test_q4_k_m_gives_eight_experts_llama_cpps_extra_bits() -> None:
    eight = Shape(layers=8, hidden=256, ffn=512, heads=4, kv_heads=2, head_size=64,
                  experts=8, experts_used=2, expert_ffn=256)
    types = _types(tensor_plan(eight, 1024, "Q4_K_M"))
    assert types["blk.3.attn_k.weight"] == types["blk.3.attn_v.weight"] == T.Q8_0
    assert types["blk.3.attn_output.weight"] == T.Q5_K and types["blk.3.attn_q.weight"] == T.Q4_K


def test_rows_that_k_quant_blocks_do_not_divide_fall_back_like_llama_cpp() -> None:
    # tiny-moe's ffn_down_exps rows hold 128 values (expert_ffn), half a K-quant block
    cases = (("Q4_K_M", T.Q5_0, T.Q8_0), ("Q5_K", T.Q5_1, T.Q5_1), ("Q6_K", T.Q8_0, T.Q8_0))
    for quant, low, high in cases:
        types = _types(tensor_plan(TINY, 1024, quant))
        downs = [types[f"blk.{i}.ffn_down_exps.weight"] for i in range(4)]
        assert downs == [low, low, high, high], quant
        assert types["blk.0.ffn_up_exps.weight"] == T[quant.removesuffix("_M")]
    types = _types(tensor_plan(TINY, 1024, "Q8_0"))
    assert {types[f"blk.{i}.ffn_down_exps.weight"] for i in range(4)} == {T.Q8_0}


def test_dense_shapes_keep_the_llama_layout() -> None:
    plan = tensor_plan(SHAPES["llama-3.1-8b"], 128256, "Q4_K_M")
    assert len(plan) == 3 + 32 * 9
    assert not any("exps" in n or "gate_inp" in n or "_q_norm" in n for n, _, _ in plan)
    assert {n: s for n, s, _ in plan}["blk.0.attn_q.weight"] == (4096, 4096)


# ---- the written files -----------------------------------------------------------------------
def test_tiny_moe_metadata(tiny_files: dict[str, Path]) -> None:
    reader = GGUFReader(tiny_files["bf16"])
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    a = "qwen3moe"
    expected = {
        "general.architecture": a, "general.file_type": 32,
        f"{a}.block_count": 4, f"{a}.context_length": 4096, f"{a}.embedding_length": 256,
        f"{a}.feed_forward_length": 512, f"{a}.expert_feed_forward_length": 128,
        f"{a}.expert_count": 16, f"{a}.expert_used_count": 4,
        f"{a}.attention.head_count": 4, f"{a}.attention.head_count_kv": 2,
        f"{a}.attention.key_length": 64, f"{a}.attention.value_length": 64,
        f"{a}.vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
    }
    assert {k: meta[k] for k in expected} == expected
    assert meta[f"{a}.rope.freq_base"] == 1e6
    assert meta[f"{a}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert GGUFReader(tiny_files["Q4_K_M"]).fields["general.file_type"].contents() == 15


@pytest.mark.parametrize("quant", ["bf16", "Q4_K_M"])
def test_tiny_moe_tensors_read_back(tiny_files: dict[str, Path], quant: str) -> None:
    path = tiny_files[quant]
    reader = GGUFReader(path)
    plan = tensor_plan(TINY, len(reader.fields["tokenizer.ggml.tokens"].data), quant)
    assert [t.name for t in reader.tensors] == [n for n, _, _ in plan]
    for t, (name, shape, ggml_type) in zip(reader.tensors, plan):
        assert tuple(int(n) for n in t.shape) == tuple(reversed(shape)), name  # ggml order
        assert t.tensor_type == ggml_type and int(t.n_bytes) == tensor_bytes(shape, ggml_type), name
    assert path.stat().st_size >= sum(int(t.n_bytes) for t in reader.tensors)

    f = GGUFFile(path)
    assert f.architecture == "qwen3moe"
    assert f.tensors["blk.2.ffn_down_exps.weight"].shape == (16, 256, 128)
    assert f.tensors["blk.2.ffn_gate_exps.weight"].shape == (16, 128, 256)
    for name in ("blk.0.ffn_gate_exps.weight", "blk.1.ffn_down_exps.weight",
                 "blk.3.ffn_down_exps.weight", "blk.2.attn_v.weight"):
        w = f.load(name)
        assert torch.isfinite(w).all() and 0.005 < float(w.std()) < 0.05, name
        assert abs(float(w.mean())) < 0.003, name
    for layer in range(TINY.layers):  # the router the file holds is router_weights', bit for bit
        router = f.load(f"blk.{layer}.ffn_gate_inp.weight").numpy()
        assert np.array_equal(router, router_weights(TINY, layer, seed=3)), layer
    assert torch.equal(f.load("blk.1.attn_k_norm.weight"), torch.ones(64))


def test_tiny_moe_q4_k_m_types_in_the_file(tiny_files: dict[str, Path]) -> None:
    types = {t.name: t.tensor_type for t in GGUFReader(tiny_files["Q4_K_M"]).tensors}
    # use_more_bits for 4 layers: layers 2 and 3
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(4)] == [T.Q4_K, T.Q4_K, T.Q6_K, T.Q6_K]
    downs = [types[f"blk.{i}.ffn_down_exps.weight"] for i in range(4)]
    assert downs == [T.Q5_0, T.Q5_0, T.Q8_0, T.Q8_0]
    assert types["blk.1.ffn_gate_exps.weight"] == types["blk.1.ffn_up_exps.weight"] == T.Q4_K
    assert types["blk.1.ffn_gate_inp.weight"] == T.F32 and types["output.weight"] == T.Q6_K


def test_transformers_runs_the_tiny_moe_file(tiny_files: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_files["bf16"]
    # transformers' GGUF config mapping for qwen3moe skips expert_feed_forward_length (its
    # default moe_intermediate_size is Qwen3-30B-A3B's 768), so the expert width is passed
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 moe_intermediate_size=128)
    config = model.config
    assert (config.model_type, config.head_dim, config.num_experts, config.num_experts_per_tok) == (
        "qwen3_moe", 64, 16, 4)
    gate = model.model.layers[2].mlp.gate.weight.detach().numpy()
    assert np.array_equal(gate, router_weights(TINY, 2, seed=3))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 17, 300, 4000, 9]])).logits
    assert logits.shape == (1, 5, config.vocab_size) and torch.isfinite(logits).all()
    assert float(logits.std()) > 0.01


# ---- the router's skew -----------------------------------------------------------------------
def top_quarter_share(router: np.ndarray, used: int, tokens: int = 8192, seed: int = 1) -> float:
    """The share of top-`used` routing picks that go to the most-picked quarter of the experts.

    Hidden rows are N(0, 1) normalised to RMS 1: what an RMSNorm with weights 1 hands the router.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, router.shape[1]), dtype=np.float32)
    x /= np.sqrt(np.mean(x * x, axis=1, keepdims=True))
    probs = torch.softmax(torch.from_numpy(x @ router.T), dim=-1)
    picks = torch.topk(probs, used, dim=-1).indices.reshape(-1).numpy()
    counts = np.sort(np.bincount(picks, minlength=router.shape[0]))[::-1]
    return float(counts[: router.shape[0] // 4].sum() / picks.size)


@pytest.mark.parametrize("layer", [0, 1, 47])
def test_skewed_router_gives_the_hot_quarter_most_of_the_routing(layer: int) -> None:
    skewed = top_quarter_share(router_weights(QWEN, layer), QWEN.experts_used)
    uniform = top_quarter_share(router_weights(QWEN, layer, router="uniform"), QWEN.experts_used)
    assert 0.55 < skewed < 0.65, skewed  # measured about 0.60
    assert 0.23 < uniform < 0.30, uniform  # the negative control: about 0.27 (25% is exact balance)


def test_each_layer_has_its_own_hot_experts() -> None:
    hot = [set(np.argsort(-router_scales(128, layer))[:32].tolist()) for layer in range(8)]
    overlaps = [len(hot[i] & hot[i + 1]) for i in range(7)]
    assert max(overlaps) < 16, overlaps  # about 8 of 32, what unrelated draws share
    scales = router_scales(128, 0)
    assert np.sqrt(np.mean(scales**2)) == pytest.approx(1.0)
    by_rank = np.arange(1, 129) ** -0.35
    assert np.sort(scales)[::-1] == pytest.approx(by_rank / np.sqrt(np.mean(by_rank**2)))


def test_tiny_moe_router_skews_within_its_ceiling(tiny_files: dict[str, Path]) -> None:
    # with 4 of 16 experts used the top quarter can take at most half (the module docstring)
    router = GGUFFile(tiny_files["bf16"]).load("blk.0.ffn_gate_inp.weight").numpy()
    assert 0.29 < top_quarter_share(router, TINY.experts_used) < 0.5


def test_cli_uniform_router_is_balanced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "uniform.gguf"
    assert main([str(out), "--shape", "tiny-moe", "--router", "uniform", "--quant", "Q8_0",
                 "--tokenizer-from", str(default_model_path())]) == 0
    assert '"parameters"' in capsys.readouterr().out
    f = GGUFFile(out)
    assert f.metadata["general.name"] == "synthetic-tiny-moe"
    assert f.tensors["blk.0.ffn_gate_exps.weight"].ggml_type == T.Q8_0
    for layer in range(TINY.layers):
        router = f.load(f"blk.{layer}.ffn_gate_inp.weight").numpy()
        assert np.array_equal(router, router_weights(TINY, layer, router="uniform"))
        assert 0.22 < top_quarter_share(router, TINY.experts_used) < 0.30


def test_unknown_router_is_refused(tmp_path: Path, tokenizer: list[Field]) -> None:
    with pytest.raises(ValueError, match="router"):
        write_gguf(tmp_path / "x.gguf", TINY, tokenizer, router="zipf", pool=1 << 16)
    with pytest.raises(ValueError, match="dense"):
        router_weights(SHAPES["tiny"], 0)
