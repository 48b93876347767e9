"""`--weights gguf`: a GGUF file's blocks held as they are and multiplied in place on the CPU."""

from __future__ import annotations

import torch
from dense_context import greedy, prompt_logits
from gguf import GGMLQuantizationType as Q
from gguf_export import write_gguf
from tiny_models import PROMPT, tiny_hf_model

from strata.attention.reference import TableAttention
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec
from strata.models import load_model
from strata.models.blocks import BlockEmbedding, BlockLinear, weight_bytes
from strata.models.quantize import resolve_weight_mode

# v in another type than q and k: the fused q/k/v projection holds two segments
TYPES = {"attn_q.weight": Q.Q8_0, "attn_k.weight": Q.Q8_0, "attn_v.weight": Q.Q4_1,
         "attn_output.weight": Q.Q4_0, "ffn_gate.weight": Q.Q4_1, "ffn_up.weight": Q.Q4_1,
         "ffn_down.weight": Q.Q8_0, "token_embd.weight": Q.Q8_0, "output.weight": Q.Q4_0}


def _file(tmp_path, kind: str = "llama_plain"):
    return write_gguf(tiny_hf_model(kind), tmp_path / "t.gguf", "llama" if kind == "llama_plain" else kind,
                      types=TYPES)


def test_blocks_are_held_as_the_file_stores_them(tmp_path) -> None:
    path = _file(tmp_path)
    loaded = load_model(str(path), device="cpu", dtype="float32", weights="gguf", progress=False)
    m = loaded.model
    assert loaded.weights == "gguf" and loaded.identity.endswith("+gguf")
    qkv = m.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, BlockLinear) and qkv.qtypes == (Q.Q8_0, Q.Q4_1) and qkv.rows == (64 + 32, 32)
    assert all(isinstance(getattr(layer.mlp, n), BlockLinear) for layer in m.layers
               for n in ("gate_up_proj", "down_proj"))
    assert isinstance(m.embed_tokens, BlockEmbedding) and isinstance(m.lm_head, BlockLinear)
    held = weight_bytes(m)["cpu"]
    assert abs(held - loaded.file_bytes) <= 0.01 * loaded.file_bytes, (held, loaded.file_bytes)
    dense = load_model(str(path), device="cpu", dtype="float32", weights="dense", progress=False)
    assert weight_bytes(dense.model)["cpu"] > 2.5 * held  # the dense mode pays for floats


def test_block_weights_compute_the_dense_weights_products(tmp_path) -> None:
    """float32: every weight value is the file's, so logits agree with the dense load to float32
    rounding and greedy tokens are equal."""
    path = _file(tmp_path)
    blocks = load_model(str(path), device="cpu", dtype="float32", weights="gguf", progress=False)
    dense = load_model(str(path), device="cpu", dtype="float32", weights="dense", progress=False)
    for lin_b, lin_d in ((blocks.model.layers[1].self_attn.qkv_proj, dense.model.layers[1].self_attn.qkv_proj),
                         (blocks.model.lm_head, dense.model.lm_head)):
        assert torch.equal(lin_b.dense(), lin_d.weight)  # the very values, decoded
    got, want = prompt_logits(blocks, PROMPT), prompt_logits(dense, PROMPT)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert greedy(blocks, PROMPT, 24) == greedy(dense, PROMPT, 24)


def test_a_rows_result_does_not_depend_on_its_company(tmp_path) -> None:
    path = _file(tmp_path)
    loaded = load_model(str(path), device="cpu", dtype="bfloat16", weights="gguf", progress=False)
    lin = loaded.model.layers[0].mlp.gate_up_proj
    x = torch.randn(9, 64).bfloat16()
    full = lin(x)
    for m in (1, 2, 5):
        assert torch.equal(lin(x[:m]), full[:m]), m
    other = x.clone()
    other[1:] = torch.randn(8, 64).bfloat16()
    assert torch.equal(lin(other)[0], full[0]) and not torch.equal(lin(other)[1], full[1])


