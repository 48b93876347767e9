"""Streamed K/V on the GPU (kv/gpu_stream.py): the stream and event ordering, against resident decode.

A cache far smaller than the contexts forces misses, evictions and scratch
reads in every layer of every step, so any missing wait shows: the compute
stream reading a slot before its copy landed, or the copy stream overwriting
a slot or scratch region a layer still reads. The streamed kernels must give
the bits of the same kernels over a resident pool, step after step, in bf16
and k8v4, with overlap on and off; the slow variants stretch the copies or
the compute with `torch.cuda._sleep` to widen every race window. Skips
without CUDA.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from strata.kv.attention import SeqSpec
from strata.kv.formats import make_format
from strata.kv.gpu_attention import GpuTableAttention
from strata.kv.gpu_stream import GpuStreamAttention, StreamState, stream_context
from strata.kv.pool import KvPool
from strata.kv.stream import StreamStore, streamed_pool

HQ, HKV, D = 32, 8, 128  # Llama-3.1-8B's heads
LAYERS, LANES, CHUNK = 6, 4, 1024
PROMPTS = (1500, 2300, 700, 3100)
MAX_CONTEXT = 4096
BLOCK, RESIDENT = 64, 512  # 8 blocks per layer against 11 to 49 per lane
SLEEP = 2_000_000  # cycles, about a millisecond


class SlowCopies(StreamState):
    """Every layer's copies start late: a compute stream that does not wait reads stale rows."""

    def enqueue(self, layer: int, runs: list, overlap: bool) -> None:
        if runs:
            with torch.cuda.stream(self.copy_stream):
                torch.cuda._sleep(SLEEP)
        super().enqueue(layer, runs, overlap)


class SlowCompute(GpuStreamAttention):
    """Every layer's reads start late: a copy stream that does not wait overwrites them first."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(SLEEP)
        return super().attend(layer, q, k, v)


def _decode_many(fmt: str, overlap: bool, steps: int, slow: str = "") -> dict:
    dev = torch.device("cuda")
    args = (make_format(fmt, HKV, D), LAYERS, LANES, MAX_CONTEXT, CHUNK, None)
    res = KvPool(*args, device=dev)
    st = streamed_pool(*args, device=dev, resident_cells=RESIDENT, block_cells=BLOCK,
                       overlap=overlap)
    store = st.store
    assert isinstance(store, StreamStore)
    assert all(t.is_pinned() for layer in st.layers for t in layer.values())
    if slow == "copies":
        store.gpu = SlowCopies(store)
    ctx_cls = SlowCompute if slow == "compute" else GpuStreamAttention
    gen = torch.Generator(device=dev).manual_seed(0)
    dt = torch.bfloat16
    schedule = [[SeqSpec(i, 0, n) for i, n in enumerate(PROMPTS)]]
    schedule += [[SeqSpec(i, n + j, 1) for i, n in enumerate(PROMPTS)] for j in range(steps)]
    for seqs in schedule:
        t = sum(s.n for s in seqs)
        for p in (res, st):
            for s in seqs:
                assert p.reserve(s.session, s.end)
        a_ctx = GpuTableAttention(res, seqs, HQ, D**-0.5, dt)
        b_ctx = ctx_cls(st, seqs, HQ, D**-0.5, dt)
        outs_a, outs_b = [], []
        for layer in range(LAYERS):
            q = torch.randn(t, HQ, D, generator=gen, device=dev).to(dt)
            k = torch.randn(t, HKV, D, generator=gen, device=dev).to(dt)
            v = torch.randn(t, HKV, D, generator=gen, device=dev).to(dt)
            outs_a.append(a_ctx.attend(layer, q, k, v))
            outs_b.append(b_ctx.attend(layer, q, k, v))
        for layer, (x, y) in enumerate(zip(outs_a, outs_b)):
            assert torch.equal(x, y), (fmt, overlap, slow, seqs[0], layer,
                                       float((x.float() - y.float()).abs().max()))
    store.settle()
    for layer in range(LAYERS):
        for name, x in res.layers[layer].items():
            assert torch.equal(x.cpu(), st.layers[layer][name]), (layer, name)
    return store.figures()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("fmt", ["bf16", "k8v4"])
def test_streamed_decode_equals_resident_decode(fmt: str, overlap: bool) -> None:
    f = _decode_many(fmt, overlap, steps=40)
    print(f"\n{fmt} overlap={overlap}: {f}")
    assert f["overflow_blocks"] > 0 and f["misses"] > 0 and f["hits"] > 0


@pytest.mark.parametrize("slow", ["copies", "compute"])
@pytest.mark.parametrize("fmt", ["bf16", "k8v4"])
def test_ordering_holds_when_one_stream_lags(fmt: str, slow: str) -> None:
    _decode_many(fmt, True, steps=6, slow=slow)


def test_runner_picks_the_streamed_kernels_and_no_graphs() -> None:
    from strata.engine.runner import Runner

    pool = streamed_pool(make_format("bf16", HKV, D), 2, 2, 256, 64, None, "cuda",
                         resident_cells=128, block_cells=64)
    assert stream_context(pool) is GpuStreamAttention
    runner = Runner(torch.nn.Identity(), pool, HQ, D**-0.5, torch.bfloat16, torch.device("cuda"))
    assert runner.context is GpuStreamAttention and runner.graphs is None
