"""The padded prompt step a prompt graph captures (`PromptGraphs.eager`) on a tiny Qwen3-Next in
bf16, on CUDA or on the CPU under Triton's interpreter (STRATA_TRITON_INTERPRET=1): its logits,
the lane's DeltaNet state, the state at the cut before the last token and the tokens' K/V are
those of the eager step that reads the same tokens with that cut, to float32 rounding on the CPU
(the products there do not depend on the row count, but torch's vectorised exp and softplus
take a tensor's tail with scalar code, which moves the gates' last bits at this model's 4 value
heads) and to bf16
rounding on CUDA. The control leaves the padding rows' gates unmasked: the state moves."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.kernel_device import kernel_device

DEV = kernel_device()

from strata.attention.triton_pool import GpuTableAttention
from strata.engine.prompt_graphs import PromptGraphs
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.state import StatePool
from strata.kv.step import SeqSpec, step_positions
from strata.models.loader import load_model
from tests.models.tiny_models import save_byte_tokenizer, save_tiny

LANE = 1
CLOSE = {"rtol": 1e-5, "atol": 1e-6} if DEV == "cpu" else {"rtol": 2e-2, "atol": 2e-3}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> torch.nn.Module:
    path = tmp_path_factory.mktemp("qwen3_next")
    save_tiny("qwen3_next", path)
    save_byte_tokenizer(path)
    return load_model(str(path), device=DEV, dtype="bfloat16", weights="dense", progress=False).model


def _parts(model: torch.nn.Module) -> tuple[KvPool, StatePool]:
    cfg = model.config
    pool = KvPool(make_format("bf16", cfg.num_kv_heads, cfg.head_dim), model.pool_layers(), 2, 160, 16,
                  2 * 160, DEV)
    return pool, StatePool(model.state_layers(), 2, DEV, model.state_dtypes(), trash=True)


@torch.inference_mode()
def _eager(model: torch.nn.Module, pool: KvPool, states: StatePool, seq: SeqSpec, tokens: list[int]
           ) -> torch.Tensor:
    """An eager step of one sequence through the Triton attention, its last row's logits."""
    ctx = GpuTableAttention(pool, [seq], model.config.attn_scale)
    st = states.step([(0, seq.n)], [seq.lane], [seq.start == 0], [False], [seq.cuts])
    hidden = model(torch.tensor(tokens, device=DEV), step_positions([seq]).to(DEV), ctx, states=st)
    return model.compute_logits(hidden[-1:])


def _state(states: StatePool) -> dict:
    s = states.slot_of[LANE]
    return {(layer, name): t[s].clone() for layer, named in states.layers.items() for name, t in named.items()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.float(), b.float(), **CLOSE)


