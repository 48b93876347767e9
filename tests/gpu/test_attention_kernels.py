"""Triton attention over the pool against the torch reference (`TableAttention`) on the same pool.

Both contexts write the same K/V into their own copy of one pool layout and
attend; the kernels must agree with the reference within what the compute
dtype allows, and must be at least as close to float64 attention as the
reference is. Odd lengths, chunk boundaries, trash entries, several lanes
and mixed decode/prefill steps are covered.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.kernel_device import INTERPRET, kernel_device

DEV = kernel_device()

from strata.attention.reference import TableAttention
from strata.kv.step import SeqSpec
from strata.kv.formats import make_format
from strata.attention.select import backend_for
from strata.attention.triton_pool import GpuTableAttention
from strata.kv.pool import KvPool

HQ, HKV, D = 8, 2, 64
CHUNK = 32
# ‖out - ref‖ / ‖ref‖ against float64 attention, per compute dtype (METHOD: bf16 1e-3..1e-2)
REL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-4}
# extra error a quantized format may add over plain storage, relative
QUANT_REL = {"bf16": 0.0, "fp16": 0.0, "int8": 0.03, "q4_0": 0.2, "k8v4": 0.2}


def _pools(fmt: str, lanes: int, max_context: int, pool_tokens: int | None,
           chunk: int = CHUNK) -> tuple[KvPool, KvPool]:
    make = lambda: KvPool(make_format(fmt, HKV, D), 2, lanes, max_context, chunk,
                          pool_tokens, DEV)
    return make(), make()


def _reserve(pools: tuple[KvPool, KvPool], order: list[tuple[int, int]]) -> None:
    """Reserve in the same interleaved order in both pools, so chunks are scattered alike."""
    for p in pools:
        for lane, n in order:
            assert p.reserve(lane, n)


def _exact(q: torch.Tensor, keys: list[torch.Tensor], vals: list[torch.Tensor],
           seqs: list[SeqSpec]) -> torch.Tensor:
    """Float64 causal GQA attention of every query row over its lane's full history."""
    out, off = [], 0
    for s, k, v in zip(seqs, keys, vals):
        qq = q[off : off + s.n].double()
        kk = k.double().repeat_interleave(HQ // HKV, dim=1)
        vv = v.double().repeat_interleave(HQ // HKV, dim=1)
        sc = torch.einsum("qhd,khd->hqk", qq, kk) * D**-0.5
        qpos = torch.arange(s.start, s.end, device=q.device)[:, None]
        sc = sc.masked_fill(torch.arange(s.end, device=q.device)[None, :] > qpos, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", torch.softmax(sc, -1), vv))
        off += s.n
    return torch.cat(out)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


class Scenario:
    """Histories per lane; each step appends tokens and checks both contexts."""

    def __init__(self, fmt: str, dtype: torch.dtype, lanes: int, max_context: int,
                 pool_tokens: int | None = None, seed: int = 0, chunk: int = CHUNK) -> None:
        self.gen = torch.Generator(device=DEV).manual_seed(seed)
        self.dtype = dtype
        self.fmt = fmt
        self.pools = _pools(fmt, lanes, max_context, pool_tokens, chunk)
        self.hist: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def fill(self, lane: int, n: int, layer: int = 0) -> None:
        """A history of n tokens written straight into both pools (`fmt.write`, no kernel)."""
        k, v = self._randn(n, HKV, D), self._randn(n, HKV, D)
        for p in self.pools:
            p.write(layer, p.cells_of_range(lane, 0, n), k, v)
        self.hist[lane] = ([k], [v])

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=DEV).to(self.dtype)

    def step(self, seqs: list[SeqSpec], layer: int = 0) -> tuple[float, float, float]:
        """(kernel vs reference, kernel vs exact, reference vs exact) relative errors."""
        t = sum(s.n for s in seqs)
        q, k, v = self._randn(t, HQ, D), self._randn(t, HKV, D), self._randn(t, HKV, D)
        ref_pool, gpu_pool = self.pools
        ref = TableAttention(ref_pool, seqs, D**-0.5).attend(layer, q, k, v)
        out = torch.full_like(q, float("nan"))  # poison: every row must be written
        got = GpuTableAttention(gpu_pool, seqs, D**-0.5).attend(layer, q, k, v)
        out.copy_(got)
        assert torch.isfinite(out).all(), "a row was left unwritten or became NaN"
        keys, vals, off = [], [], 0
        for s in seqs:
            hk, hv = self.hist.setdefault(s.lane, ([], []))
            assert sum(x.shape[0] for x in hk) == s.start, "test bookkeeping"
            hk.append(k[off : off + s.n])
            hv.append(v[off : off + s.n])
            keys.append(torch.cat(hk))
            vals.append(torch.cat(hv))
            off += s.n
        exact = _exact(q, keys, vals, seqs)
        return _rel(out, ref), _rel(out, exact), _rel(ref, exact)

    def check(self, seqs: list[SeqSpec]) -> None:
        vs_ref, vs_exact, ref_exact = self.step(seqs)
        tol = REL[self.dtype] + QUANT_REL[self.fmt]
        assert vs_exact < tol, (vs_ref, vs_exact, ref_exact)
        assert vs_exact <= ref_exact * 1.5 + 1e-3, (vs_ref, vs_exact, ref_exact)
        assert vs_ref < tol, (vs_ref, vs_exact, ref_exact)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_prefill_then_decode_plain(fmt: str, dtype: torch.dtype) -> None:
    sc = Scenario(fmt, dtype, lanes=3, max_context=400, pool_tokens=None)
    lens = {0: 37, 1: 1, 2: 131}  # odd, a single token, past four chunk boundaries
    sc.check([SeqSpec(s, 0, n) for s, n in lens.items()])
    for _ in range(3):
        sc.check([SeqSpec(s, n, 1) for s, n in lens.items()])
        lens = {s: n + 1 for s, n in lens.items()}


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "int8", "q4_0", "k8v4"])
def test_shared_pool_scattered_chunks_and_chunked_prompt(fmt: str) -> None:
    dtype = torch.bfloat16
    sc = Scenario(fmt, dtype, lanes=4, max_context=512, pool_tokens=16 * CHUNK, seed=1)
    # interleaved reservations: each lane's chunks are scattered through the pool
    _reserve(sc.pools, [(0, 33), (1, 65), (2, 64), (0, 96), (3, 5), (1, 190), (2, 129)])
    for p in sc.pools:
        p.check_invariants()
    # prompts read in chunks, the second chunk over a cached prefix, beside a decode lane
    sc.check([SeqSpec(0, 0, 31), SeqSpec(1, 0, 70), SeqSpec(3, 0, 1)])
    sc.check([SeqSpec(0, 31, 2), SeqSpec(1, 70, 119), SeqSpec(3, 1, 1), SeqSpec(2, 0, 129)])
    sc.check([SeqSpec(0, 33, 1), SeqSpec(1, 189, 1), SeqSpec(2, 129, 1), SeqSpec(3, 2, 1)])
    for i in range(2):  # lanes 0 and 3 still have reserved room
        sc.check([SeqSpec(0, 34 + i, 1), SeqSpec(3, 3 + i, 1)])


