"""Mapped expert reads (`--expert-misses mapped`): a cached layer whose misses are read in place from
host memory, refilled between steps, gives the bits of every expert resident, step after step.

Runs on the GPU (the host copies pinned and read over the bus) or, opt-in, under Triton's
interpreter on the CPU (tests/gpu/kernel_device.py).
"""

from __future__ import annotations

import pytest

from tests.gpu.kernel_device import kernel_device  # before any kernel is defined

import torch

DEV = torch.device(kernel_device())
from gguf import GGMLQuantizationType as T

from strata.kernels.triton import moe_blocks
from strata.models.block_experts import BlockExperts
from strata.models.expert_refill import ExpertRefill
from strata.models.experts import CacheStats, ExpertCache
from strata.models.moe import SparseMLP
from tests.gpu.test_block_kernels import make_blocks

ROWS = 32  # the most rows of a mapped step here


def _layer(hidden: int, ffn: int, qtype: int | None) -> SparseMLP:
    """A sparse MLP of 8 experts, 2 a token, with random weights (Q4_K blocks if qtype)."""
    g = torch.Generator().manual_seed(5)
    mlp = SparseMLP(hidden, 8, 2, ffn, normalise=True)
    with torch.no_grad():
        mlp.router.weight.copy_(torch.randn(8, hidden, generator=g))
        for p in mlp.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    mlp = mlp.to(DEV, torch.bfloat16)
    if qtype is not None:
        parts = [(qtype, make_blocks(qtype, 8 * n, k, seed)[0].cpu().view(8, n, -1))
                 for n, k, seed in ((ffn, hidden, 1), (ffn, hidden, 2), (hidden, ffn, 3))]
        mlp.hold_experts(BlockExperts(parts, hidden, ffn, packed=True).to(DEV))
    return mlp


def _resident(ref: SparseMLP, x: torch.Tensor) -> torch.Tensor:
    """Every expert resident, through the fused kernels (BlockExperts takes them on CUDA only)."""
    if not isinstance(ref.experts, BlockExperts):
        return ref.forward(x)
    ids, w = ref.route(x)
    gate, up, down = (t.view(-1, t.shape[2]) for t in ref.experts.tensors())
    qg, _, qd = ref.experts.math.qtypes
    return moe_blocks.moe_blocks(x, gate, up, down, int(qg), int(qd), ids, w, True)


def _mapped(ref: SparseMLP, slots: int, uploads: int) -> tuple[SparseMLP, ExpertRefill, CacheStats]:
    import copy

    mlp = copy.deepcopy(ref)
    stats = CacheStats()
    cache = ExpertCache(mlp.experts.math, mlp.experts.tensors(), slots, DEV, 0, stats, fused=True)
    mlp.hold_experts(cache)
    return mlp, ExpertRefill([cache], mlp.top_k, uploads, DEV, ROWS), stats


@pytest.mark.parametrize("qtype", [None, T.Q4_K], ids=["bf16", "Q4_K"])
def test_mapped_reads_give_the_resident_bits(qtype: int | None) -> None:
    hidden, ffn = (256, 256) if qtype is not None else (64, 64)
    ref = _layer(hidden, ffn, qtype)
    mlp, refill, stats = _mapped(ref, slots=3, uploads=1)
    g = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        for rows in (17, 1, 1, 3, 1, 1, 1, 9, 1, 1, 1):
            x = torch.randn(rows, hidden, generator=g).to(DEV, torch.bfloat16)
            assert torch.equal(mlp.forward(x), _resident(ref, x))
            refill.after_step(rows)
        refill.settle()
    assert stats.mapped_reads > 0 and stats.hits > 0 and stats.bytes_uploaded > 0
    assert (refill.table >= 0).sum() <= 3


def test_a_long_step_takes_the_copy_path_and_publishes() -> None:
    """A step of more rows than the log holds copies its misses in (all resident after it) and
    leaves the table equal to its slots; the mapped steps around it still give the resident bits."""
    ref = _layer(64, 64, None)
    mlp, refill, stats = _mapped(ref, slots=8, uploads=1)
    g = torch.Generator().manual_seed(8)
    with torch.inference_mode():
        for rows in (1, ROWS + 1, 1, 1):
            x = torch.randn(rows, 64, generator=g).to(DEV, torch.bfloat16)
            assert torch.equal(mlp.forward(x), ref.forward(x))
            if rows > ROWS:
                assert refill.table[0].tolist() == mlp.experts.slot_of and len(mlp.experts.resident()) == 8
                reads = stats.mapped_reads
            refill.after_step(rows)
    assert stats.mapped_reads == reads and stats.hits >= 2  # everything resident after the long step


def test_a_wrong_host_copy_shows() -> None:
    """The control: one changed weight of an expert read in place changes its tokens' rows."""
    ref = _layer(64, 64, None)
    mlp, refill, _ = _mapped(ref, slots=1, uploads=0)  # nothing ever copied: all read in place
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(9)).to(DEV, torch.bfloat16)
    with torch.inference_mode():
        ids, _ = ref.route(x)
        mlp.experts.host_tensors()[0][int(ids[0, 0])] *= 1.5
        assert not torch.equal(mlp.forward(x), ref.forward(x))


def test_padding_rows_read_no_expert() -> None:
    """A step padded as a CUDA graph pads it: the real rows give the resident bits, the padding
    rows log no expert, and their experts are neither read nor counted."""
    ref = _layer(64, 64, None)
    mlp, refill, stats = _mapped(ref, slots=2, uploads=0)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10)).to(DEV, torch.bfloat16)
    with torch.inference_mode():
        refill.before_step(3)
        y = mlp.forward(x)
        assert torch.equal(y[:3], ref.forward(x[:3]))
        logged = refill.logs[0, : 8 * mlp.top_k].view(8, mlp.top_k)
        assert bool((logged[3:] >= mlp.experts.num_experts).all())
        assert bool((logged[:3] < mlp.experts.num_experts).all())
        refill.after_step(3)
        need = len(set(ref.route(x[:3])[0].reshape(-1).tolist()))
    assert stats.hits + stats.misses == need
