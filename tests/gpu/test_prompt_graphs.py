"""A recurrent model's short prompt steps through CUDA graphs (engine/prompt_graphs.py), on a tiny
Qwen3-Next: a replay is the eager padded step bit for bit, close to the unpadded eager step (the
lane's logits, DeltaNet state and K/V), and an engine's later turns read through it with the
answers of an engine without it."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("triton")
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.prompt_graphs import PromptGraphs
from strata.engine.runner import Runner
from strata.engine.types import SamplingParams
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.state import StatePool
from strata.kv.step import SeqSpec
from strata.models.loader import load_model
from tests.models.tiny_models import PROMPT, save_byte_tokenizer, save_tiny

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LANE = 1


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen3_next")
    save_tiny("qwen3_next", path)
    save_byte_tokenizer(path)
    return str(path)


def _parts(model: torch.nn.Module) -> tuple[KvPool, StatePool]:
    cfg = model.config
    pool = KvPool(make_format("bf16", cfg.num_kv_heads, cfg.head_dim), model.pool_layers(), 3, 256, 16,
                  3 * 256, "cuda")
    states = StatePool(model.state_layers(), 3, "cuda", model.state_dtypes(), trash=True)
    return pool, states


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


def _slot_state(states: StatePool, lane: int) -> dict:
    s = states.slot_of[lane]
    return {(layer, name): t[s].clone() for layer, named in states.layers.items() for name, t in named.items()}


@torch.inference_mode()
def test_a_replay_is_the_padded_step_and_close_to_the_unpadded_one(folder: str) -> None:
    """Pieces of 5, 16, 37 and 1 rows after a 40-token prompt (sizes 8, 16, 64, 8), each cut
    before its last token: the replay gives the eager padded step's logits and state bit for bit;
    against the same pieces read by an eager runner in a second pool, the logits, the DeltaNet
    states, the states handed over at the cut and the new rows' K/V agree to bf16 rounding; no
    other lane's state is written."""
    model = load_model(folder, device="cuda", dtype="bfloat16", weights="dense", progress=False).model
    scale = model.config.attn_scale
    (pool, states), (ref_pool, ref_states) = _parts(model), _parts(model)
    runner = Runner(model, pool, scale, torch.device("cuda"), graphs=False, states=states)
    ref = Runner(model, ref_pool, scale, torch.device("cuda"), graphs=False, states=ref_states)
    graphs = PromptGraphs(model, pool, scale, states, [8, 16, 32, 64])
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, model.config.vocab_size, (40 + 5 + 16 + 37 + 1,), generator=g).tolist()
    for p, r in ((pool, runner), (ref_pool, ref)):
        assert p.reserve(LANE, len(tokens))
        r.forward([SeqSpec(LANE, 0, 40, prompt=True)], tokens[:40], [1])
    other = _slot_state(states, 0)
    start = 40
    for n, size in ((5, 8), (16, 16), (37, 64), (1, 8)):
        seq = SeqSpec(LANE, start, n, prompt=True, cuts=(n - 1,) if n > 1 else ())
        piece = tokens[start : start + n]
        before = _slot_state(states, LANE)
        eager = graphs.eager(seq, piece)
        after_eager = _slot_state(states, LANE)
        for (layer, name), t in before.items():  # back to the state before the step
            states.layers[layer][name][states.slot_of[LANE]].copy_(t)
        replay = graphs.forward(seq, piece, True).clone()
        assert graphs.size_for(n) == size and graphs.captured()[-1] >= size
        assert torch.equal(replay, eager), n
        got = _slot_state(states, LANE)
        assert all(torch.equal(got[k], after_eager[k]) for k in got), n
        cut = states.take_cuts()
        want = ref.forward([seq], piece, [1])
        want_cut = ref_states.take_cuts()
        assert sorted(cut) == sorted(want_cut) == ([LANE] if n > 1 else [])
        for lane, at in want_cut.items():
            assert sorted(at) == sorted(cut[lane]) == [n - 1]
            for layer, named in at[n - 1].items():
                for name, t in named.items():
                    assert _rel(cut[lane][n - 1][layer][name], t) < 2e-2, (n, layer, name)
        assert _rel(replay, want) < 2e-2, (n, _rel(replay, want))
        assert torch.equal(replay.argmax(-1), want.argmax(-1)) or _rel(replay, want) < 5e-3
        want_state = _slot_state(ref_states, LANE)
        worst = max(_rel(got[k], want_state[k]) for k in got)
        assert worst < 2e-2, (n, worst)
        cells = [int(pool.tables[LANE, q // 16]) * 16 + q % 16 for q in range(start, start + n)]
        for st, ref_st in zip(pool.layers, ref_pool.layers):
            for name in ("k", "v"):
                assert _rel(st[name][cells], ref_st[name][cells]) < 2e-2, (n, name)
        start += n
    assert all(torch.equal(t, _slot_state(states, 0)[k]) for k, t in other.items())  # another lane's: untouched


def _chat(folder: str, dtype: str, prompt_graphs: bool) -> tuple[list[list[int]], list[int], dict]:
    """A first turn, a later one that resumes from its checkpoint and reads a short message, and
    the same later turn again; the captured prompt-graph sizes; the engine's figures."""
    cfg = EngineConfig(model=folder, device="cuda", dtype=dtype, weights="dense", parallel=1,
                       max_context=256, prefill_chunk=64, prompt_graphs=prompt_graphs)
    with Engine(cfg) as eng:
        first = eng.complete(PROMPT, GREEDY).token_ids
        later_prompt = PROMPT + first + [13, 90, 91, 92, 5, 6, 200, 201, 44]
        later = eng.complete(later_prompt, GREEDY).token_ids
        again = eng.complete(later_prompt, GREEDY).token_ids
        graphs = eng.runner.prompt_graphs
        return [first, later, again], [] if graphs is None else graphs.captured(), eng.stats()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_later_turns_read_through_prompt_graphs_with_the_eager_answers(folder: str, dtype: str) -> None:
    """float32: every answer is the eager engine's. bf16: the padded products round otherwise
    (cuBLAS picks its kernel by the row count), so the later turns are held to their first
    token (the logits themselves: the test above)."""
    eager, none, _ = _chat(folder, dtype, prompt_graphs=False)
    graphed, sizes, stats = _chat(folder, dtype, prompt_graphs=True)
    assert none == [] and sizes  # the later turn's message (and the repeat's last token) replayed
    assert stats["checkpoints"]["restores"] >= 1
    if dtype == "float32":
        assert graphed == eager
    else:
        assert graphed[0] == eager[0] and [a[0] for a in graphed[1:]] == [a[0] for a in eager[1:]]


def test_a_prompt_graph_that_does_not_capture_leaves_its_steps_eager(folder: str, caplog) -> None:
    """A prompt-graph capture that fails turns the prompt graphs off with one warning; the decode
    graphs stay and the answers are an engine's without prompt graphs."""
    eager, _, _ = _chat(folder, "float32", prompt_graphs=False)
    cfg = EngineConfig(model=folder, device="cuda", dtype="float32", weights="dense", parallel=1,
                       max_context=256, prefill_chunk=64, prompt_graphs=True)
    with Engine(cfg) as eng:
        graphs = eng.runner.prompt_graphs
        assert graphs is not None

        def broken(*args: object) -> None:
            raise RuntimeError("operation not permitted when stream is capturing")

        graphs._step = broken  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING):
            first = eng.complete(PROMPT, GREEDY).token_ids
            later = eng.complete(PROMPT + first + [13, 90, 91, 92, 5, 6, 200, 201, 44], GREEDY).token_ids
        assert eng.runner.prompt_graphs is None and eng.runner.graphs is not None
    assert [first, later] == eager[:2]
    assert caplog.text.count("short prompt steps run eagerly") == 1
