"""CUDA-graph decode steps: bit-identical to the same padded step run eagerly, close to the
unpadded eager step, and reading moved chunk tables without a re-capture."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from strata.attention.triton_pool import GpuTableAttention
from strata.engine.graphs import DecodeGraphs
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec
from strata.models.base import ModelConfig
from strata.models.layers import DecoderModel

DEV = "cuda"
CFG = ModelConfig(arch="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                  num_heads=8, num_kv_heads=2, head_dim=32, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    torch.manual_seed(0)
    m = DecoderModel(CFG)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.1)
    m = m.to(DEV, torch.bfloat16).eval()
    m.set_max_positions(CFG.max_position_embeddings)
    return m


def _pool(fmt: str, lanes: int = 5) -> KvPool:
    return KvPool(make_format(fmt, CFG.num_kv_heads, CFG.head_dim), CFG.num_layers, lanes, 512, 64,
                  16 * 64, DEV)


@torch.inference_mode()
def _eager(model: DecoderModel, pool: KvPool, seqs: list[SeqSpec], tokens: list[int]) -> torch.Tensor:
    positions = torch.cat([torch.arange(s.start, s.end) for s in seqs]).to(DEV)
    ctx = GpuTableAttention(pool, seqs, CFG.head_dim**-0.5)
    hidden = model(torch.tensor(tokens, device=DEV), positions, ctx)
    ends = torch.cumsum(torch.tensor([s.n for s in seqs]), 0) - 1
    return model.compute_logits(hidden[ends.to(DEV)])


def _prompts(model: DecoderModel, pools: list[KvPool], lens: dict[int, int]) -> dict[int, int]:
    """Read a random prompt per lane into every pool (eagerly, the same bits in each)."""
    g = torch.Generator().manual_seed(1)
    seqs = [SeqSpec(s, 0, n) for s, n in lens.items()]
    tokens = torch.randint(0, CFG.vocab_size, (sum(lens.values()),), generator=g).tolist()
    for p in pools:
        for s, n in lens.items():
            assert p.reserve(s, n + 40)
        _eager(model, p, seqs, tokens)
    return dict(lens)


# 3 lanes run padded to 4 (cuBLAS matmuls); one lane runs the row kernels of kernels/triton/gemv.py
LANES = {3: ({0: 70, 2: 5, 3: 129}, 4), 1: ({2: 131}, 1)}


@pytest.mark.parametrize("lanes", sorted(LANES))
@pytest.mark.parametrize("fmt", ["bf16", "k8v4"])
def test_replay_is_bit_identical_to_the_eager_padded_step(model: DecoderModel, fmt: str,
                                                          lanes: int) -> None:
    pool = _pool(fmt)
    graphs = DecodeGraphs(model, pool, CFG.head_dim**-0.5)
    prompts, size = LANES[lanes]
    lens = _prompts(model, [pool], prompts)
    for step in range(4):
        seqs = [SeqSpec(s, n, 1) for s, n in lens.items()]
        tokens = [(7 * step + 3 * s) % CFG.vocab_size for s in lens]
        eager = graphs.eager(seqs, tokens)
        replay = graphs.forward(seqs, tokens).clone()
        assert graphs.size_for(len(seqs)) == size
        assert torch.isfinite(replay).all()
        assert torch.equal(eager, replay), f"step {step}: replay differs from the eager padded step"
        lens = {s: n + 1 for s, n in lens.items()}


def test_replay_is_close_to_the_unpadded_step_and_follows_moves(model: DecoderModel) -> None:
    pool, ref_pool = _pool("bf16"), _pool("bf16")
    graphs = DecodeGraphs(model, pool, CFG.head_dim**-0.5)
    lens = _prompts(model, [pool, ref_pool], {0: 33, 1: 64, 4: 200})
    for step in range(6):
        if step == 3:  # move conversations 1 <-> 3 in both pools: tables change, graph stays
            for p in (pool, ref_pool):
                p.swap(1, 3)
            lens[3] = lens.pop(1)
        seqs = [SeqSpec(s, n, 1) for s, n in sorted(lens.items())]
        tokens = [(11 * step + s) % CFG.vocab_size for s, _ in sorted(lens.items())]
        got = graphs.forward(seqs, tokens).clone()
        ref = _eager(model, ref_pool, seqs, tokens)
        rel = float((got - ref).norm() / ref.norm())
        assert rel < 2e-2, (step, rel)
        assert torch.equal(got.argmax(-1), ref.argmax(-1)) or rel < 5e-3
        lens = {s: n + 1 for s, n in lens.items()}


def test_padding_lanes_write_only_into_trash(model: DecoderModel) -> None:
    pool = _pool("bf16", lanes=8)
    graphs = DecodeGraphs(model, pool, CFG.head_dim**-0.5)
    lens = _prompts(model, [pool], {0: 10})
    owned = {n: t[: pool.trash * pool.chunk_size].clone() for n, t in pool.layers[0].items()}
    graphs.forward([SeqSpec(0, lens[0], 1)], [5])  # size 1: no padding
    graphs.forward([SeqSpec(0, lens[0], 1), SeqSpec(0, lens[0], 1), SeqSpec(0, lens[0], 1)],
                   [5, 5, 5])  # padded to 4: the padding lane writes into trash only
    for name, t in pool.layers[0].items():
        changed = (t[: pool.trash * pool.chunk_size] != owned[name]).flatten(1).any(1)
        cell = pool.tables[0, lens[0] // pool.chunk_size] * pool.chunk_size + lens[0] % pool.chunk_size
        assert changed.nonzero().flatten().tolist() in ([], [int(cell)]), name