@pytest.mark.parametrize("fmt", ["int8", "k8v4"])
def test_quantized_formats_in_fp16_compute(fmt: str) -> None:
    """fp16 compute: int8 V is dequantized per element (its scales would push fp16 probabilities
    into subnormals), and k8v4's rotation of the output ends in fp16."""
    sc = Scenario(fmt, torch.float16, lanes=2, max_context=256, seed=6)
    sc.check([SeqSpec(0, 0, 70), SeqSpec(1, 0, 3)])
    sc.check([SeqSpec(0, 70, 1), SeqSpec(1, 3, 1)])


@pytest.mark.parametrize("fmt", ["bf16", "int8", "k8v4"])
def test_long_context_uses_splits(fmt: str) -> None:
    """One lane at 5,000+ positions: the context is split and the splits combined."""
    from strata.kernels.triton.decode import lane_splits

    assert lane_splits(5000) > 1 and lane_splits(300) == 3 and lane_splits(100) == 1
    sc = Scenario(fmt, torch.bfloat16, lanes=2, max_context=6000, seed=2)
    sc.check([SeqSpec(0, 0, 4999), SeqSpec(1, 0, 300)])
    sc.check([SeqSpec(0, 4999, 1), SeqSpec(1, 300, 1)])
    sc.check([SeqSpec(0, 5000, 1)])


