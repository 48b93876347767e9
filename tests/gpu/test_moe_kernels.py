"""The fused MoE kernels (`strata/kernels/triton/moe.py`, `moe_blocks.py`) against a torch loop
over tokens and slots.

The reference sums each product in float32 (in torch's order) and rounds it to the dtype,
rounds silu(g) before the multiply with u, and combines the slots in ascending expert order,
rounding each weighted term and each partial sum. The kernels sum in another float32 order,
so their products agree within float32 accumulation error (and, in bf16, in nearly every
bit); combine has no sum of products and agrees exactly. The block variant must equal the
dense kernels on the weights dequantized to the dtype, bit for bit, and a token's output must
not depend on the tokens that share its launch.
"""

from __future__ import annotations

import pytest

from tests.gpu.kernel_device import INTERPRET, kernel_device  # before any kernel is defined

DEV = kernel_device()

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from strata.kernels.triton import blocks_decode, moe, moe_blocks
from tests.gpu.test_block_kernels import make_blocks
from tests.gpu.test_fused_ops import randn

# silu of a large negative float32 g: exp(-g) is inf and g / inf is -0, as in torch
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}
BLOCK_TYPES = [T(t) for t in blocks_decode.TYPES]


def routing(t: int, k: int, e: int, seed: int, dtype: torch.dtype,
            table: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct ids < e per token (int32, on DEV; spread over range(table) if given) and
    softmax weights in dtype."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if table is not None:  # cache slots: e of the table's rows, not the first e
        ids = torch.randperm(table, generator=g)[:e][ids]
    w = torch.softmax(torch.randn(t, k, generator=g), dim=1)
    return ids.to(DEV, torch.int32), w.to(DEV, dtype)


def experts(e: int, h: int, i: int, dtype: torch.dtype, seed: int):
    """gate, up [e, i, h] and down [e, h, i] of a sane size."""
    return (randn(e, i, h, dtype=dtype, seed=seed, scale=h**-0.5),
            randn(e, i, h, dtype=dtype, seed=seed + 1, scale=h**-0.5),
            randn(e, h, i, dtype=dtype, seed=seed + 2, scale=i**-0.5))


def ref_gate_up(x, gate, up, ids):
    """act [T * k, I] and its magnitude bound, one pair at a time."""
    dt = x.dtype
    x, gate, up, ids = x.cpu().float(), gate.cpu().float(), up.cpu().float(), ids.cpu()
    t, k = ids.shape
    act = torch.empty(t * k, gate.shape[1], dtype=dt)
    mag = torch.empty(t * k, gate.shape[1], dtype=torch.float64)
    for r in range(t * k):
        e = int(ids.view(-1)[r])
        xt = x[r // k]
        g = (xt @ gate[e].T).to(dt)
        u = (xt @ up[e].T).to(dt)
        act[r] = (F.silu(g.float()).to(dt).float() * u.float()).to(dt)
        mg = xt.abs().double() @ gate[e].abs().double().T
        mu = xt.abs().double() @ up[e].abs().double().T
        mag[r] = (mg + mu) * (1 + g.double().abs() + u.double().abs())
    return act, mag


def ref_down(act, down, ids):
    dt = act.dtype
    a, down, ids = act.cpu().float(), down.cpu().float(), ids.cpu().view(-1)
    y = torch.stack([(a[r] @ down[int(ids[r])].T).to(dt) for r in range(a.shape[0])])
    mag = torch.stack([a[r].abs().double() @ down[int(ids[r])].abs().double().T
                       for r in range(a.shape[0])])
    return y, mag


def ref_combine(y, ids, w):
    """Hugging Face's order: experts ascending, each term and partial sum rounded."""
    y, ids, w = y.cpu(), ids.cpu(), w.cpu()
    t, k = ids.shape
    out = torch.empty(t, y.shape[1], dtype=y.dtype)
    for i in range(t):
        acc = None
        for j in torch.argsort(ids[i]).tolist():
            term = y[i * k + j] * w[i, j]
            acc = term if acc is None else acc + term
        out[i] = acc
    return out


def assert_close(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, k: int) -> None:
    """Within 2 units in the last place plus two float32 sums of k terms; in bf16 / fp16 the
    reference's bits in at least 97% of the outputs."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    out, ref = out.cpu(), ref.cpu()
    ulp = torch.ldexp(torch.ones_like(ref, dtype=torch.float32),
                      torch.frexp(ref.float()).exponent - BITS[ref.dtype])
    err = (out.double() - ref.double()).abs()
    bound = 2 * ulp.double() + 2 * k * 2.0**-24 * mag
    assert bool((err <= bound).all()), float((err / bound).max())
    if out.dtype != torch.float32:
        same = (out == ref).float().mean().item()
        assert same >= 0.97, f"only {same:.4f} of the outputs have the reference's bits"


def check_aligned(a: moe.Aligned, ids: torch.Tensor, e: int, bm: int) -> None:
    """Every pair once, grouped by expert in whole blocks of it, in flat order within an
    expert, sentinels for padding, -1 for the blocks past `used`."""
    ids = ids.cpu().view(-1).long()
    n = ids.numel()
    rows, be, used = a.rows.cpu().long(), a.block_expert.cpu().long(), int(a.used.item())
    assert rows.numel() == moe.padded_length(n, e, bm) and rows.numel() % bm == 0
    assert be.numel() == rows.numel() // bm and used % bm == 0 and used <= rows.numel()
    assert a.rows.dtype == a.block_expert.dtype == a.used.dtype == torch.int32
    real = rows[rows < n]
    assert torch.equal(real.sort().values, torch.arange(n))  # each pair exactly once
    assert bool((rows[used:] == n).all()) and bool((rows <= n).all())
    counts = torch.bincount(ids, minlength=e)
    assert used == int(((counts + bm - 1) // bm * bm).sum())
    assert bool((be[used // bm:] == -1).all())
    blocks = rows[:used].view(-1, bm)
    seen: list[int] = []
    for b, blk in enumerate(blocks):
        ex = int(be[b])
        assert 0 <= ex < e and (not seen or seen[-1] <= ex)  # experts ascending, contiguous
        got = blk[blk < n]
        assert got.numel() > 0 and bool((ids[got] == ex).all())
        pad = blk == n
        assert not bool((pad[:-1] & ~pad[1:]).any())  # padding only at an expert's end
        seen.append(ex)
    for ex in counts.nonzero().view(-1).tolist():
        mine = blocks[be[: used // bm] == ex].reshape(-1)
        mine = mine[mine < n]
        assert torch.equal(mine, (ids == ex).nonzero().view(-1))  # stable: flat order
        assert len([s for s in seen if s == ex]) == (int(counts[ex]) + bm - 1) // bm


ALIGN_CASES = [(t, k, e, bm) for t in (1, 3, 17, 64) for k in (1, 2, 8) for e in (4, 16)
               if k <= e for bm in ((16,) if (t + k) % 2 else (16, 32))]


@pytest.mark.parametrize(("t", "k", "e", "bm"), ALIGN_CASES, ids=str)
def test_align(t: int, k: int, e: int, bm: int) -> None:
    ids, _ = routing(t, k, e, seed=t * 31 + k, dtype=torch.float32)
    check_aligned(moe.align(ids, e, bm), ids, e, bm)


def test_align_int64_and_cache_slots() -> None:
    """int64 ids, and ids of 5 slots spread over a table of 32 (the others empty)."""
    ids, _ = routing(9, 2, 5, seed=3, dtype=torch.float32, table=32)
    check_aligned(moe.align(ids.long(), 32, 16), ids, 32, 16)
    assert torch.equal(moe.align(ids.long(), 32, 16).rows, moe.align(ids, 32, 16).rows)


# (T, k, E, H, I)
CASES = [(1, 1, 4, 64, 96), (1, 8, 16, 64, 128), (3, 2, 4, 128, 64), (17, 8, 16, 64, 96),
         (64, 2, 16, 96, 128), (64, 8, 16, 128, 64)]
DT_CASES = [(c, dt) for c in CASES for dt in (torch.bfloat16, torch.float32)] \
    + [(CASES[3], torch.float16)]


@pytest.mark.parametrize(("case", "dtype"), DT_CASES,
                         ids=[f"{c}-{str(d)[6:]}" for c, d in DT_CASES])
def test_against_the_loop(case: tuple[int, ...], dtype: torch.dtype) -> None:
    """Each stage against the loop on the kernels' own inputs, then moe is the four."""
    t, k, e, h, i = case
    x = randn(t, h, dtype=dtype, seed=t + k, scale=2.0)
    gate, up, down = experts(e, h, i, dtype, seed=e + h)
    ids, w = routing(t, k, e, seed=i, dtype=dtype)
    bm = 32 if t == 17 else 16
    a = moe.align(ids, e, bm)
    act = moe.expert_gate_up(x, gate, up, a, k)
    assert act.shape == (t * k, i) and act.dtype == dtype
    assert_close(act, *ref_gate_up(x, gate, up, ids), k=h)
    y = moe.expert_down(act, down, a, k)
    assert y.shape == (t * k, h) and y.dtype == dtype
    assert_close(y, *ref_down(act, down, ids), k=i)
    out = moe.combine(y, ids, w)
    assert torch.equal(out.cpu(), ref_combine(y, ids, w))
    assert torch.equal(moe.combine(y.view(t, k, h), ids, w), out)
    assert torch.equal(moe.moe(x, gate, up, down, ids, w, config=(bm, 32, 64, 4, 2)), out)


def batch(dtype: torch.dtype, seed: int = 5):
    """Token 0 alone, and the same token at row 37 of 65 (k = 8 of 16 experts)."""
    e, h, i, k = 16, 128, 96, 8
    weights = experts(e, h, i, dtype, seed=seed)
    xs = randn(65, h, dtype=dtype, seed=seed + 10, scale=2.0)
    ids, w = routing(65, k, e, seed=seed + 11, dtype=dtype)
    at = 37
    one = (xs[at : at + 1].contiguous(), ids[at : at + 1].contiguous(), w[at : at + 1].contiguous())
    return weights, (xs, ids, w), one, at


FIXED = (16, 32, 64, 4, 2)  # one launch config for any number of tokens


# the launch rule's shapes (None) differ between 1 and 65 tokens: a case for the device only,
# since numpy's matmul, which runs tl.dot in the interpreter, sums in another order for another
# tile shape
INVARIANCE_CONFIGS = [FIXED] if INTERPRET else [FIXED, None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("config", INVARIANCE_CONFIGS, ids=["fixed", "rule"][: len(INVARIANCE_CONFIGS)])
def test_batch_invariance(dtype: torch.dtype, config: moe.Config | None) -> None:
    """A token's output, act and y are the same alone or among 64 others, where its pairs sit
    elsewhere in their blocks (config None: the launch rule's shapes)."""
    (gate, up, down), (xs, ids, w), (x1, ids1, w1), at = batch(dtype)
    many = moe.moe(xs, gate, up, down, ids, w, config=config)
    alone = moe.moe(x1, gate, up, down, ids1, w1, config=config)
    assert torch.equal(many[at : at + 1], alone)
    bm, bn_gu, bn_d, _, _ = config or moe.default_config(65, 16, 128, 96, 8, dtype)
    bm1, bn1_gu, bn1_d, _, _ = config or moe.default_config(1, 16, 128, 96, 8, dtype)
    act = moe.expert_gate_up(xs, gate, up, moe.align(ids, 16, bm), 8, block_n=bn_gu)
    act1 = moe.expert_gate_up(x1, gate, up, moe.align(ids1, 16, bm1), 8, block_n=bn1_gu)
    assert torch.equal(act[at * 8 : at * 8 + 8], act1)
    y = moe.expert_down(act, down, moe.align(ids, 16, bm), 8, block_n=bn_d)
    y1 = moe.expert_down(act1, down, moe.align(ids1, 16, bm1), 8, block_n=bn1_d)
    assert torch.equal(y[at * 8 : at * 8 + 8], y1)


def test_negative_controls() -> None:
    """The comparisons above see what they should: one changed weight of one of the token's
    experts changes its output (and not that of tokens without the expert), and the same sums
    taken in another order (H permuted in x and the weights) differ somewhere."""
    dtype = torch.float32
    (gate, up, down), (xs, ids, w), _, at = batch(dtype)
    base = moe.moe(xs, gate, up, down, ids, w, config=FIXED)
    ex = int(ids[at, 0])
    g2 = gate.clone()
    g2[ex, 3, 5] += 0.25
    moved = moe.moe(xs, g2, up, down, ids, w, config=FIXED)
    assert not torch.equal(moved[at], base[at])
    without = ~(ids == ex).any(dim=1)
    assert bool(without.any()) and torch.equal(moved[without], base[without])
    perm = torch.randperm(xs.shape[1], generator=torch.Generator().manual_seed(0)).to(DEV)
    a = moe.align(ids, 16, 16)
    act = moe.expert_gate_up(xs, gate, up, a, 8)
    act_p = moe.expert_gate_up(xs[:, perm].contiguous(), gate[:, :, perm].contiguous(),
                               up[:, :, perm].contiguous(), a, 8)
    assert not torch.equal(act, act_p)
    assert_close(act_p, act, ref_gate_up(xs, gate, up, ids)[1], k=128)  # but only just


def test_what_it_does_not_take() -> None:
    x = randn(3, 64, dtype=torch.bfloat16, seed=1)
    gate, up, down = experts(4, 64, 96, torch.bfloat16, seed=2)
    assert moe.takes(x, gate, up, down)
    assert not moe.takes(x.float(), gate, up, down)  # dtypes differ
    assert not moe.takes(x, gate.transpose(1, 2), up, down)  # not contiguous / wrong shape
    assert not moe.takes(x, gate, up, down[:, :, :80].contiguous())  # down not [E, H, I]
    assert not moe.takes(x[:, :40].contiguous(), gate[:, :, :40].contiguous())  # H % 16
    assert not moe.takes(x.to(torch.int8))
    if not INTERPRET:
        assert not moe.takes(x.cpu(), gate.cpu())
    ids, w = routing(3, 2, 4, seed=1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not take"):
        moe.moe(x.float(), gate, up, down, ids, w)
    with pytest.raises(ValueError, match="block_m"):
        moe.align(ids, 4, 24)
    with pytest.raises(ValueError, match="combine"):
        moe.combine(torch.zeros(5, 64, dtype=torch.bfloat16, device=DEV), ids, w)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need the device")
def test_graph_replay_equals_eager() -> None:
    """align and the kernels capture (no host synchronisation) and replay on new routing."""
    dtype = torch.bfloat16
    (gate, up, down), (xs, ids, w), _, _ = batch(dtype)
    sx, sids, sw = xs[:16].clone(), ids[:16].clone(), w[:16].clone()
    moe.moe(sx, gate, up, down, sids, sw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.moe(sx, gate, up, down, sids, sw)
    for s in (16, 32):
        sx.copy_(xs[s : s + 16])
        sids.copy_(ids[s : s + 16])
        sw.copy_(w[s : s + 16])
        graph.replay()
        assert torch.equal(out, moe.moe(xs[s : s + 16].contiguous(), gate, up, down,
                                        ids[s : s + 16].contiguous(), w[s : s + 16].contiguous()))


def block_experts(qtype: int, e: int, n: int, k: int, seed: int, packed: bool, dtype):
    """Blocks [e * n, row bytes] of qtype (packed or the file's layout) and their weights
    [e, n, k] dequantized by gguf.quants, rounded to dtype."""
    b, w = make_blocks(qtype, e * n, k, seed)
    return (blocks_decode.pack(b, qtype) if packed else b), w.to(dtype).view(e, n, k)


BLOCK_CASES = [(t, p) for t in BLOCK_TYPES for p in (True, False)]


@pytest.mark.parametrize(("qtype", "packed"), BLOCK_CASES,
                         ids=[f"{t.name}-{'packed' if p else 'raw'}" for t, p in BLOCK_CASES])
def test_blocks_equal_dense(qtype: int, packed: bool) -> None:
    """gate/up and down from blocks equal the dense kernels on the dequantized weights."""
    t, k, e, h, i = 3, 2, 3, 256, 256
    dtype = torch.bfloat16 if packed else torch.float32
    x = randn(t, h, dtype=dtype, seed=qtype, scale=2.0)
    gb, gw = block_experts(qtype, e, i, h, 1, packed, dtype)
    ub, uw = block_experts(qtype, e, i, h, 2, packed, dtype)
    db, dw = block_experts(qtype, e, h, i, 3, packed, dtype)
    ids, _ = routing(t, k, e, seed=qtype, dtype=dtype)
    a = moe.align(ids, e, 16)
    act = moe_blocks.expert_gate_up_blocks(x, gb, ub, qtype, i, a, k, packed, block_n=128)
    dense = moe.expert_gate_up(x, gw, uw, a, k, block_n=128)
    assert torch.equal(act, dense)
    assert_close(act, *ref_gate_up(x, gw, uw, ids), k=h)
    y = moe_blocks.expert_down_blocks(dense, db, qtype, h, a, k, packed, block_n=128)
    assert torch.equal(y, moe.expert_down(dense, dw, a, k, block_n=128))


# the file's layout read as packed decodes to garbage scales (inf * 0 in the interpreter)
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_moe_blocks_q4k_q6k(dtype: torch.dtype) -> None:
    """Qwen3-30B-A3B's mix (Q4_K gate/up, Q6_K down): moe_blocks equals moe on the dequantized
    weights, with one config and with the rule's; the file's layout read as packed does not,
    and a qtype that does not fit the rows is refused."""
    t, k, e, h, i = 5, 2, 4, 256, 256
    x = randn(t, h, dtype=dtype, seed=9, scale=2.0)
    gb, gw = block_experts(T.Q4_K, e, i, h, 4, True, dtype)
    ub, uw = block_experts(T.Q4_K, e, i, h, 5, True, dtype)
    db, dw = block_experts(T.Q6_K, e, h, i, 6, True, dtype)
    ids, w = routing(t, k, e, seed=10, dtype=dtype)
    cfg = (16, 128, 128, 4, 1)
    out = moe_blocks.moe_blocks(x, gb, ub, db, T.Q4_K, T.Q6_K, ids, w, True, config=cfg)
    assert torch.equal(out, moe.moe(x, gw, uw, dw, ids, w, config=cfg))
    assert torch.equal(moe_blocks.moe_blocks(x, gb, ub, db, T.Q4_K, T.Q6_K, ids, w, True),
                       moe.moe(x, gw, uw, dw, ids, w))
    raw = blocks_decode.unpack(gb, T.Q4_K)  # (Q6_K's one-block rows are the same packed)
    assert not torch.equal(out, moe_blocks.moe_blocks(x, raw, ub, db, T.Q4_K, T.Q6_K, ids, w,
                                                      True, config=cfg))
    with pytest.raises(ValueError, match="moe_blocks"):
        moe_blocks.moe_blocks(x, gb, ub, db, T.Q4_K, T.Q4_K, ids, w, True)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """t's copy in host memory the device can read (pinned); on the CPU a plain copy."""
    h = t.detach().cpu().clone()
    return h.pin_memory() if t.is_cuda else h


@pytest.mark.parametrize("qtype", [None, T.Q4_K], ids=["bf16", "Q4_K"])
def test_mapped_reads_equal_resident(qtype: int | None) -> None:
    """Experts with a slot read it, the others their host copy (`moe.Mapped`): the products equal
    every expert resident, bit for bit; a table that sends an expert to the wrong slot does not."""
    t, k, e, s, h, i = 6, 2, 6, 3, 256, 256
    dtype = torch.bfloat16
    x = randn(t, h, dtype=dtype, seed=21, scale=2.0)
    if qtype is None:
        full = experts(e, h, i, dtype, seed=22)
    else:
        full = tuple(block_experts(qtype, e, n, c, sd, True, dtype)[0].view(e, n, -1)
                     for n, c, sd in ((i, h, 23), (i, h, 24), (h, i, 25)))
    hosts = [host_copy(w) for w in full]
    held = [4, 1, 2]  # slot -> expert
    slots = [torch.stack([w[j] for j in held]).contiguous() for w in full]
    table = torch.full((e,), -1, dtype=torch.int32, device=DEV)
    table[torch.tensor(held, device=DEV)] = torch.arange(s, dtype=torch.int32, device=DEV)
    ids, _ = routing(t, k, e, seed=26, dtype=dtype)
    a = moe.align(ids, e, 16)

    def products(g, u, d, mapped):
        if qtype is None:
            act = moe.expert_gate_up(x, g, u, a, k, mapped=mapped and mapped[0])
            return moe.expert_down(act, d, a, k, mapped=mapped and mapped[1])
        act = moe_blocks.expert_gate_up_blocks(x, g.view(-1, g.shape[2]), u.view(-1, u.shape[2]), qtype,
                                               i, a, k, True, mapped=mapped and mapped[0])
        return moe_blocks.expert_down_blocks(act, d.view(-1, d.shape[2]), qtype, h, a, k, True,
                                             mapped=mapped and mapped[1])

    def maps(tab):
        return (moe.Mapped(tab, moe.distance(hosts[0], slots[0]), moe.distance(hosts[1], slots[1])),
                moe.Mapped(tab, moe.distance(hosts[2], slots[2]), 0))

    resident = products(*full, None)
    assert torch.equal(products(*slots, maps(table)), resident)
    wrong = table.clone()
    wrong[2] = 0  # expert 2 read from expert 4's slot
    assert bool((ids == 2).any()) and bool((ids == 5).any())  # slotted and host-read experts both used
    assert not torch.equal(products(*slots, maps(wrong)), resident)


@pytest.mark.parametrize(("t", "e", "k", "normalise"), [(5, 8, 2, True), (3, 128, 8, True), (4, 60, 4, False),
                                                         (1, 16, 1, False)])
def test_route_follows_torch(t: int, e: int, k: int, normalise: bool) -> None:
    """The fused router (`kernels/triton/route.py`): torch's experts in torch's order, weights within a
    float32 step of torch's; a row's result does not depend on the other rows."""
    from strata.kernels.triton import route as fused_route
    from strata.models.moe import route as torch_route

    logits = randn(t, e, dtype=torch.bfloat16, seed=e + k, scale=3.0)
    want_ids, want_w = torch_route(logits.float().cpu(), k, normalise, torch.float32)
    ids, w = fused_route.route(logits, k, normalise, torch.float32)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(w.cpu(), want_w, rtol=3e-7, atol=0)
    ids16, w16 = fused_route.route(logits, k, normalise, torch.bfloat16)
    assert torch.equal(ids16, ids) and torch.equal(w16, w.to(torch.bfloat16))
    alone = [fused_route.route(logits[i : i + 1], k, normalise, torch.float32) for i in range(t)]
    assert torch.equal(torch.cat([a for a, _ in alone]), ids) and torch.equal(torch.cat([b for _, b in alone]), w)
    shifted = logits.clone()
    shifted[0, ids[0, 0]] = shifted[0].min() - 1.0  # the control: the top expert made the last
    assert int(fused_route.route(shifted, k, normalise, torch.float32)[0][0, 0]) != int(ids[0, 0])
    with pytest.raises(ValueError, match="route"):
        fused_route.route(logits, e + 1, normalise, torch.float32)