def test_auto_keeps_blocks_for_a_quantized_gguf_file(tmp_path) -> None:
    path = _file(tmp_path)
    loaded = load_model(str(path), device="cpu", dtype="bfloat16", weights="auto", progress=False)
    assert loaded.weights == "gguf"
    cpu = torch.device("cpu")
    assert resolve_weight_mode("auto", cpu, torch.bfloat16, block_source=True) == "gguf"
    assert resolve_weight_mode("auto", cpu, torch.bfloat16, four_bit_source=True) == "int4"
    assert resolve_weight_mode("dense", cpu, torch.bfloat16, block_source=True) == "dense"


def _modules_path(loaded) -> None:
    """Every layer computed by its modules (the C++ two-call layer declined)."""
    for layer in loaded.model.layers:
        layer._blocks_plan = ()


def test_a_layer_in_two_cpu_calls_gives_the_modules_bits(tmp_path) -> None:
    """`block_qkv` / `block_tail` compose the modules' C++ functions in their order: logits and
    greedy tokens are the modules' to the bit, with a mixed-type q/k/v and (qwen2) its bias."""
    for kind in ("llama_plain", "qwen2"):
        path = write_gguf(tiny_hf_model(kind), tmp_path / f"{kind}.gguf", "llama" if kind == "llama_plain" else kind,
                          types=TYPES)
        fused = load_model(str(path), device="cpu", dtype="bfloat16", weights="gguf", progress=False)
        plain = load_model(str(path), device="cpu", dtype="bfloat16", weights="gguf", progress=False)
        _modules_path(plain)
        h = torch.randn(3, fused.config.hidden_size).bfloat16()
        assert all(layer._cpu_blocks(h) is not None for layer in fused.model.layers)  # the fold is taken
        got, want = prompt_logits(fused, PROMPT), prompt_logits(plain, PROMPT)
        assert torch.equal(got, want), kind
        assert greedy(fused, PROMPT, 12) == greedy(plain, PROMPT, 12)
        # negative control: one code of one layer's down projection changed in the folded model
        down = fused.model.layers[1].mlp.down_proj.blocks0
        down[0, 4] ^= 0x11
        assert not torch.equal(prompt_logits(fused, PROMPT), want)


def _pool_steps(loaded, steps: list[list[tuple[int, list[int]]]]) -> list[torch.Tensor]:
    """Logits of each step over a shared pool of two lanes: a step is [(lane, tokens)], the
    lanes' rows in one forward, as the engine batches them."""
    cfg, model = loaded.config, loaded.model
    pool = KvPool(make_format("bf16", cfg.num_kv_heads, cfg.head_dim), cfg.num_layers, 2, 64, 16, None)
    pos = [0, 0]
    out = []
    with torch.inference_mode():
        for step in steps:
            seqs = [SeqSpec(lane, pos[lane], len(toks)) for lane, toks in step]
            ids = torch.tensor([t for _, toks in step for t in toks])
            positions = torch.cat([torch.arange(pos[lane], pos[lane] + len(toks)) for lane, toks in step])
            for lane, toks in step:
                pos[lane] += len(toks)
            ctx = TableAttention(pool, seqs, cfg.attn_scale)
            assert ctx.cells_in_place(0, torch.bfloat16) is not None  # the one-call layer is offered
            out.append(model.compute_logits(model(ids, positions, ctx)))
    return out


def test_a_layer_in_one_cpu_call_over_the_pool_gives_the_modules_bits(tmp_path) -> None:
    """`BlockLayer.forward` (K/V written and attended in place in the pool) against the modules
    with the context's own `attend`: prompts of two lanes, then decode rows of both together."""
    path = _file(tmp_path)
    fused = load_model(str(path), device="cpu", dtype="bfloat16", weights="gguf", progress=False)
    plain = load_model(str(path), device="cpu", dtype="bfloat16", weights="gguf", progress=False)
    _modules_path(plain)
    steps = [[(0, PROMPT)], [(1, PROMPT[:5]), (0, [7])], [(0, [9]), (1, [11])], [(1, [12, 13, 14])]]
    got, want = _pool_steps(fused, steps), _pool_steps(plain, steps)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    fused.model.layers[0].self_attn.o_proj.blocks0[3, 2] ^= 0x01  # negative control: one code (Q4_0)
    assert not torch.equal(_pool_steps(fused, steps)[-1], want[-1])