def test_q4_0_decode_over_tile_sized_chunks() -> None:
    """The decode kernel's Q4_0 half tiles (scaled in fp16 compute, codes with the blocks' d
    folded into the probabilities otherwise): q4_0 and k8v4 over split contexts in scattered
    64-cell chunks (one table entry per tile), in bf16, fp16 and float32 compute."""
    for fmt, dtype in (("q4_0", torch.bfloat16), ("k8v4", torch.bfloat16),
                       ("k8v4", torch.float16), ("q4_0", torch.float32)):
        sc = Scenario(fmt, dtype, lanes=2, max_context=320, pool_tokens=12 * 64, seed=8,
                      chunk=64)
        _reserve(sc.pools, [(0, 100), (1, 64), (0, 302), (1, 80)])
        sc.fill(0, 299)
        sc.fill(1, 70)
        sc.check([SeqSpec(0, 299, 1), SeqSpec(1, 70, 1)])
        sc.check([SeqSpec(0, 300, 1)])


def test_trash_entries_are_never_read() -> None:
    """Large poisoned trash cells and unreserved table entries leave the output unchanged."""
    sc = Scenario("bf16", torch.bfloat16, lanes=2, max_context=256, pool_tokens=8 * CHUNK, seed=3)
    _reserve(sc.pools, [(0, 40), (1, 3)])
    sc.check([SeqSpec(0, 0, 40), SeqSpec(1, 0, 3)])
    for p in sc.pools:
        for t in p.layers[0].values():
            t[p.trash * CHUNK :] = 1e4 if t.is_floating_point() else 77
    sc.check([SeqSpec(0, 40, 1), SeqSpec(1, 3, 1)])


def test_layers_are_separate_and_writes_match_reference_bits() -> None:
    """Plain-format writes store exactly the bits `fmt.write` stores, in the right layer."""
    sc = Scenario("bf16", torch.bfloat16, lanes=2, max_context=128, seed=4)
    seqs = [SeqSpec(0, 0, 45), SeqSpec(1, 0, 2)]
    sc.step(seqs, layer=1)
    ref_pool, gpu_pool = sc.pools
    for name in ("k", "v"):
        assert torch.equal(ref_pool.layers[1][name], gpu_pool.layers[1][name])
        assert torch.equal(gpu_pool.layers[0][name], torch.zeros_like(gpu_pool.layers[0][name]))


@pytest.mark.parametrize("fmt", ["int8", "q4_0", "k8v4"])
def test_quantized_writes_match_reference_bits(fmt: str) -> None:
    sc = Scenario(fmt, torch.bfloat16, lanes=2, max_context=128, seed=5)
    sc.step([SeqSpec(0, 0, 45), SeqSpec(1, 0, 1)])
    ref_pool, gpu_pool = sc.pools
    for name, t in ref_pool.layers[0].items():
        assert torch.equal(t, gpu_pool.layers[0][name]), name


@pytest.mark.skipif(INTERPRET, reason="the interpreted kernels run on a CPU pool")
def test_backend_for_picks_kernels_on_cuda_and_reference_on_cpu() -> None:
    gpu = KvPool(make_format("bf16", HKV, D), 1, 1, 64, CHUNK, None, DEV)
    cpu = KvPool(make_format("bf16", HKV, D), 1, 1, 64, CHUNK, None, "cpu")
    assert backend_for(gpu) is GpuTableAttention
    assert backend_for(cpu) is TableAttention
    assert backend_for(KvPool(make_format("fp32", HKV, D), 1, 1, 64, CHUNK, None, DEV)) \
        is GpuTableAttention


