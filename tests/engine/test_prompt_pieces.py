"""Prompt pieces stay prompt rows: a prompt token is read by the prompt kernels however the step
cut the prompt, even as a piece of one token (a reused prefix leaves only the last token to read;
a token budget can leave one over). The decode kernels sum a row's keys in another order, so a
one-token piece read as a decode row would round differently from the same token read with the
rest of its prompt, and the answer would depend on the cache and on the company. The kernels'
bits are checked on the device (tests/gpu/test_attention_kernels.py, test_gpu_engine.py)."""

from __future__ import annotations

from strata.engine.graphs import DecodeGraphs
from strata.engine.request import Request, RequestHandle
from strata.engine.scheduler import Scheduler
from strata.engine.types import SamplingParams
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.step import SeqSpec, decode_step, step_cells

CHUNK = 4


def _scheduler(prefill_chunk: int = 8) -> Scheduler:
    pool = KvPool(make_format("bf16", 1, 4), 1, 2, 40, CHUNK, 64)
    return Scheduler(pool, lanes=2, prefill_chunk=prefill_chunk)


def _plan_prompt(sched: Scheduler, req: Request) -> list[SeqSpec]:
    sched.admit(req)
    step, _ = sched.plan()
    return step.seqs


def test_a_reused_prefix_leaves_a_one_token_prompt_piece() -> None:
    sched = _scheduler()
    lane = sched.lanes[0]
    prompt = list(range(10, 20))
    assert sched.pool.reserve(lane.index, len(prompt) + 4)
    lane.tokens = prompt + [77, 78]  # a finished conversation that began with the same prompt
    seqs = _plan_prompt(sched, Request(list(prompt), SamplingParams(), RequestHandle("r")))
    assert seqs == [SeqSpec(0, 9, 1, prompt=True)]  # the last token read again for its logits
    assert not seqs[0].decoding and not decode_step(seqs)


def test_every_piece_of_a_prompt_cut_by_the_budget_is_a_prompt_piece() -> None:
    sched = _scheduler(prefill_chunk=8)
    req = Request(list(range(30, 39)), SamplingParams(), RequestHandle("r"))  # 9 tokens: 8 + 1
    seqs = _plan_prompt(sched, req)
    assert seqs == [SeqSpec(0, 0, 8, prompt=True)]
    req.cursor = 8  # what the engine does once the step ran
    sched.lanes[0].tokens = req.prompt[:8]
    step, _ = sched.plan()
    assert step.seqs == [SeqSpec(0, 8, 1, prompt=True)]


def test_step_cells_route_one_token_prompt_pieces_away_from_decode() -> None:
    pool = KvPool(make_format("bf16", 1, 4), 1, 3, 40, CHUNK, 64)
    for lane in range(3):
        assert pool.reserve(lane, 12)
    seqs = [SeqSpec(0, 5, 1), SeqSpec(1, 9, 1, prompt=True), SeqSpec(2, 0, 4, prompt=True)]
    cells = step_cells(pool, seqs)
    assert cells.decode.tolist() == [True, False, False]
    assert cells.prompt.tolist() == [False, True, True]
    # the negative control: the same piece without the mark is a decode row
    assert step_cells(pool, [SeqSpec(1, 9, 1)]).decode.tolist() == [True]


def test_decode_graphs_take_no_prompt_piece() -> None:
    """The captured decode step runs the decode kernels: a one-token prompt piece stays eager."""
    assert DecodeGraphs.rows_of([SeqSpec(0, 9, 1, prompt=True)], [1]) is None
    assert DecodeGraphs.rows_of([SeqSpec(0, 9, 2)], [2]) == [SeqSpec(0, 9, 1), SeqSpec(0, 10, 1)]
    assert decode_step([SeqSpec(0, 9, 1), SeqSpec(1, 3, 1)])
    assert not decode_step([SeqSpec(0, 9, 1), SeqSpec(1, 3, 1, prompt=True)])
    assert not decode_step([])


def test_drafted_runs_are_decode_rows() -> None:
    """A decoding lane's token and drafts are marked, and read as decode rows, one query a token
    (in an eager step as in the decode graphs); an unmarked run of several tokens is prompt rows."""
    sched = _scheduler()
    lane = sched.lanes[0]
    req = Request(list(range(10, 20)), SamplingParams(), RequestHandle("r"))
    sched.admit(req)
    req.cursor = len(req.prompt)
    lane.tokens = list(req.prompt)
    lane.request, lane.pending, lane.drafts = req, 21, [22, 23]
    step, _ = sched.plan()
    assert step.seqs == [SeqSpec(0, 10, 3, drafted=True)]
    pool = sched.pool
    cells = step_cells(pool, step.seqs + [SeqSpec(1, 0, 3)])
    assert cells.decode.tolist() == [True, False]


def test_decode_rows_of_a_drafted_run_reach_their_own_positions() -> None:
    import torch

    from strata.kv.step import decode_rows

    seqs = [SeqSpec(0, 9, 1), SeqSpec(1, 3, 3, drafted=True), SeqSpec(2, 0, 2, prompt=True),
            SeqSpec(3, 20, 2, drafted=True)]
    cells = step_cells(KvPool(make_format("bf16", 1, 4), 1, 4, 40, CHUNK, 64), seqs)
    rows, keys, lengths = decode_rows(cells, torch.tensor([5, 6, 8, 7]))
    assert rows.tolist() == [0, 1, 2, 3, 6, 7]  # the prompt piece's rows 4-5 are not decode rows
    assert keys.tolist() == [5, 6, 6, 6, 7, 7]
    assert lengths.tolist() == [10, 4, 5, 6, 21, 22]
