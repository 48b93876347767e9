"""`--weights gguf` on CUDA: quantized files' blocks held on the GPU and multiplied by the Triton
block kernels, against the CPU's block kernels and the dense weights.

Files are tools/synth's random-block files in the tiny shape (hidden 256, so K-quant rows are
whole super-blocks): Q4_K_M (Q4_K with Q6_K tensors), Q8_0, Q6_K, Q4_1.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
from pathlib import Path

import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from benchmarks.engine_runs import eager_steps
from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from strata.models import load_model
from strata.models.blocks import BlockEmbedding, BlockLinear, weight_bytes
from tools.synth import SHAPES, copy_tokenizer_fields, write_gguf

QUANTS = ("Q4_K_M", "Q8_0", "Q6_K", "Q4_1")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, gpu_tokenizer: str) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("blocks")
    fields = copy_tokenizer_fields(gpu_tokenizer)
    out = {}
    for q in QUANTS:
        out[q] = folder / f"{q}.gguf"
        write_gguf(out[q], SHAPES["tiny"], fields, quant=q, pool=1 << 22)
    return out


def _complete(path: Path, device: str, dtype: str, weights: str, prompt: list[int], n: int) -> list[int]:
    loaded = load_model(str(path), device=device, dtype=dtype, weights=weights, progress=False)
    with Engine(EngineConfig(max_context=512), loaded=loaded) as e:
        return e.complete(prompt, SamplingParams(max_tokens=n, temperature=0.0)).token_ids


@pytest.mark.parametrize("quant", QUANTS)
def test_the_gpu_holds_the_files_bytes(files: dict[str, Path], quant: str) -> None:
    loaded = load_model(str(files[quant]), device="cuda", dtype="bfloat16", weights="auto", progress=False)
    m = loaded.model
    assert loaded.weights == "gguf"
    assert isinstance(m.embed_tokens, BlockEmbedding) and isinstance(m.lm_head, BlockLinear)
    assert all(isinstance(getattr(layer.mlp, n), BlockLinear) for layer in m.layers
               for n in ("gate_up_proj", "down_proj"))
    held = weight_bytes(m)["cuda:0"]
    assert abs(held - loaded.file_bytes) <= 0.02 * loaded.file_bytes, (held, loaded.file_bytes)


@pytest.mark.parametrize("quant", QUANTS)
def test_float32_greedy_tokens_equal_the_cpus(files: dict[str, Path], quant: str) -> None:
    """The same weight values and IEEE float32 products on both devices: the same greedy text."""
    prompt = list(range(100, 140))
    gpu = _complete(files[quant], "cuda", "float32", "gguf", prompt, 24)
    cpu = _complete(files[quant], "cpu", "float32", "gguf", prompt, 24)
    assert gpu == cpu


@pytest.mark.parametrize("quant", QUANTS)
def test_bf16_products_are_the_dense_weights(files: dict[str, Path], quant: str) -> None:
    """Each projection's product on the GPU is the dense bf16 product of the decoded weights, for
    one row (the folded one-row kernels) and for many (the tile kernel)."""
    loaded = load_model(str(files[quant]), device="cuda", dtype="bfloat16", weights="gguf", progress=False)
    torch.manual_seed(0)
    for lin in (loaded.model.layers[0].self_attn.qkv_proj, loaded.model.layers[1].mlp.down_proj,
                loaded.model.lm_head):
        w = lin.dense(torch.bfloat16)
        for m in (1, 7, 64):
            x = torch.randn(m, lin.in_features, device="cuda").bfloat16()
            want = (x.double() @ w.double().t())
            got = lin(x).double()
            tol = 2 ** -7 * want.abs().max()  # one rounding to bf16 of the result
            assert (got - want).abs().max() <= tol, (quant, m)


def test_graph_decode_equals_eager(files: dict[str, Path]) -> None:
    """One lane through CUDA graphs replays the eager step's bits (the block kernels own whole
    rows: no split-K, no atomics)."""
    loaded = load_model(str(files["Q4_K_M"]), device="cuda", dtype="bfloat16", weights="gguf", progress=False)
    prompt = list(range(300, 330))
    with Engine(EngineConfig(max_context=512), loaded=loaded) as e:
        assert e.runner.graphs is not None
        with_graphs = e.complete(prompt, SamplingParams(max_tokens=32, temperature=0.0)).token_ids
        with eager_steps(e.runner):
            eager = e.complete(prompt, SamplingParams(max_tokens=32, temperature=0.0)).token_ids
    assert with_graphs == eager