@pytest.mark.parametrize("fmt", ["bf16", "int8", "k8v4"])
def test_decode_rows_do_not_depend_on_their_company(fmt: str) -> None:
    """A lane's decode output has the same bits alone, among lanes of other lengths (short and
    long ones, which change how many splits the launch has), and planned for a longer context
    (as a CUDA graph plans for the pool's longest); a negative control: one changed cell of the
    lane's own K changes its output."""
    from strata.attention.triton_pool import _layer_halves
    from strata.kernels.triton.decode import DecodeBatch, decode_attention

    lanes = 6
    lengths = [300, 5000, 40, 129, 2048, 1] if not INTERPRET else [300, 700, 40, 129, 260, 1]
    pool = KvPool(make_format(fmt, HKV, D), 1, lanes, max(lengths) + 64, CHUNK, None, DEV)
    gen = torch.Generator(device=DEV).manual_seed(11)
    for lane, n in enumerate(lengths):
        assert pool.reserve(lane, n + 1)
        k = torch.randn(n, HKV, D, generator=gen, device=DEV).to(torch.bfloat16)
        pool.write(0, pool.cells_of_range(lane, 0, n), k, torch.randn_like(k))
    q = torch.randn(lanes, HQ, D, generator=gen, device=DEV).to(torch.bfloat16)

    def attend(which: list[int], plan_for: int | None = None) -> torch.Tensor:
        ctx = GpuTableAttention(pool, [SeqSpec(i, lengths[i] - 1, 1) for i in which], D**-0.5)
        if plan_for is not None:
            d = ctx.decode
            ctx.decode = DecodeBatch(d.q_rows, d.sessions, d.seqlens, plan_for)
        out = torch.empty(len(which), HQ, D, device=DEV, dtype=torch.bfloat16)
        khalf, vhalf = _layer_halves(pool, 0)  # the kernel alone: it reads the cells, writes none
        decode_attention(q[which].contiguous(), out, ctx.decode, khalf, vhalf, pool.tables_device,
                         pool.chunk_size, D**-0.5, ctx.rotate_v)
        return out

    every = attend(list(range(lanes)))
    for i in range(lanes):
        assert torch.equal(attend([i])[0], every[i]), i
        assert torch.equal(attend([i], plan_for=max(lengths) * 4)[0], every[i]), i
    before = attend([0])[0]
    k = torch.randn(1, HKV, D, generator=gen, device=DEV).to(torch.bfloat16)
    pool.write(0, pool.cells_of_range(0, 7, 8), k, k)
    assert not torch.equal(attend([0])[0], before)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "k8v4"])
