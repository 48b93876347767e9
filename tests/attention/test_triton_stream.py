"""Streamed attention on the Triton kernels (attention/triton_stream.py): host-side planning and kernels.

The host-side tests (translated tables, every layer's residency at once, the
copies, write-behind) need neither a GPU nor Triton. The kernel tests run
where the kernels do: on CUDA, or on the CPU under Triton's interpreter
(`STRATA_TRITON_INTERPRET=1`, see tests/gpu/kernel_device.py); elsewhere
they skip. There the streamed kernels must give the bits of the same kernels
over a resident pool, and stay close to the torch reference over a streamed
pool.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
if HAVE_TRITON:  # before Triton is imported: the interpreter is chosen then
    from tests.gpu.kernel_device import INTERPRET
else:
    INTERPRET = False

from strata.attention.reference import TableAttention
from strata.attention.select import backend_for
from strata.attention.triton_stream import plan_step
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec
from strata.kv.stream import StreamedPool, StreamStore
from strata.kv.stream_copies import StreamCopies, WriteBehind, coalesce
from tests.kv.test_stream import _one_thread  # noqa: F401 - autouse: one torch thread here too

HQ, HKV, D = 4, 2, 32
LAYERS, SESSIONS, CHUNK, MAX_CONTEXT = 3, 3, 32, 320
BLOCK, RESIDENT = 16, 64  # 4 blocks per layer against lanes of up to 20
KERNEL_DEV = "cuda" if torch.cuda.is_available() else ("cpu" if INTERPRET else None)


def _streamed(fmt: str = "bf16", device: str = "cpu", resident: int = RESIDENT,
              pool_tokens: int | None = None, overlap: bool | None = None) -> KvPool:
    return StreamedPool(make_format(fmt, HKV, D), LAYERS, SESSIONS, MAX_CONTEXT, CHUNK, pool_tokens,
                         device, resident_cells=resident, block_cells=BLOCK, overlap=overlap)


def _fill(pool: KvPool, lens: dict[int, int], seed: int = 0) -> None:
    """Random cells at positions [0, n) of each lane, straight into the host store."""
    gen = torch.Generator().manual_seed(seed)
    for s, n in lens.items():
        assert pool.reserve(s, n + 8)
        cells = pool.cells_of_range(s, 0, n)
        for layer in range(LAYERS):
            k, v = torch.randn(2, n, HKV, D, generator=gen)
            pool.fmt.write(pool.layers[layer], cells, k, v)


# ---- host side ---------------------------------------------------------------------------

def test_coalesce_runs() -> None:
    src = np.array([7, 3, 4, 5, 9, 10])
    dst = np.array([1, 20, 21, 30, 2, 3])
    assert coalesce(src, dst) == [(3, 20, 2), (5, 30, 1), (7, 1, 1), (9, 2, 2)]
    assert coalesce(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []


def test_plan_pairs_are_the_runs_block_by_block() -> None:
    """The gather kernel's (host block, area block) pairs and the `copy_` path's runs agree."""
    pool = _streamed("bf16", pool_tokens=8 * CHUNK)
    _fill(pool, {0: 70, 1: 90})
    store = pool.store
    assert isinstance(store, StreamStore)
    plan = plan_step(store, [SeqSpec(0, 69, 1), SeqSpec(1, 89, 1)], 2)
    for layer in range(LAYERS):
        p = plan.pairs[layer]
        assert p.dtype == np.int64 and p.shape[1] == 2
        assert bool((np.diff(p[:, 0]) > 0).all())  # by host block, each once
        b = store.block  # runs count cells, pairs count blocks
        assert all(s % b == 0 and d % b == 0 and n % b == 0 for s, d, n in plan.runs[layer])
        expanded = [(s // b + i, d // b + i) for s, d, n in plan.runs[layer] for i in range(n // b)]
        assert expanded == [tuple(x) for x in p.tolist()]
        assert int((p[:, 1] >= store.scratch0 // store.block).sum()) == plan.overflow[layer] > 0


@pytest.mark.parametrize("ring", [1, 2])
def test_translated_tables_address_the_host_cells(ring: int) -> None:
    """After a step's copies, every position a sequence reads sits at its translated row."""
    pool = _streamed("int8", pool_tokens=8 * CHUNK)  # shared: chunks scattered between lanes
    for s, n in [(0, 20), (1, 40), (0, 70), (2, 5), (1, 90)]:
        assert pool.reserve(s, n)
    _fill(pool, {0: 70, 1: 90, 2: 5})
    store = pool.store
    assert isinstance(store, StreamStore)
    seqs = [SeqSpec(0, 69, 1), SeqSpec(1, 60, 30), SeqSpec(2, 4, 1)]
    plan = plan_step(store, seqs, ring)
    state = store.copies
    B = store.block
    assert plan.tables.shape == (LAYERS, 3, -(-90 // B))
    for layer in range(LAYERS):  # (layers share scratch regions: check each before the next copies)
        state.enqueue(layer, plan.runs[layer], True)
        for i, s in enumerate(seqs):
            pos = torch.arange(s.end)
            rows = plan.tables[layer, i, pos // B] * B + pos % B
            cells = pool.cells(s.lane, pos)
            for name, t in store.area.items():
                assert torch.equal(t[rows], pool.layers[layer][name][cells]), (layer, i, name)
        # new tokens are written at their sequence's rows, which the reads above cover
        tok = torch.cat([torch.arange(s.start, s.end) for s in seqs])
        seq = torch.cat([torch.full((s.n,), i) for i, s in enumerate(seqs)])
        assert torch.equal(plan.write_rows[layer], plan.tables[layer, seq, tok // B] * B + tok % B)
    assert torch.equal(plan.cells, torch.cat([pool.cells_of_range(s.lane, s.start, s.end)
                                              for s in seqs]))
    # 4 slots against 12 needed blocks: the rest from scratch regions, one per ring slot
    assert all(o == plan.need.numel() - store.slots for o in plan.overflow)
    scratch0 = store.scratch0 // B
    for layer in range(LAYERS):
        over = plan.tables[layer][plan.tables[layer] >= scratch0]
        lo = scratch0 + (layer % ring) * plan.region_blocks
        assert bool(((over >= lo) & (over < lo + plan.region_blocks)).all())


LENS = {0: 100, 1: 50, 2: 7}


def _planned_and_read() -> tuple[KvPool, KvPool]:
    """Two streamed pools with the same cells: one to plan, one to read layer by layer."""
    a, b = _streamed("bf16"), _streamed("bf16")
    _fill(a, LENS)
    _fill(b, LENS)
    return a, b


def _plans_equal_reads(a: KvPool, b: KvPool, steps: int) -> None:
    """`plan_layers` on a's store and per-layer reads on b's, step by step: the same maps, plans
    and figures (overflow bytes aside: plan_step counts those itself)."""
    sa, sb = a.store, b.store
    assert isinstance(sa, StreamStore) and isinstance(sb, StreamStore)
    for step in range(steps):
        seqs = [SeqSpec(s, n + step, 1) for s, n in LENS.items()]
        cells = torch.cat([a.cells_of_range(s.lane, 0, s.end) for s in seqs])
        need = torch.unique(cells // sa.block)
        plans = sa.plan_layers(need)
        for layer in range(LAYERS):
            sb.read(layer, cells, torch.bfloat16)
            assert torch.equal(sa.block_slot[layer], sb.block_slot[layer]), (step, layer)
            assert torch.equal(sa.slot_block[layer], sb.slot_block[layer]), (step, layer)
            assert torch.equal(plans[layer][0], sb.block_slot[layer][need])
        figures = lambda st: {k: v for k, v in st.as_dict().items() if k != "overflow_bytes"}  # noqa: E731
        assert figures(sa.stats) == figures(sb.stats)


def test_residency_for_all_layers_matches_the_per_layer_reads() -> None:
    """`plan_layers` makes the decisions the reference path's per-layer reads make."""
    _plans_equal_reads(*_planned_and_read(), steps=5)


def test_layers_out_of_step_are_resolved_by_themselves() -> None:
    """A layer whose cache differs from layer 0's (a read of its own before the step) is not given
    layer 0's resolution: the maps and figures still equal the per-layer reads'. The layers in
    step with layer 0 take its result (one resolution for them all)."""
    a, b = _planned_and_read()
    other = a.cells_of_range(1, 0, 50)
    for pool in (a, b):  # layer 1 alone reads lane 1: its cache is no longer layer 0's
        pool.store.read(1, other, torch.bfloat16)
    assert not torch.equal(a.store.block_slot[1], a.store.block_slot[0])  # the case under test exists
    _plans_equal_reads(a, b, steps=4)


def test_write_behind_lands_at_flush_and_before_host_io() -> None:
    pool = _streamed("k8v4")
    _fill(pool, {0: 30})
    store = pool.store
    assert isinstance(store, StreamStore)
    state = store.copies
    cells = pool.cells_of_range(0, 30, 33)
    src = make_format("k8v4", HKV, D).allocate(LAYERS * 3, "cpu")
    gen = torch.Generator().manual_seed(5)
    stage = state.staging(LAYERS * 3)
    for name, t in src.items():
        t.copy_(torch.randint(0, 100, t.shape, generator=gen).to(t.dtype))
        stage[name][: LAYERS * 3].copy_(t)
    before = {n: t[cells].clone() for n, t in pool.layers[1].items()}
    state.behind = WriteBehind(cells, 3, {0, 1, 2}, dirty=True)
    state.send_behind()
    for n, t in pool.layers[1].items():  # sent, not yet scattered: the host store is unchanged
        assert torch.equal(t[cells], before[n])
    runs = pool.export_range(0, 30, 33)[1]  # raw host I/O settles first
    assert state.behind is None
    for name in runs:
        assert torch.equal(runs[name], src[name][3:6])
    for layer in range(LAYERS):
        for name, t in pool.layers[layer].items():
            assert torch.equal(t[cells], src[name][3 * layer : 3 * layer + 3])


def test_overlap_switch_and_context_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_STREAM_OVERLAP", "0")
    assert _streamed().store.overlap is False
    monkeypatch.setenv("STRATA_STREAM_OVERLAP", "1")
    assert _streamed().store.overlap is True
    assert _streamed(overlap=False).store.overlap is False
    # the gather switch: auto (None) by default, off from the env; the CPU copies with copy_
    # unless a test asks for the kernel (Triton's interpreter)
    monkeypatch.setenv("STRATA_STREAM_GATHER", "0")
    assert _streamed().store.gather is False
    monkeypatch.delenv("STRATA_STREAM_GATHER")
    pool = _streamed()
    assert pool.store.gather is None and pool.store.copies.use_gather() is False
    # the CPU keeps the reference path; a plain pool is no streamed pool
    assert backend_for(_streamed()) is TableAttention
    assert isinstance(_streamed().store.copies, StreamCopies)


def test_scratch_grows_and_keeps_resident_rows() -> None:
    pool = _streamed("bf16")
    _fill(pool, {0: 40})
    store = pool.store
    assert isinstance(store, StreamStore)
    first = plan_step(store, [SeqSpec(0, 39, 1)], 2)
    state = store.copies
    for layer in range(LAYERS):
        state.enqueue(layer, first.runs[layer], True)
    resident = {n: t[: store.scratch0].clone() for n, t in store.area.items()}
    small = state.region_blocks
    _fill(pool, {1: 300})
    plan = plan_step(store, [SeqSpec(0, 39, 1), SeqSpec(1, 299, 1)], 2)
    assert state.region_blocks > small and plan.region_blocks == state.region_blocks
    rows = next(iter(store.area.values())).shape[0]
    assert rows >= store.scratch0 + 2 * state.region_blocks * store.block
    for n, t in store.area.items():
        assert torch.equal(t[: store.scratch0], resident[n])


# ---- the kernels (CUDA, or the CPU under Triton's interpreter) ----------------------------

needs_kernels = pytest.mark.skipif(
    KERNEL_DEV is None, reason="needs CUDA or STRATA_TRITON_INTERPRET=1 (and Triton)")


def _run_steps(fmt: str, overlap: bool, steps: int, device: str, resident: int = RESIDENT,
               seed: int = 0, gather: bool | None = None) -> None:
    """Prompts, then decode steps: streamed kernels == resident kernels bit for bit; the torch
    reference over a streamed pool close; host store == resident pool after settling."""
    from strata.attention.triton_pool import GpuTableAttention
    from strata.attention.triton_stream import GpuStreamAttention

    args = (make_format(fmt, HKV, D), LAYERS, SESSIONS, MAX_CONTEXT, CHUNK, 8 * CHUNK)
    res = KvPool(*args, device=device)
    st = StreamedPool(*args, device=device, resident_cells=resident, block_cells=BLOCK,
                       overlap=overlap, gather=gather)
    ref = StreamedPool(*args, device=device, resident_cells=resident, block_cells=BLOCK)
    gen = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16
    # prompts, then a mixed step (a prompt chunk over a cached prefix beside decode lanes), then decode
    schedule = [{0: 37, 1: 70, 2: 1}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 40, 2: 1}]
    schedule += [{0: 1, 1: 1, 2: 1}] * steps
    cur = dict.fromkeys(range(SESSIONS), 0)
    for step in schedule:
        seqs = [SeqSpec(lane_ids, cur[lane_ids], n) for lane_ids, n in step.items()]
        for x in seqs:
            cur[x.lane] = x.end
        t = sum(s.n for s in seqs)
        for p in (res, st, ref):
            for s in seqs:
                assert p.reserve(s.lane, s.end)
        ctxs = [GpuTableAttention(res, seqs, D**-0.5),
                GpuStreamAttention(st, seqs, D**-0.5),
                TableAttention(ref, seqs, D**-0.5, kernel=False)]
        for layer in range(LAYERS):
            q, k, v = (torch.randn(t, h, D, generator=gen).to(device, dt) for h in (HQ, HKV, HKV))
            a, b, c = (ctx.attend(layer, q, k, v) for ctx in ctxs)
            assert torch.equal(a, b), (seqs, layer)
            rel = float((b.double() - c.double()).norm() / c.double().norm())
            assert rel < (0.02 if fmt == "bf16" else 0.1), (seqs, layer, rel)
    store = st.store
    assert isinstance(store, StreamStore)
    assert store.stats.overflow_blocks > 0 and store.stats.hits > 0
    if gather is not None:
        assert store.copies.use_gather() is gather
    store.settle()
    for layer in range(LAYERS):
        for name, x in res.layers[layer].items():
            assert torch.equal(x.cpu(), st.layers[layer][name]), (layer, name)


@needs_kernels
@pytest.mark.parametrize("gather", [True, False], ids=["gather", "copy"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("fmt", ["bf16", "k8v4"])
def test_streamed_kernels_equal_resident_kernels(fmt: str, overlap: bool, gather: bool) -> None:
    _run_steps(fmt, overlap, steps=3, device=KERNEL_DEV, gather=gather)


@needs_kernels
@pytest.mark.parametrize("fmt,heads,dim,block", [
    ("bf16", HKV, D, BLOCK), ("k8v4", HKV, D, BLOCK), ("int8", HKV, D, BLOCK),
    ("q4_0", HKV, D, BLOCK),
    ("q4_0", 1, 32, 1),  # an 18-byte block: copied in bytes, not words
])
def test_gather_kernel_copies_blocks_exactly(fmt: str, heads: int, dim: int, block: int) -> None:
    """The gather kernel: dst[d] = src[s] per (s, d) pair and run, bytes untouched elsewhere.

    "Host" is pinned CPU memory read in place on CUDA; under the interpreter
    both sides are CPU tensors. Small tiles split a block into several, with
    a partial last tile; fewer programs than items make each loop.
    """
    from strata.kernels.triton.gather import MAX_RUNS, block_words, gather_blocks

    dev = KERNEL_DEV
    f = make_format(fmt, heads, dim)
    host = f.allocate(12 * block, "cpu", pin=dev == "cuda")
    area = f.allocate(8 * block, dev)
    gen = torch.Generator().manual_seed(3)
    for t in host.values():
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, generator=gen, dtype=torch.uint8))
    for t in area.values():
        t.view(torch.uint8).fill_(0xA5)
    before = {n: t.cpu().clone() for n, t in area.items()}
    srcs = [block_words(t, block) for t in host.values()]
    dsts = [block_words(t, block) for t in area.values()]
    assert len(srcs) <= MAX_RUNS and all(s is not None for s in srcs)
    if block == 1:
        assert all(s.dtype == torch.uint8 for s in srcs)
    else:
        assert all(s.dtype == torch.int32 for s in srcs)
    pairs = [(11, 0), (3, 7), (4, 2), (0, 5)]
    for k, (dtype, tile, programs) in enumerate([(torch.int64, 64, 3), (torch.int32, 2048, 64)]):
        for t in area.values():
            t.view(torch.uint8).fill_(0xA5)
        p = torch.tensor(pairs[k:], dtype=dtype, device=dev)
        gather_blocks(p, srcs, dsts, programs, tile=tile)
        if dev == "cuda":
            torch.cuda.synchronize()
        want = {n: x.clone() for n, x in before.items()}
        for s, d in pairs[k:]:
            for n, w in want.items():
                w[d * block : (d + 1) * block] = host[n][s * block : (s + 1) * block]
        for n, t in area.items():
            assert torch.equal(t.cpu().view(torch.uint8), want[n].view(torch.uint8)), (fmt, n, k)

