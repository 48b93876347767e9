"""KV streaming: streamed attention equals resident attention bit for bit, in every format.

Two pools of the same configuration see the same steps (random prompt chunks
and decode steps of several lanes, releases, prefix reuse and moves); one
keeps everything resident, the other streams through a cache far smaller
than the lanes. The negative control skips the host write of one half and
must be caught.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from strata.attention.reference import TableAttention
from strata.kv.formats import FORMAT_NAMES, Storage, make_format
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec
from strata.kv.stream import StreamedPool, StreamStore

HQ, HKV, D = 4, 2, 32
LAYERS, SESSIONS, CHUNK, MAX_CONTEXT = 2, 4, 16, 176
POOL_TOKENS = SESSIONS * MAX_CONTEXT  # a shared pool: chunks are handed out and reused
BLOCK, RESIDENT = 8, 48  # 6 blocks per layer against lanes of up to 22
DTYPE = torch.bfloat16
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: one thread is many times faster than two fighting over a busy CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class SkipHalfStore(StreamStore):
    """A broken store for the negative control: never writes one half to the host store."""

    half = "v"

    def _write_host(self, layer: int, cells: torch.Tensor, staged: Storage) -> None:
        for name, dest in self.host[layer].items():
            if not name.startswith(self.half):
                dest.index_copy_(0, cells, staged[name].to("cpu"))


class SkipKStore(SkipHalfStore):
    half = "k"


def _pools(fmt: str, device: str, store_cls: type[StreamStore] = StreamStore,
           resident: int = RESIDENT, layers: tuple[int, ...] = tuple(range(LAYERS))) -> tuple[KvPool, KvPool]:
    args = (make_format(fmt, HKV, D), layers, SESSIONS, MAX_CONTEXT, CHUNK, POOL_TOKENS)
    ref = KvPool(*args, device=device)
    streamed = StreamedPool(*args, device=device, resident_cells=resident, block_cells=BLOCK)
    if store_cls is not StreamStore:
        streamed.store = store_cls(streamed, resident, BLOCK, device)
    return ref, streamed


def _step(pools: tuple[KvPool, ...], seqs: list[SeqSpec], gen: torch.Generator,
          device: str) -> list[list[torch.Tensor]]:
    """One engine step on every pool with the same random q/k/v; outputs per pool and layer (the
    model's layer indices: a pool may hold any increasing sequence of them)."""
    t = sum(s.n for s in seqs)
    layers = pools[0].layer_ids
    qkv = [
        (torch.randn(t, HQ, D, generator=gen), torch.randn(t, HKV, D, generator=gen),
         torch.randn(t, HKV, D, generator=gen))
        for _ in layers
    ]
    outs = []
    for pool in pools:
        for s in seqs:
            assert pool.reserve(s.lane, s.end)
        ctx = TableAttention(pool, seqs, D**-0.5)
        outs.append([ctx.attend(layer, *(x.to(device, DTYPE) for x in xs)) for layer, xs in zip(layers, qkv)])
    return outs


@dataclass
class ParityResult:
    batches: int
    first_difference: int | None  # batch index
    figures: dict


def _parity(fmt: str, device: str, store_cls: type[StreamStore] = StreamStore,
            resident: int = RESIDENT, batches: int = 60, seed: int = 0,
            layers: tuple[int, ...] = tuple(range(LAYERS))) -> ParityResult:
    """Random mixed prompt/decode steps with releases, prefix reuse and moves on both pools."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pools = _pools(fmt, device, store_cls, resident, layers)
    length = [0] * SESSIONS
    target = [rng.randrange(40, MAX_CONTEXT + 1) for _ in range(SESSIONS)]
    first = None
    for b in range(batches):
        if rng.random() < 0.1:  # move a conversation (chunk-table swap, no copy)
            a, c = rng.sample(range(SESSIONS), 2)
            for p in pools:
                p.swap(a, c)
            length[a], length[c] = length[c], length[a]
            target[a], target[c] = target[c], target[a]
        seqs = []
        for s in range(SESSIONS):
            if length[s] >= target[s]:  # conversation over: end it or keep a prefix for reuse
                keep = rng.choice([0, rng.randrange(1, length[s])])
                for p in pools:
                    p.release(s, keep_tokens=keep)
                length[s], target[s] = keep, rng.randrange(keep + 8, MAX_CONTEXT + 1)
            r = rng.random()
            if length[s] and r < 0.55:
                seqs.append(SeqSpec(s, length[s], 1))
            elif r < 0.85:
                n = min(rng.randrange(2, 41), target[s] - length[s])
                seqs.append(SeqSpec(s, length[s], n))
        if not seqs:
            continue
        ref, streamed = _step(pools, seqs, gen, device)
        for s in seqs:
            length[s.lane] = s.end
        if first is None and not all(torch.equal(x, y) for x, y in zip(ref, streamed)):
            first = b
            if store_cls is not StreamStore:
                break
    store = pools[1].store
    assert isinstance(store, StreamStore)
    return ParityResult(batches, first, store.figures())


@pytest.mark.parametrize("resident", [RESIDENT, 4 * RESIDENT])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_streamed_attention_equals_resident_bitwise(fmt: str, device: str, resident: int) -> None:
    res = _parity(fmt, device, resident=resident)
    f = res.figures
    print(f"\n{fmt} {device} resident {resident}: {res.batches} batches, "
          f"{f['lookups']} block lookups, "
          f"{f['misses']} misses, hit rate {f['hit_rate']:.3f}, {f['overflow_blocks']} overflow "
          f"blocks, {f['bytes_copied']} bytes copied")
    assert res.first_difference is None, (
        f"{fmt}: streamed attention differs at batch {res.first_difference}")
    assert f["misses"] > 0 and f["overflow_blocks"] > 0 and f["hits"] > 0
    if device == "cuda":  # the host store is pinned, so copies into the cache can be asynchronous
        assert f["pinned_bytes"] == f["host_bytes"] > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["bf16", "k8v4"])
def test_streamed_attention_equals_resident_over_scattered_layers(fmt: str, device: str) -> None:
    """A hybrid model's pool: only its attention layers (here model layers 1, 4 and 5)."""
    res = _parity(fmt, device, layers=(1, 4, 5), batches=30)
    assert res.first_difference is None and res.figures["misses"] > 0


@pytest.mark.parametrize("store_cls", [SkipHalfStore, SkipKStore], ids=["skip-v", "skip-k"])
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_negative_control_skipped_host_half_is_caught(fmt: str, store_cls: type) -> None:
    res = _parity(fmt, "cpu", store_cls)
    assert res.first_difference is not None, (
        f"{fmt}: a store that drops the {store_cls.half} half passed")


@pytest.mark.parametrize("device", DEVICES)
def test_move_needs_no_cache_change(device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    ref, streamed = _pools("k8v4", device, resident=256)  # everything fits
    pools = (ref, streamed)
    store = streamed.store
    assert isinstance(store, StreamStore)
    a, b = _step(pools, [SeqSpec(0, 0, 40)], gen, device)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for pos in range(40, 43):
        a, b = _step(pools, [SeqSpec(0, pos, 1)], gen, device)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    misses, copied = store.stats.misses, store.stats.bytes_copied
    for p in pools:
        p.swap(0, 2)
        p.check_invariants()
    for pos in range(43, 46):  # the conversation continues in lane 2
        a, b = _step(pools, [SeqSpec(2, pos, 1)], gen, device)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert (store.stats.misses, store.stats.bytes_copied) == (misses, copied)


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_reuse_after_release_and_chunk_reuse(device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    pools = _pools("int8", device, resident=96)

    def same(seqs: list[SeqSpec]) -> None:
        a, b = _step(pools, seqs, gen, device)
        assert all(torch.equal(x, y) for x, y in zip(a, b))

    same([SeqSpec(1, 0, 30), SeqSpec(1 + 1, 0, 20)])
    same([SeqSpec(1, 30, 20)])
    for p in pools:  # keep a 20-token prefix; the chunk of positions 32.. goes back
        p.release(1, keep_tokens=20)
    same([SeqSpec(3, 0, 40)])  # lane 3 takes the freed chunk (its cells are cached)
    same([SeqSpec(1, 20, 25), SeqSpec(3, 40, 1)])  # lane 1 continues after its prefix
    for pos in range(45, 50):
        same([SeqSpec(1, pos, 1), SeqSpec(2, 20 + pos - 45, 1), SeqSpec(3, 41 + pos - 45, 1)])


def test_host_writes_behind_the_store_need_invalidate() -> None:
    gen = torch.Generator().manual_seed(3)
    ref, streamed = _pools("q4_0", "cpu", resident=256)
    pools = (ref, streamed)
    _step(pools, [SeqSpec(0, 0, 30)], gen, "cpu")
    cells = ref.cells_of_range(0, 0, 30)
    k, v = torch.randn(30, HKV, D, generator=gen), torch.randn(30, HKV, D, generator=gen)
    for p in pools:  # a restore fills the host store directly (conversation cache, lane file)
        for layer in range(LAYERS):
            p.fmt.write(p.layers[layer], cells, k, v)
    a, b = _step(pools, [SeqSpec(0, 30, 1)], gen, "cpu")
    assert not all(torch.equal(x, y) for x, y in zip(a, b))  # the cache still holds old bytes
    assert isinstance(streamed.store, StreamStore)
    streamed.store.invalidate(cells)
    a, b = _step(pools, [SeqSpec(0, 31, 1)], gen, "cpu")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_figures_and_sizes() -> None:
    pool = StreamedPool(make_format("k8v4", HKV, D), LAYERS, SESSIONS, MAX_CONTEXT, CHUNK,
                         POOL_TOKENS, "cpu", resident_cells=50, block_cells=64)
    store = pool.store
    assert isinstance(store, StreamStore)
    assert store.block == CHUNK  # a block never straddles two chunks
    assert store.slots == 50 // CHUNK
    f = store.figures()
    assert f["host_bytes"] == pool.total_bytes()
    assert f["cache_bytes"] == LAYERS * store.slots * store.block * pool.fmt.cell_bytes()
    assert f["pinned_bytes"] == 0 and f["lookups"] == 0 and f["hit_rate"] == 1.0
    with pytest.raises(ValueError, match="smaller than one block"):
        StreamStore(pool, CHUNK - 1, CHUNK)