def test_prompt_rows_do_not_depend_on_where_the_prompt_was_cut(fmt: str) -> None:
    """A prompt read whole, or in pieces down to a last piece of one token (a reused prefix, a
    token budget), gives every row the same bits: prompt pieces are read by the prompt kernel,
    which walks each query's keys in absolute tiles. The negative control: the last token read
    as a decode row (another summation order) does not give the same bits."""
    n = 300 if not INTERPRET else 130
    pool = KvPool(make_format(fmt, HKV, D), 1, 1, n + 64, CHUNK, None, DEV)
    assert pool.reserve(0, n)
    gen = torch.Generator(device=DEV).manual_seed(5)
    q, k, v = (torch.randn(n, h, D, generator=gen, device=DEV).to(torch.bfloat16) for h in (HQ, HKV, HKV))

    def read(cuts: list[int], last_prompt: bool = True) -> torch.Tensor:
        outs, start = [], 0
        for end in cuts:
            seq = SeqSpec(0, start, end - start, prompt=last_prompt or end < n)
            ctx = GpuTableAttention(pool, [seq], D**-0.5)
            outs.append(ctx.attend(0, q[start:end], k[start:end], v[start:end]).clone())
            start = end
        return torch.cat(outs)

    whole = read([n])
    for cuts in ([n - 1, n], [n // 3, 2 * n // 3 + 1, n - 1, n], [64, n]):
        assert torch.equal(read(cuts), whole), cuts
    assert not torch.equal(read([n - 1, n], last_prompt=False)[-1], whole[-1])


@pytest.mark.parametrize("fmt", ["bf16", "k8v4"])
def test_a_drafted_run_reads_as_its_tokens_decoded_one_at_a_time(fmt: str) -> None:
    """A decoding lane's token and its drafts in one eager step (beside another lane's prompt
    piece) give every row the bits of the same token decoded alone, one step each: a drafted run
    is read as decode rows. The negative control: the run read as prompt rows does not."""
    n, d = (300 if not INTERPRET else 130), 4
    pool = KvPool(make_format(fmt, HKV, D), 1, 2, n + 64, CHUNK, None, DEV)
    for lane in range(2):
        assert pool.reserve(lane, n + d)
    gen = torch.Generator(device=DEV).manual_seed(9)
    q, k, v = (torch.randn(n + d, h, D, generator=gen, device=DEV).to(torch.bfloat16) for h in (HQ, HKV, HKV))
    GpuTableAttention(pool, [SeqSpec(0, 0, n, prompt=True)], D**-0.5).attend(0, q[:n], k[:n], v[:n])
    alone = torch.cat([GpuTableAttention(pool, [SeqSpec(0, n + j, 1)], D**-0.5)
                       .attend(0, q[n + j : n + j + 1], k[n + j : n + j + 1], v[n + j : n + j + 1]).clone()
                       for j in range(d)])
    other = torch.randn(40, HQ, D, generator=gen, device=DEV).to(torch.bfloat16)

    def run(drafted: bool) -> torch.Tensor:
        seqs = [SeqSpec(1, 0, 40, prompt=True), SeqSpec(0, n, d, drafted=drafted)]
        kk = torch.cat([other[:, :HKV], k[n:]])
        vv = torch.cat([other[:, HKV : 2 * HKV], v[n:]])
        return GpuTableAttention(pool, seqs, D**-0.5).attend(0, torch.cat([other, q[n:]]), kk, vv)[40:]

    assert torch.equal(run(drafted=True), alone)
    assert not torch.equal(run(drafted=False), alone)


@pytest.mark.parametrize("count", [5, 4], ids=["exact", "control"])
def test_a_prompt_graph_context_reads_its_tokens_as_a_prompt_piece(count: int) -> None:
    """The context of a captured prompt step (`GpuTableAttention.for_prompt_graph`): 130 rows
    (query blocks at 0, 64, 128) of which the first 5 are one lane's tokens at positions 70-74.
    Those rows get the bits of the same piece read eagerly as prompt rows, the padding rows are
    zeros, and the padding rows' K/V go to the trash chunk only. The control says 4 tokens: the
    fifth row is not read."""
    from strata.kernels.triton.prefill import BLOCK_M, PrefillBatch

    n, start, rows = 5, 70, 130
    pools = [KvPool(make_format("bf16", HKV, D), 1, 2, 256, CHUNK, None, DEV) for _ in range(2)]
    gen = torch.Generator(device=DEV).manual_seed(11)
    q, k, v = (torch.randn(start + rows, h, D, generator=gen, device=DEV).to(torch.bfloat16) for h in (HQ, HKV, HKV))
    for p in pools:
        assert p.reserve(1, start + n)
        GpuTableAttention(p, [SeqSpec(1, 0, start, prompt=True)], D**-0.5).attend(0, q[:start], k[:start], v[:start])
    eager = GpuTableAttention(pools[0], [SeqSpec(1, start, n, prompt=True)], D**-0.5).attend(
        0, q[start : start + n], k[start : start + n], v[start : start + n])
    p = pools[1]
    trash = p.trash * p.chunk_size
    cells = [int(p.tables[1, x // CHUNK]) * CHUNK + x % CHUNK for x in range(start, start + n)]
    write = torch.tensor(cells + [trash] * (rows - n), device=DEV)
    blocks = -(-rows // BLOCK_M)
    one = lambda x: torch.tensor([x], device=DEV)  # noqa: E731
    batch = PrefillBatch(torch.zeros(blocks, dtype=torch.int64, device=DEV),
                         torch.arange(0, blocks * BLOCK_M, BLOCK_M, device=DEV), one(1), one(start), one(count),
                         one(0))
    before = {name: t.clone() for name, t in p.layers[0].items()}
    got = GpuTableAttention.for_prompt_graph(p, write, batch, D**-0.5).attend(0, q[start:], k[start:], v[start:])
    assert torch.equal(got[count:], torch.zeros_like(got[count:]))
    assert torch.equal(got[:n], eager) == (count == n)
    for name, t in p.layers[0].items():  # only the tokens' cells and the trash chunk changed
        changed = (t != before[name]).reshape(t.shape[0], -1).any(1).nonzero().flatten().tolist()
        assert set(changed) <= set(cells) | set(range(trash, trash + p.chunk_size)), name
        assert set(cells) <= set(changed), name
