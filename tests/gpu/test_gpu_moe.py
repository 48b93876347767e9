"""Mixture-of-experts models on CUDA: the fused MoE kernels in the model, the expert cache's bits
against all experts resident, graphs against eager, block experts against their dense values.

Files are tools/synth's tiny-moe shape (4 layers, 16 experts, 4 a token) with the default
model's tokenizer, in bf16 and Q8_0 / Q4_K_M blocks.
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
from strata.models.block_experts import BlockExperts
from strata.models.blocks import weight_bytes
from strata.models.moe import Experts, combine_loop, graph_safe, swiglu
from tools.synth import SHAPES, copy_tokenizer_fields, write_gguf

PROMPTS = [[1, 17, 200, 33, 5, 90, 91, 255], [4, 64, 128, 7, 7, 42], list(range(300, 340)), [9, 8]]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, gpu_tokenizer: str) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("moe")
    fields = copy_tokenizer_fields(gpu_tokenizer)
    out = {}
    for q in ("bf16", "Q8_0", "Q4_K_M"):
        out[q] = folder / f"{q}.gguf"
        write_gguf(out[q], SHAPES["tiny-moe"], fields, quant=q, pool=1 << 22)
    return out


def _run(path: Path, n: int = 16, graphs: bool = True, **flags) -> tuple[list[list[int]], Engine]:
    cfg = EngineConfig(model=str(path), device="cuda", max_context=512, parallel=4, **flags)
    with Engine(cfg) as eng:
        params = SamplingParams(max_tokens=n, temperature=0.0)
        if graphs:
            out = [h.result().token_ids for h in [eng.generate(p, params) for p in PROMPTS]]
        else:
            with eager_steps(eng.runner):
                out = [h.result().token_ids for h in [eng.generate(p, params) for p in PROMPTS]]
        return out, eng


def test_fused_kernels_follow_the_torch_loop(files: dict[str, Path]) -> None:
    loaded = load_model(str(files["bf16"]), device="cuda", dtype="bfloat16", progress=False)
    mlp = loaded.model.layers[1].mlp
    assert isinstance(mlp.experts, Experts) and graph_safe(loaded.model)
    x = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16)
    ids, w = mlp.route(x)
    ex = mlp.experts
    fused = ex.forward(x, ids, w)
    loop = combine_loop(x, ids, w, lambda e, r: swiglu(r, ex.gate[e], ex.up[e], ex.down[e]))
    torch.testing.assert_close(fused, loop, atol=2e-2, rtol=2e-2)
    alone = torch.cat([ex.forward(x[i : i + 1], ids[i : i + 1], w[i : i + 1]) for i in range(37)])
    assert torch.equal(alone, fused)  # a token's bits do not depend on its company


@pytest.mark.parametrize("quant", ["bf16", "Q8_0"])
def test_expert_cache_gives_the_resident_bits(files: dict[str, Path], quant: str) -> None:
    resident, eng = _run(files[quant], graphs=False)
    for slots in ("1", "3"):
        cached, eng = _run(files[quant], expert_cache=slots)
        assert cached == resident, slots
        assert eng.expert_stats is not None and eng.runner.graphs is None
        assert eng.expert_stats.misses > 0
    # copies ahead of use on the copy stream, waited for by an event: the same bits
    ahead, eng = _run(files[quant], expert_cache="3", expert_prefetch=True)
    assert ahead == resident and eng.expert_stats.prefetched > 0


@pytest.mark.parametrize("quant", ["bf16", "Q4_K_M"])
def test_mapped_misses_keep_the_resident_bits_and_graphs(files: dict[str, Path], quant: str) -> None:
    """--expert-misses mapped: misses read in place from pinned host memory, copies between steps;
    decode steps run as CUDA graphs and the tokens are all-resident's."""
    resident, _ = _run(files[quant], graphs=False)
    mapped, eng = _run(files[quant], expert_cache="3", expert_misses="mapped")
    assert mapped == resident
    stats = eng.expert_stats
    assert eng.runner.graphs is not None and stats is not None
    assert stats.mapped_reads > 0 and stats.hits > 0 and stats.bytes_uploaded > 0
    # no copies between steps (prompt pieces still copy theirs in): the same tokens (the controls
    # that a wrong slot or host copy shows: tests/gpu/test_moe_kernels.py, test_expert_mapped.py)
    none, eng = _run(files[quant], expert_cache="1", expert_misses="mapped", expert_uploads=0)
    assert none == resident and eng.expert_stats.mapped_reads > 0


def test_graphs_equal_eager(files: dict[str, Path]) -> None:
    eager, _ = _run(files["Q4_K_M"], graphs=False)
    graphed, eng = _run(files["Q4_K_M"])
    assert eng.runner.graphs is not None and graphed == eager


def test_block_experts_hold_the_files_bytes(files: dict[str, Path]) -> None:
    loaded = load_model(str(files["Q4_K_M"]), device="cuda", dtype="bfloat16", weights="auto", progress=False)
    assert loaded.weights == "gguf"
    assert all(isinstance(layer.mlp.experts, BlockExperts) for layer in loaded.model.layers)
    held = weight_bytes(loaded.model)["cuda:0"]
    assert abs(held - loaded.file_bytes) <= 0.03 * loaded.file_bytes, (held, loaded.file_bytes)
    dense = load_model(str(files["Q4_K_M"]), device="cuda", dtype="bfloat16", weights="dense", progress=False)
    x = torch.randn(21, 256, device="cuda", dtype=torch.bfloat16)
    a, b = loaded.model.layers[0].mlp, dense.model.layers[0].mlp
    torch.testing.assert_close(a.forward(x), b.forward(x), atol=3e-2, rtol=3e-2)


class _OneLayer(torch.nn.Module):
    """What install_expert_cache walks (`.layers[i].mlp`), around one sparse MLP."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        layer = torch.nn.Module()
        layer.mlp = mlp
        self.layers = torch.nn.ModuleList([layer])


def test_an_upload_cap_computes_the_rest_on_the_host(files: dict[str, Path]) -> None:
    """`--expert-uploads`: the misses past the cap come from the host's kernels (close to the
    device's, not their bits); packed GPU blocks are refused, since the host cannot read them."""
    import copy

    from strata.errors import BadRequest
    from strata.models.experts import CacheStats, install_expert_cache

    loaded = load_model(str(files["bf16"]), device="cuda", dtype="bfloat16", progress=False)
    ref = loaded.model.layers[1].mlp
    capped = copy.deepcopy(ref)
    stats = CacheStats()
    install_expert_cache(_OneLayer(capped), 3, torch.device("cuda"), stats, max_uploads=1)
    x = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        for rows in (x, x[:1], x[1:4]):
            torch.testing.assert_close(capped.forward(rows), ref.forward(rows), atol=2e-2, rtol=2e-2)
    assert stats.host_computed > 0 and stats.bytes_uploaded > 0
    out, eng = _run(files["bf16"], expert_cache="3", expert_uploads=1)
    assert all(len(o) == 16 for o in out) and eng.expert_stats.host_computed > 0
    with pytest.raises(BadRequest, match="--expert-uploads"):
        _run(files["Q8_0"], expert_cache="3", expert_uploads=1)
