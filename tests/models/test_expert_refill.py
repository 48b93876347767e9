"""The between-steps half of mapped expert reads (`models/expert_refill.py`), on the CPU.

A mapped step's kernels need Triton (tests/gpu/test_expert_mapped.py runs them); here the steps'
routing logs are written by hand, as a step's kernels write them, and the refill's bookkeeping is
checked after each: what it counts, what it copies, and that a table never sends an expert to a
slot that does not hold it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.errors import BadRequest
from strata.kv.expert_residency import ExpertUsage, admit
from strata.models.expert_refill import PADDING, ExpertRefill
from strata.models.experts import CacheStats, ExpertCache
from strata.models.moe import DenseMath

E, H, I, K = 8, 16, 16, 2
ROWS = 16  # the most rows of a mapped step
CPU = torch.device("cpu")


def _cache(layer: int, slots: int, stats: CacheStats, fused: bool = True) -> ExpertCache:
    g = torch.Generator().manual_seed(layer)
    host = [torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g)]
    return ExpertCache(DenseMath(), host, slots, CPU, layer, stats, fused=fused)


def _refill(slots: int = 3, uploads: int = 1, layers: int = 2) -> tuple[ExpertRefill, CacheStats]:
    stats = CacheStats()
    caches = [_cache(j, slots, stats) for j in range(layers)]
    return ExpertRefill(caches, K, uploads, CPU, ROWS), stats


def _step(refill: ExpertRefill, routing: list[list[list[int]]]) -> None:
    """One mapped step: each layer's [rows, K] expert ids logged, then the runner's call."""
    for j, ids in enumerate(routing):
        flat = torch.tensor(ids, dtype=torch.int64).view(-1)
        refill.logs[j, : flat.numel()] = flat
    refill.after_step(len(routing[0]))


def _consistent(refill: ExpertRefill) -> None:
    """Every expert a table maps is whole in its slot; the device tables are the host's."""
    assert torch.equal(refill.tables, torch.from_numpy(refill.table))
    for j, cache in enumerate(refill.caches):
        for e in range(E):
            s = int(refill.table[j, e])
            if s >= 0:
                assert cache.held[s] == e
                for host, slot in zip(cache.host_tensors(), cache.slot_tensors(), strict=True):
                    assert torch.equal(slot[s], host[e])


def test_counts_copies_and_maps_after_the_copy() -> None:
    refill, stats = _refill(slots=3, uploads=1)
    _step(refill, [[[0, 1]], [[2, 3]]])  # the log of step 1 is read at once on the CPU
    assert (stats.hits, stats.misses, stats.mapped_reads) == (0, 4, 4)
    assert sum(e >= 0 for c in refill.caches for e in c.held) == 2  # one copy a layer
    assert (refill.table < 0).all()  # not mapped before the next call: the copy may be running
    _consistent(refill)
    _step(refill, [[[0, 1]], [[2, 3]]])
    assert (refill.table >= 0).sum() == 2  # the copies of step 1 mapped before step 3
    assert stats.hits == 0  # step 2 read the tables of before
    _step(refill, [[[0, 1]], [[2, 3]]])
    assert stats.hits == 2 and stats.token_layers == 6
    assert stats.bytes_uploaded == 4 * refill.caches[0].expert_bytes
    _consistent(refill)


def test_no_uploads_no_hits() -> None:
    """The control: with no copies a step, nothing is ever mapped, so nothing hits."""
    refill, stats = _refill(uploads=0)
    for _ in range(4):
        _step(refill, [[[0, 1]], [[0, 1]]])
    assert stats.hits == 0 and stats.misses == 16 and (refill.table < 0).all()


def test_a_full_cache_keeps_its_hot_experts() -> None:
    """Slots full of experts used every step: a one-off miss is read in place, not copied over them."""
    refill, stats = _refill(slots=2, uploads=2, layers=1)
    for _ in range(6):
        _step(refill, [[[0, 1]]])
    assert sorted(refill.caches[0].resident()) == [0, 1] and stats.hits > 0
    hits = stats.hits
    _step(refill, [[[0, 5]]])
    _step(refill, [[[0, 1]]])
    assert sorted(refill.caches[0].resident()) == [0, 1]
    assert stats.hits == hits + 1 + 2
    _consistent(refill)


