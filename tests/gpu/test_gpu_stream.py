"""Streamed K/V on the GPU (attention/triton_stream.py): the stream and event ordering, against resident decode.

A cache far smaller than the contexts forces misses, evictions and scratch
reads in every layer of every step, so any missing wait shows: the compute
stream reading a slot before its copy landed, or the copy stream overwriting
a slot or scratch region a layer still reads. The streamed kernels must give
the bits of the same kernels over a resident pool, step after step, in bf16
and k8v4, with overlap on and off; the slow variants stretch the copies or
the compute with `torch.cuda._sleep` to widen every race window. Both copy
paths run: the gather kernel (one launch per layer reading the pinned host
store in place, kernels/triton/gather.py) and the `copy_` fallback. Skips
without CUDA.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from strata.attention.select import backend_for
from strata.attention.triton_pool import GpuTableAttention
from strata.attention.triton_stream import GpuStreamAttention
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec
from strata.kv.stream import StreamedPool, StreamStore
from strata.kv.stream_copies import StreamCopies

HQ, HKV, D = 32, 8, 128  # Llama-3.1-8B's heads
LAYERS, LANES, CHUNK = 6, 4, 1024
PROMPTS = (1500, 2300, 700, 3100)
MAX_CONTEXT = 4096
BLOCK, RESIDENT = 64, 512  # 8 blocks per layer against 11 to 49 per lane
SLEEP = 2_000_000  # cycles, about a millisecond


class SlowCopies(StreamCopies):
    """Every layer's copies start late: a compute stream that does not wait reads stale rows."""

    def enqueue(self, layer: int, runs: list, overlap: bool, pairs: torch.Tensor | None = None) -> None:
        if runs or (pairs is not None and pairs.shape[0]):
            with torch.cuda.stream(self.copy_stream):
                torch.cuda._sleep(SLEEP)
        super().enqueue(layer, runs, overlap, pairs)


class SlowUpload(GpuStreamAttention):
    """The step's metadata (the gather's pairs among it) reaches the device late: a copy stream
    that does not wait for the upload gathers with stale pairs."""

    def __init__(self, *args, **kwargs) -> None:
        torch.cuda._sleep(4 * SLEEP)
        super().__init__(*args, **kwargs)


class SlowCompute(GpuStreamAttention):
    """Every layer's reads start late: a copy stream that does not wait overwrites them first."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        torch.cuda._sleep(SLEEP)
        return super().attend(layer, q, k, v, window)


def _decode_many(fmt: str, overlap: bool, steps: int, slow: str = "", gather: bool = True) -> dict:
    dev = torch.device("cuda")
    args = (make_format(fmt, HKV, D), LAYERS, LANES, MAX_CONTEXT, CHUNK, None)
    res = KvPool(*args, device=dev)
    st = StreamedPool(*args, device=dev, resident_cells=RESIDENT, block_cells=BLOCK,
                       overlap=overlap, gather=None if gather else False)
    store = st.store
    assert isinstance(store, StreamStore)
    assert all(t.is_pinned() for layer in st.layers for t in layer.values())
    if slow == "copies":
        store.copies = SlowCopies(store)
    assert store.copies.use_gather() is gather  # auto: the kernel on CUDA
    ctx_cls = {"compute": SlowCompute, "upload": SlowUpload}.get(slow, GpuStreamAttention)
    gen = torch.Generator(device=dev).manual_seed(0)
    dt = torch.bfloat16
    schedule = [[SeqSpec(i, 0, n) for i, n in enumerate(PROMPTS)]]
    schedule += [[SeqSpec(i, n + j, 1) for i, n in enumerate(PROMPTS)] for j in range(steps)]
    for seqs in schedule:
        t = sum(s.n for s in seqs)
        for p in (res, st):
            for s in seqs:
                assert p.reserve(s.lane, s.end)
        a_ctx = GpuTableAttention(res, seqs, D**-0.5)
        b_ctx = ctx_cls(st, seqs, D**-0.5)
        outs_a, outs_b = [], []
        for layer in range(LAYERS):
            q = torch.randn(t, HQ, D, generator=gen, device=dev).to(dt)
            k = torch.randn(t, HKV, D, generator=gen, device=dev).to(dt)
            v = torch.randn(t, HKV, D, generator=gen, device=dev).to(dt)
            outs_a.append(a_ctx.attend(layer, q, k, v))
            outs_b.append(b_ctx.attend(layer, q, k, v))
        for layer, (x, y) in enumerate(zip(outs_a, outs_b)):
            assert torch.equal(x, y), (fmt, overlap, slow, gather, seqs[0], layer,
                                       float((x.float() - y.float()).abs().max()))
    assert store.copies.use_gather() is gather  # (no fallback to copy_ on the way)
    store.settle()
    for layer in range(LAYERS):
        for name, x in res.layers[layer].items():
            assert torch.equal(x.cpu(), st.layers[layer][name]), (layer, name)
    return store.figures()


@pytest.mark.parametrize("gather", [True, False], ids=["gather", "copy"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("fmt", ["bf16", "k8v4"])
def test_streamed_decode_equals_resident_decode(fmt: str, overlap: bool, gather: bool) -> None:
    f = _decode_many(fmt, overlap, steps=40, gather=gather)
    print(f"\n{fmt} overlap={overlap} gather={gather}: {f}")
    assert f["overflow_blocks"] > 0 and f["misses"] > 0 and f["hits"] > 0


@pytest.mark.parametrize("gather", [True, False], ids=["gather", "copy"])
@pytest.mark.parametrize("slow", ["copies", "compute", "upload"])
@pytest.mark.parametrize("fmt", ["bf16", "k8v4"])
def test_ordering_holds_when_one_stream_lags(fmt: str, slow: str, gather: bool) -> None:
    _decode_many(fmt, True, steps=6, slow=slow, gather=gather)


@pytest.mark.parametrize("fmt", ["bf16", "k8v4", "int8", "q4_0"])
def test_gather_reads_the_pinned_store_in_place(fmt: str) -> None:
    """One gather launch on a side stream copies blocks of pinned host memory into device memory
    bit for bit (the 8B shapes: 64-cell blocks, 8 KV heads of 128)."""
    from strata.kernels.triton.gather import block_words, default_programs, gather_blocks

    f = make_format(fmt, HKV, D)
    host = f.allocate(64 * BLOCK, "cpu", pin=True)
    area = f.allocate(40 * BLOCK, "cuda")
    gen = torch.Generator().manual_seed(1)
    for t in host.values():
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, generator=gen, dtype=torch.uint8))
    src = torch.randperm(64, generator=gen)[:30]
    dst = torch.randperm(40, generator=gen)[:30]
    pairs = torch.stack([src, dst], 1).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gather_blocks(pairs, [block_words(t, BLOCK) for t in host.values()],
                      [block_words(t, BLOCK) for t in area.values()], default_programs(pairs.device))
    side.synchronize()
    for n, t in area.items():
        got = t.view(-1, BLOCK, *t.shape[1:])[dst.cuda()].cpu()
        want = host[n].view(-1, BLOCK, *t.shape[1:])[src]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), n


def test_runner_picks_the_streamed_kernels_and_no_graphs() -> None:
    from strata.engine.runner import Runner

    pool = StreamedPool(make_format("bf16", HKV, D), 2, 2, 256, 64, None, "cuda",
                         resident_cells=128, block_cells=64)
    assert backend_for(pool) is GpuStreamAttention
    runner = Runner(torch.nn.Identity(), pool, D**-0.5, torch.device("cuda"))
    assert runner.context is GpuStreamAttention and runner.graphs is None