@pytest.mark.parametrize("unmasked", [False, True], ids=["padded", "control"])
def test_the_padded_step_is_the_cut_step(model: torch.nn.Module, unmasked: bool, monkeypatch) -> None:
    """Pieces of 5, 16 and 1 tokens (sizes 8, 16, 8) after a 30-token prompt."""
    (pool, states), (ref_pool, ref_states) = _parts(model), _parts(model)
    graphs = PromptGraphs(model, pool, model.config.attn_scale, states, [8, 16])
    if unmasked:  # the padding rows count as tokens before the last: they move the state
        from strata.engine import prompt_graphs

        fill = PromptGraphs._fill

        def fill_unmasked(self, e, seq: SeqSpec, tokens: list[int]) -> None:
            fill(self, e, seq, tokens)
            e.host[prompt_graphs._HEAD, seq.n :] = 1
            e.meta.copy_(e.host)

        monkeypatch.setattr(PromptGraphs, "_fill", fill_unmasked)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, model.config.vocab_size, (30 + 5 + 16 + 1,), generator=g).tolist()
    for p, st in ((pool, states), (ref_pool, ref_states)):
        assert p.reserve(LANE, len(tokens))
        _eager(model, p, st, SeqSpec(LANE, 0, 30, prompt=True), tokens[:30])
    start, same = 30, []
    for n in (5, 16, 1):
        seq = SeqSpec(LANE, start, n, prompt=True, cuts=(n - 1,) if n > 1 else ())
        piece = tokens[start : start + n]
        got = graphs.eager(seq, piece)
        want = _eager(model, ref_pool, ref_states, seq, piece)
        got_state, want_state = _state(states), _state(ref_states)
        same.append(_same(got, want) and all(_same(got_state[k], want_state[k]) for k in got_state))
        cut, want_cut = states.take_cuts(), ref_states.take_cuts()
        if not unmasked:
            assert same[-1], n
            assert sorted(cut) == sorted(want_cut) == ([LANE] if n > 1 else [])
            for lane, at in want_cut.items():
                assert list(cut[lane]) == list(at) == [n - 1]
                for layer, named in at[n - 1].items():
                    assert all(_same(cut[lane][n - 1][layer][k], t) for k, t in named.items()), (n, layer)
            cells = [int(pool.tables[LANE, x // 16]) * 16 + x % 16 for x in range(start, start + n)]
            for st, ref_st in zip(pool.layers, ref_pool.layers):
                assert all(_same(st[name][cells], ref_st[name][cells]) for name in ("k", "v")), n
        start += n
    if unmasked:
        assert not any(same)  # 5 tokens in 8 rows, then 16 and 1 from the state that moved


class _Replayed:
    """A stand-in for a captured graph on the CPU: a replay runs the step again into the same
    output tensor, as a CUDA graph refills its buffers."""

    def __init__(self, step, out: torch.Tensor) -> None:
        self.step, self.out = step, out

    def replay(self) -> None:
        self.out.copy_(self.step())


def test_a_runner_routes_a_lane_s_short_prompt_pieces_to_its_prompt_graphs(model: torch.nn.Module,
                                                                           monkeypatch) -> None:
    """Runner.forward with prompt graphs (their capture stood in for on the CPU): the lane's
    prompt pieces after its first take them, with the state at the cut before their last token
    handed over as an eager step's; a piece of two lanes, a piece from position 0 and a decode
    row stay eager. The answers agree with a runner without prompt graphs."""
    from strata.engine import prompt_graphs
    from strata.engine.runner import Runner

    if DEV == "cpu":
        monkeypatch.setattr(prompt_graphs, "capture",
                            lambda warm, step, device: (lambda out: (_Replayed(step, out), out))(step()))
    scale = model.config.attn_scale
    runs = {}
    for graphed in (False, True):
        pool, states = _parts(model)
        runner = Runner(model, pool, scale, torch.device(DEV), graphs=False, states=states)
        runner.context = GpuTableAttention  # the eager steps on the kernels the graph runs
        if graphed:
            runner.prompt_graphs = PromptGraphs(model, pool, scale, states, [8, 16])
        g = torch.Generator().manual_seed(4)
        tokens = {lane: torch.randint(1, model.config.vocab_size, (40,), generator=g).tolist() for lane in (0, 1)}
        for lane in (0, 1):
            assert pool.reserve(lane, 40)
        steps = [[SeqSpec(0, 0, 20, prompt=True)], [SeqSpec(0, 20, 7, prompt=True, cuts=(6,))],
                 [SeqSpec(1, 0, 5, prompt=True), SeqSpec(0, 27, 3, prompt=True)],
                 [SeqSpec(0, 30, 1)], [SeqSpec(0, 31, 9, prompt=True, cuts=(8,))]]
        out = []
        for seqs in steps:
            toks = [t for s in seqs for t in tokens[s.lane][s.start : s.end]]
            logits = runner.forward(seqs, toks, [1] * len(seqs))
            out.append((logits.clone(), states.take_cuts()))
        runs[graphed] = out, [] if runner.prompt_graphs is None else runner.prompt_graphs.captured()
    (eager, _), (graphed, sizes) = runs[False], runs[True]
    assert sizes == [8, 16]  # the 7- and 9-token pieces; the others stayed eager
    for (a, cuts_a), (b, cuts_b) in zip(eager, graphed):
        assert _same(a, b)
        assert {lane: sorted(at) for lane, at in cuts_a.items()} == {lane: sorted(at) for lane, at in cuts_b.items()}
        for lane, at in cuts_a.items():
            for rows, layers in at.items():
                for layer, named in layers.items():
                    assert all(_same(cuts_b[lane][rows][layer][k], t) for k, t in named.items())
    assert eager[1][1] and eager[4][1]  # the two cut pieces handed states over