def test_victims_are_unmapped_before_their_slot_is_written() -> None:
    """A slot changes hands: its old expert leaves the table in the same call that starts the copy."""
    refill, _ = _refill(slots=1, uploads=1, layers=1)
    _step(refill, [[[0, 1]]])
    _step(refill, [[[0, 1]]])
    first = int(np.flatnonzero(refill.table[0] >= 0)[0])
    for _ in range(8):  # the other expert used more often now: it takes the slot
        _step(refill, [[[2, 3], [2, 3]]])
        _consistent(refill)
    assert refill.caches[0].resident()[0] in (2, 3) and refill.table[0, first] < 0


def test_padding_rows_are_not_counted() -> None:
    """A graph's padding rows are routed to no expert (`PADDING` ids): nothing counted for them."""
    refill, stats = _refill(layers=1)
    pad = PADDING + torch.arange(K)
    flat = torch.cat([torch.tensor([0, 1]), pad, pad])
    refill.logs[0, : flat.numel()] = flat
    refill.after_step(1)  # one real row: the log's rows past it are not even read
    assert (stats.hits, stats.misses) == (0, 2)
    refill.logs[0, : flat.numel()] = torch.cat([pad, torch.tensor([2, 3]), pad])
    refill.after_step(3)  # had they been read, the padding ids would have to be skipped
    assert stats.misses == 4 and stats.token_layers == 4


def test_padding_rows_route_to_no_expert() -> None:
    refill, _ = _refill()
    ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    refill.before_step(2)
    assert refill.unpadded(ids).tolist() == [[1, 2], [3, 4], [PADDING, PADDING + 1]]
    refill.before_step(ROWS + 1)  # a copy-path step: the mapped steps' count stays
    assert refill.unpadded(ids)[2, 0] == PADDING


def test_long_steps_are_not_logged() -> None:
    """A step of more rows than the log holds took the copy path, which counts for itself."""
    refill, stats = _refill()
    refill.after_step(ROWS + 1)
    assert stats.misses == 0 and not refill.takes(ROWS + 1) and refill.takes(ROWS)


def test_copy_path_settles_and_publishes() -> None:
    """A step the copy path takes (CPU products here) leaves the table equal to its slots."""
    refill, stats = _refill(slots=3, uploads=1, layers=1)
    _step(refill, [[[4, 5]]])
    cache = refill.caches[0]
    x = torch.randn(ROWS + 1, H)
    ids = torch.tensor([[1, 2]] * (ROWS + 1))
    weights = torch.full((ROWS + 1, 2), 0.5)
    with torch.inference_mode():
        cache.forward(x, ids, weights)
    assert {1, 2} <= set(cache.resident())
    assert refill.table[0].tolist() == cache.slot_of
    _consistent(refill)


def test_admit_follows_the_policy() -> None:
    usage = ExpertUsage(4)
    for _ in range(3):
        usage.record([0])
    usage.record([1])
    assert not admit(usage, 1, 0, "lfru") and admit(usage, 0, 1, "lfru")
    assert admit(usage, 1, 0, "lru") and not admit(usage, 1, 0, "lfu")


def test_refused_where_it_cannot_read_in_place() -> None:
    stats = CacheStats()
    with pytest.raises(BadRequest, match="fused kernels"):
        ExpertRefill([_cache(0, 2, stats, fused=False)], K, 1, CPU, ROWS)
    capped = ExpertCache(DenseMath(), [torch.zeros(E, I, H)] * 2 + [torch.zeros(E, H, I)], 2, CPU, 0, stats,
                         max_uploads=1, fused=True)
    with pytest.raises(BadRequest, match="expert-uploads"):
        ExpertRefill([capped], K, 1, CPU, ROWS)
