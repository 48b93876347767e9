"""Attention through the chunk tables against plain causal SDPA: the CPU kernel and the torch path."""

from __future__ import annotations

import pytest
import torch

from strata.attention.reference import TableAttention
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec

HQ, HKV, D = 6, 2, 16
PATH: dict[str, bool | None] = {"kernel": None}


@pytest.fixture(autouse=True, params=[None, False], ids=["cpu-kernel", "torch"])
def attention_path(request: pytest.FixtureRequest) -> None:
    """Every test runs through the C++ kernel and through the torch reference."""
    PATH["kernel"] = request.param


def _pool(dtype_name: str, pool_tokens: int | None, lanes: int = 3, chunk: int = 8) -> KvPool:
    return KvPool(make_format(dtype_name, HKV, D), 1, lanes, 200, chunk, pool_tokens)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
          window: int | None = None) -> torch.Tensor:
    """Causal GQA attention of queries at positions start.. over keys 0..start+n-1 (the last
    `window` of them, where given)."""
    n, L = q.shape[0], k.shape[0]
    kk = k.repeat_interleave(HQ // HKV, dim=1)
    vv = v.repeat_interleave(HQ // HKV, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk.double()) * D**-0.5
    pos = torch.arange(start, start + n)[:, None]
    key_pos = torch.arange(L)[None, :]
    hidden = key_pos > pos if window is None else (key_pos > pos) | (key_pos <= pos - window)
    s = s.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv.double())


def _run(pool: KvPool, seqs: list[SeqSpec], q, k, v, window: int | None = None) -> torch.Tensor:
    for s in seqs:
        assert pool.reserve(s.lane, s.end)
    ctx = TableAttention(pool, seqs, D**-0.5, kernel=PATH["kernel"])
    return ctx.attend(0, q, k, v, window=window)


def test_matches_sdpa_over_prefill_then_decode_float32() -> None:
    torch.manual_seed(0)
    pool = _pool("fp32", pool_tokens=160)
    lens = {0: 37, 1: 5, 2: 130 - 64}
    hist = {s: (torch.randn(n, HKV, D), torch.randn(n, HKV, D)) for s, n in lens.items()}
    # read each prompt in one step (all lanes together)
    seqs = [SeqSpec(s, 0, n) for s, n in lens.items()]
    q = torch.randn(sum(lens.values()), HQ, D)
    k = torch.cat([hist[s][0] for s in lens])
    v = torch.cat([hist[s][1] for s in lens])
    out = _run(pool, seqs, q, k, v)
    off = 0
    for s, n in lens.items():
        ref = _sdpa(q[off : off + n], hist[s][0], hist[s][1], 0)
        torch.testing.assert_close(out[off : off + n].double(), ref, atol=1e-5, rtol=1e-5)
        off += n
    # three decode steps for all lanes
    for _ in range(3):
        seqs = [SeqSpec(s, lens[s], 1) for s in lens]
        q = torch.randn(len(lens), HQ, D)
        k = torch.randn(len(lens), HKV, D)
        v = torch.randn(len(lens), HKV, D)
        out = _run(pool, seqs, q, k, v)
        for i, s in enumerate(lens):
            hk = torch.cat([hist[s][0], k[i : i + 1]])
            hv = torch.cat([hist[s][1], v[i : i + 1]])
            hist[s] = (hk, hv)
            ref = _sdpa(q[i : i + 1], hk, hv, lens[s])
            torch.testing.assert_close(out[i : i + 1].double(), ref, atol=1e-5, rtol=1e-5)
            lens[s] += 1
    pool.check_invariants()


def test_bf16_result_independent_of_batch_company_and_chunking() -> None:
    """A query's bits do not depend on other sequences or on how its prompt was split."""
    torch.manual_seed(1)
    n = 70
    qa, ka, va = (torch.randn(n, h, D).bfloat16() for h in (HQ, HKV, HKV))
    # alone, the whole prompt in one step
    alone = _run(_pool("bf16", None), [SeqSpec(0, 0, n)], qa, ka, va)
    # split into a 33-token chunk and then single-token steps, beside a busy other lane
    pool = _pool("bf16", 240)
    other_q, other_k, other_v = (torch.randn(150, h, D).bfloat16() for h in (HQ, HKV, HKV))
    pieces = [_run(pool, [SeqSpec(0, 0, 33), SeqSpec(1, 0, 90)],
                   torch.cat([qa[:33], other_q[:90]]), torch.cat([ka[:33], other_k[:90]]),
                   torch.cat([va[:33], other_v[:90]]))[:33]]
    for p in range(33, n):
        o = 90 + p - 33
        out = _run(pool, [SeqSpec(1, o, 1), SeqSpec(0, p, 1)],
                   torch.cat([other_q[o : o + 1], qa[p : p + 1]]),
                   torch.cat([other_k[o : o + 1], ka[p : p + 1]]),
                   torch.cat([other_v[o : o + 1], va[p : p + 1]]))
        pieces.append(out[1:])
    assert torch.equal(torch.cat(pieces), alone)


@pytest.mark.parametrize("window", [1, 5, 130])
def test_window_matches_sdpa_over_prefill_then_decode(window: int) -> None:
    """A sliding layer's rows see the keys at positions > p - window: over a prompt read with
    another lane beside it (spanning two torch blocks), then one decode row."""
    torch.manual_seed(1)
    pool = _pool("fp32", pool_tokens=None)
    lens = {0: 150, 1: 9}
    hist = {s: (torch.randn(n + 1, HKV, D), torch.randn(n + 1, HKV, D)) for s, n in lens.items()}
    q = torch.randn(sum(lens.values()), HQ, D)
    out = _run(pool, [SeqSpec(s, 0, n) for s, n in lens.items()], q,
               torch.cat([hist[s][0][:n] for s, n in lens.items()]),
               torch.cat([hist[s][1][:n] for s, n in lens.items()]), window)
    off = 0
    for s, n in lens.items():
        ref = _sdpa(q[off : off + n], hist[s][0][:n], hist[s][1][:n], 0, window)
        torch.testing.assert_close(out[off : off + n].double(), ref, atol=1e-5, rtol=1e-5)
        off += n
    qd = torch.randn(1, HQ, D)
    k, v = hist[0]
    out = _run(pool, [SeqSpec(0, lens[0], 1)], qd, k[-1:], v[-1:], window)
    torch.testing.assert_close(out.double(), _sdpa(qd, k, v, lens[0], window), atol=1e-5, rtol=1e-5)
