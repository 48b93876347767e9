"""Speculative decoding on state models: rejected drafts leave no trace in the layer state.

Both hybrids: tiny Qwen3-Next (gated DeltaNet layers: a recurrent matrix and a
convolution tail per lane) and tiny Gemma 3 (sliding layers of window 8: a
ring of the window's k/v per lane), in bfloat16 on the CPU, where a row's
bits do not depend on the rows beside it. A verified run of drafts keeps its
state after each row; the rows verification rejects are undone
(`StatePool.rewind`), so the lane's state equals, bit for bit, the state of
the same tokens decoded one a step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.runner import Runner
from strata.engine.types import SamplingParams
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.state import StatePool
from strata.kv.step import SeqSpec
from strata.models import load_model
from strata.models.loader import LoadedModel
from tests.models.tiny_models import save_byte_tokenizer, save_tiny

State = dict[int, dict[str, torch.Tensor]]
REPEATED = list(range(100, 130))  # a run the prompts quote twice: drafts have something to copy
PROMPT = [1, 17, 200, 33, 5, 90, 91, 255, 4, 64, 128, 7, 7, 42, 100, 3, 250, 12, 61, 8]


@pytest.fixture(scope="module", params=["qwen3_next", "gemma3"])
def folder(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, path)
    save_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def loaded(folder: Path) -> LoadedModel:
    return load_model(str(folder), device="cpu", dtype="bfloat16", progress=False)


# ---- the mechanism: a verified run, then rewind, against the same tokens decoded one a step ----

class _Lanes:
    """Three lanes of one model over a KV pool and a state pool, stepped through the engine's
    Runner: lane 0 decodes the reference one token a step, lane 1 verifies runs, lane 2 decodes
    beside it (a mixed batch)."""

    def __init__(self, loaded: LoadedModel) -> None:
        model, cfg = loaded.model, loaded.config
        self.pool = KvPool(make_format("bf16", cfg.num_kv_heads, cfg.head_dim), model.pool_layers(), 3,
                           128, 16, None)
        self.states = StatePool(model.state_layers(), 3, "cpu", model.state_dtypes())
        self.runner = Runner(model, self.pool, cfg.attn_scale, torch.device("cpu"), graphs=False,
                             states=self.states)
        for lane in range(3):
            assert self.pool.reserve(lane, 128)

    def step(self, runs: list[tuple[int, int, list[int], bool]]) -> list[torch.Tensor]:
        """(lane, start, tokens, verified) per sequence -> each sequence's logits (all its rows
        for a verified run, else its last)."""
        seqs = [SeqSpec(lane, start, len(tokens)) for lane, start, tokens, _ in runs]
        sample = [len(tokens) if verified else 1 for _, _, tokens, verified in runs]
        logits = self.runner.forward(seqs, [t for _, _, tokens, _ in runs for t in tokens], sample)
        return list(logits.split(sample))

    def state(self, lane: int) -> State:
        return self.states.export(lane)[0]


def _equal(a: State, b: State) -> bool:
    return all(torch.equal(a[layer][name], b[layer][name]) for layer in a for name in a[layer])


@pytest.mark.parametrize("run_length", [4, 11])  # 11 rows: more than gemma3's window of 8
def test_a_rewound_run_equals_its_kept_rows_decoded_one_a_step(loaded: LoadedModel, run_length: int) -> None:
    lanes = _Lanes(loaded)
    start = len(PROMPT)
    first = lanes.step([(lane, 0, PROMPT, False) for lane in range(3)])
    assert all(torch.equal(first[0], f) for f in first[1:])
    after_prompt = lanes.state(1)
    ref_tokens = [int(first[0][-1].argmax())]  # lane 0: the reference, one token a step
    ref_logits, ref_states = [], []
    for i in range(run_length + 1):
        logits = lanes.step([(0, start + i, ref_tokens[-1:], False)])[0]
        ref_logits.append(logits[0])
        ref_states.append(lanes.state(0))
        ref_tokens.append(int(logits[0].argmax()))
    companion = start  # lane 2 decodes beside each run
    for kept in range(1, run_length + 1):
        lanes.states.load(1, after_prompt)  # lane 1 back at the prompt's end; its K/V by length
        wrong = [(t + 1) % 256 for t in ref_tokens[kept:run_length]]
        run = ref_tokens[:kept] + wrong  # the pending token, kept - 1 drafts that hold, the rest not
        logits, _ = lanes.step([(1, start, run, True), (2, companion, [7], False)])
        companion += 1
        for j in range(kept):  # the kept rows' logits are the reference's, bit for bit
            assert torch.equal(logits[j], ref_logits[j])
        unrewound = lanes.state(1)
        lanes.states.rewind(1, kept)
        assert _equal(lanes.state(1), ref_states[kept - 1]), f"kept {kept} of {run_length}"
        if kept < run_length:  # negative control: the same comparison sees the rejected rows
            assert not _equal(unrewound, ref_states[kept - 1])
        nxt = lanes.step([(1, start + kept, ref_tokens[kept : kept + 1], False)])[0]
        assert torch.equal(nxt[0], ref_logits[kept])  # the lane decodes on as the reference did
        assert _equal(lanes.state(1), ref_states[kept])


def test_rewind_needs_a_kept_row(loaded: LoadedModel) -> None:
    lanes = _Lanes(loaded)
    lanes.step([(1, 0, PROMPT, False)])
    lanes.step([(1, len(PROMPT), [5, 6, 7], True)])
    with pytest.raises(ValueError, match="cannot keep 0"):
        lanes.states.rewind(1, 0)
    lanes.states.rewind(1, 2)  # a lane's run is rewound once; a later call finds nothing to undo
    lanes.states.rewind(1, 1)


# ---- the engine: --spec on a state model never changes the answer ----

def _prompt(i: int) -> list[int]:
    return [1, 50 + i] + REPEATED + [77, 78 + i] + REPEATED[:12]


Requests = list[tuple[list[int], SamplingParams]]


def _run(folder: Path, spec: int, rounds: list[Requests], parallel: int = 3) -> tuple[list, dict, State]:
    """Each round's requests together, the rounds one after the other; lane 0's state at the end."""
    cfg = EngineConfig(model=str(folder), device="cpu", dtype="bfloat16", weights="dense", max_context=256,
                       parallel=parallel, spec=spec)
    out = []
    with Engine(cfg) as eng:
        for requests in rounds:
            handles = [eng.generate(p, params) for p, params in requests]
            out.append([h.result().token_ids for h in handles])
        state = eng.call(lambda: eng.states.export(0)[0]).result()  # type: ignore[union-attr]
        return out, eng.stats(), state


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _decoys(folder: Path, prompt: list[int], ats: tuple[int, ...]) -> Requests:
    """Finished conversations that continue `prompt` otherwise than the model does from token
    `at` of its answer: a later request drafting from them gets drafts rejected there."""
    answer = _run(folder, 0, [[(prompt, _greedy(40))]], parallel=1)[0][0][0]
    return [(prompt + answer[:at] + [(t + 7) % 256 for t in answer[at : at + 5]], _greedy(1)) for at in ats]


def test_mixed_lanes_give_the_same_tokens_with_and_without_drafts(folder: Path) -> None:
    first = [(_prompt(i), _greedy(30)) for i in range(3)]
    decoys = _decoys(folder, _prompt(0), (5, 12, 20))
    again = [
        (_prompt(0), _greedy(36)),  # drafts from its first answer and the decoys
        (_prompt(1), SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True)),
        (_prompt(2), SamplingParams(max_tokens=24, logprobs=2, repetition_penalty=1.3, ignore_eos=True)),
        (_prompt(0), SamplingParams(max_tokens=30, stop_token_ids=[7])),
        *[(_prompt(0), SamplingParams(max_tokens=30, temperature=0.3, seed=s, ignore_eos=True))
          for s in range(3)],
    ]
    plain, plain_stats, _ = _run(folder, 0, [first, decoys, again])
    drafted, stats, _ = _run(folder, 4, [first, decoys, again])
    assert drafted == plain
    spec = stats["speculation"]
    assert spec["accepted_tokens"] > 0  # drafts were kept ...
    assert spec["drafted_tokens"] > spec["accepted_tokens"]  # ... and some rejected and rewound
    assert stats["steps"] < plain_stats["steps"]


def test_one_lane_after_rejected_drafts_holds_the_state_of_a_run_without_them(folder: Path) -> None:
    """One lane: the last request drafts from the decoys, whose drafts are rejected; its answer,
    the lane's tokens and the lane's state at the end equal the run without drafts."""
    decoys = _decoys(folder, _prompt(0), (6, 13, 22))
    rounds = [[(_prompt(0), _greedy(30))], *[[d] for d in decoys], [(_prompt(0), _greedy(34))]]
    plain, _, plain_state = _run(folder, 0, rounds, parallel=1)
    drafted, stats, state = _run(folder, 8, rounds, parallel=1)
    assert drafted == plain
    assert stats["speculation"]["drafted_tokens"] > stats["speculation"]["accepted_tokens"] > 0
    assert _equal(state, plain_state)
    # negative control: the state of the lane holding the same conversation and one token more
    # is told apart by the same comparison
    longer = [[(_prompt(0) + plain[-1][0], SamplingParams(max_tokens=0))]]
    _, _, other = _run(folder, 0, rounds + longer, parallel=1)
    assert not _equal(other, plain_state)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_seeded_sampling_draws_the_same_tokens(folder: Path, temperature: float, top_p: float) -> None:
    greedy = [(_prompt(i), _greedy(24)) for i in range(2)]
    sampled = [(_prompt(s % 2), SamplingParams(max_tokens=20, temperature=temperature, top_p=top_p,
                                               seed=s, ignore_eos=True)) for s in range(8)]
    plain, _, _ = _run(folder, 0, [greedy, sampled], parallel=4)
    drafted, stats, _ = _run(folder, 6, [greedy, sampled], parallel=4)
    assert drafted == plain
    assert stats["speculation"]["drafted_tokens"] > 0


def test_turns_with_checkpoints_and_parking_match(folder: Path) -> None:
    """Three conversations through two lanes (parked and restored with their states), each
    repeated (a regenerate: from the checkpoint before its prompt's end, drafting from its first
    answer) and continued for a second turn (from the whole state): the same answers and the
    same reuse with drafts as without."""
    greedy = _greedy(24)
    outs = {}
    for spec in (0, 4):
        cfg = EngineConfig(model=str(folder), device="cpu", dtype="bfloat16", weights="dense", max_context=256,
                           parallel=2, spec=spec, prompt_cache=4)
        with Engine(cfg) as eng:
            first = [eng.complete(_prompt(i), greedy) for i in range(3)]
            again = [eng.complete(_prompt(i), greedy) for i in range(3)]
            second = [eng.complete(_prompt(i) + first[i].token_ids + REPEATED[:8], greedy) for i in range(3)]
            results = [[r.token_ids for r in rs] for rs in (first, again, second)]
            outs[spec] = (results, [r.cached_tokens for r in again + second], eng.stats())
    assert outs[4][:2] == outs[0][:2]
    assert all(c > 0 for c in outs[4][1])  # every repeat and second turn resumed
    assert outs[4][2]["conversation_parks"] > 0 and outs[4][2]["speculation"]["accepted_tokens"] > 0
