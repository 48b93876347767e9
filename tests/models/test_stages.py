"""The seams a layer split stands on: `embed`, `run_layers(start, end)`, `head`, and a pool that
holds a range of layers. Two stages, each with its own pool of its own layers, must give the
bits of one model over one pool (on the CPU in bfloat16, where outputs are exact)."""

from __future__ import annotations

import pytest
import torch

from strata.attention.reference import TableAttention
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec

STEPS = [[SeqSpec(0, 0, 7), SeqSpec(1, 0, 3)], [SeqSpec(0, 7, 1), SeqSpec(1, 3, 1)],
         [SeqSpec(0, 8, 1), SeqSpec(1, 4, 5)]]


def _pool(cfg, layers) -> KvPool:
    return KvPool(make_format("bf16", cfg.num_kv_heads, cfg.head_dim), layers, 2, 64, 16, None)


def _ids(step: list[SeqSpec], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(sum(s.start for s in step))
    ids = torch.randint(0, vocab, (sum(s.n for s in step),), generator=g)
    pos = torch.cat([torch.arange(s.start, s.end) for s in step])
    return ids, pos


@pytest.mark.parametrize("kernel", [None, False], ids=["cpu-kernel", "torch"])
def test_two_stages_give_the_bits_of_one(tiny_loaded, kernel) -> None:
    model, cfg = tiny_loaded.model, tiny_loaded.config
    split = cfg.num_layers // 2
    whole = _pool(cfg, cfg.num_layers)
    first, second = _pool(cfg, range(0, split)), _pool(cfg, range(split, cfg.num_layers))
    scale = cfg.attn_scale
    with torch.inference_mode():
        for step in STEPS:
            ids, pos = _ids(step, cfg.vocab_size)
            for pool in (whole, first, second):
                for s in step:
                    assert pool.reserve(s.lane, s.end)
            one = model.compute_logits(model(ids, pos, TableAttention(whole, step, scale, kernel)))
            h = model.embed(ids)
            h = model.run_layers(h, pos, TableAttention(first, step, scale, kernel), 0, split)
            h = model.run_layers(h, pos, TableAttention(second, step, scale, kernel), split)
            assert torch.equal(model.head(h), one)
    # each stage's pool holds only its own layers, with the model's layer numbers
    assert len(first.layers) == split and second.layer_range == range(split, cfg.num_layers)
    cells = whole.cells_of_range(1, 0, 9)
    for layer in range(cfg.num_layers):
        stage = first if layer < split else second
        for name, t in whole.storage(layer).items():
            assert torch.equal(stage.storage(layer)[name][cells], t[cells]), (layer, name)


def test_export_range_and_import_range_move_a_conversation_exactly() -> None:
    fmt = make_format("k8v4", 2, 32)
    src = KvPool(fmt, range(3, 6), 2, 128, 16, 64)
    dst = KvPool(fmt, range(3, 6), 3, 128, 16, None)
    assert src.reserve(1, 40) and dst.reserve(2, 40)
    g = torch.Generator().manual_seed(3)
    cells = src.cells_of_range(1, 0, 40)
    for layer in src.layer_range:
        k, v = torch.randn(2, 40, 2, 32, generator=g).bfloat16()
        src.write(layer, cells, k, v)
    runs = src.export_range(1, 10, 40)
    assert len(runs) == 3 and all(next(iter(r.values())).shape[0] == 30 for r in runs)
    dst.import_range(2, 5, runs)
    for layer in src.layer_range:
        a = src.read(layer, src.cells_of_range(1, 10, 40), torch.bfloat16)
        b = dst.read(layer, dst.cells_of_range(2, 5, 35), torch.bfloat16)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), layer
    with pytest.raises(ValueError, match="layers"):
        dst.import_range(2, 0, runs[:2])
